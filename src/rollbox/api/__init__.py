"""HTTP API: routes, auth, error mapping, streaming (NDJSON, tar) between trainers and edges.

Owns the wire behaviour only. Talks to edges solely through ``edge.interface.EdgeAPI`` via
``placement``; never touches sandboxes, hosts or the edge's own state directly.
"""
from rollbox.api.app import create_app
from rollbox.api.server import BackgroundServer, serve_app

__all__ = ["create_app", "serve_app", "BackgroundServer"]
