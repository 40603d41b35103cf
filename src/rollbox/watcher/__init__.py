"""Watcher: the cluster's view of its nodes, kept by probing every edge every second.

Owns the per-node view placement decides from (``rollbox.placement.view.ClusterView``): health
(alive, suspect, dead), capacity, live counts per node, backend and project, cached layers; a
node that stops answering becomes suspect, then dead, and its sandboxes are reported dead with
reason ``node_lost``. Rebuilds everything by re-polling after its own restart: holds no state
that is not on an edge. Reconciles the quota ledger with the edges' live sets. Does not create,
place or delete sandboxes itself, except telling a returning edge which of its sandboxes were
declared lost meanwhile.
"""
