"""Cluster deployment: many nodes on Ray, N stateless api replicas behind one port, PostgreSQL.

Owns the processes of a cluster and their wiring (``rollbox cluster up|join|status``): the Ray
head and workers, one edge per Ray node as a long-lived actor pinned to it, the api replicas,
the PostgreSQL server, the cluster token. Sandboxes are never Ray actors or tasks; the data path
(exec streams, files, tar) goes api -> edge over HTTP, not through Ray. The embedded default
(``rollbox.embedded``) needs none of this.
"""
