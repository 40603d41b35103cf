"""The api's uvicorn helpers: :class:`BackgroundServer` and :func:`serve_app` live one layer
down in ``rollbox.edge.server`` (the edge's HTTP service uses them too); re-exported here."""
from rollbox.edge.server import BackgroundServer, serve_app

__all__ = ["BackgroundServer", "serve_app"]
