"""fncall: stateless calls (language + code + files + stdin -> stdout, stderr, exit, status,
times) served from warm pools of locked-down container sandboxes.

A service on top of the edge, not a backend: it makes its worker sandboxes as any client of
``EdgeAPI`` does (local or remote edge alike). Owns ``pool`` (host side: pools, sizing, worker
replacement) and ``worker`` (the fork-server source run inside each warm sandbox by the image's
python). Its HTTP routes are the api's (``api/routes/fncall.py``). Must not touch the container
backend's or the edge's internals beyond opening the worker's exec on the sandbox's agent
channel (``EdgeAPI.platform_exec``).
"""
from rollbox.fncall.pool import FNCALL_IMAGE, FnCallBackend, PoolConfig

__all__ = ["FNCALL_IMAGE", "FnCallBackend", "PoolConfig"]
