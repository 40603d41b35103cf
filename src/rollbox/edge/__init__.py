"""The edge: one per node. Owns the node's sandboxes end to end: admission, the journal,
launch through a backend, exec sessions, TTL, re-adoption or clean-up after its own restart,
and verified teardown. Must not know about HTTP, API keys or other nodes."""
