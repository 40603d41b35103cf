"""E2B-compatible front door: E2B's REST control plane under ``/e2b`` and its in-sandbox
``envd`` protocol (Connect RPC with JSON envelopes, ``/files``, ``/health``) under
``/e2b/envd``, so the unmodified ``e2b`` SDK works with ``E2B_API_URL=<rollbox>/e2b`` and
``E2B_SANDBOX_URL=<rollbox>/e2b/envd``.

Owns only its routes and the E2B <-> rollbox mapping (templates -> images, metadata -> labels,
pids -> exec ids, access tokens, the paused mark). Everything goes through ``api.placement``
and the edge interface; it must not touch the core ``/v1`` routes or the edge's internals.
"""
from __future__ import annotations

from rollbox.compat.e2b.mount import E2BState, mount

__all__ = ["E2BState", "mount"]
