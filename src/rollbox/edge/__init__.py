"""The edge: one per node. Owns the node's sandboxes end to end: admission, the journal,
launch through a backend, exec sessions, TTL, re-adoption or clean-up after its own restart,
and verified teardown. The core (``edge.edge`` and what it uses) must not know about HTTP, API
keys or other nodes; ``edge.service`` serves one edge's ``EdgeAPI`` over HTTP to the api
replicas of a cluster (cluster token), ``edge.remote`` is the api's client of it, ``edge.wire``
what both speak."""
