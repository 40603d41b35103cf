"""fncall backend: stateless calls (language + code + files + stdin -> stdout, stderr, exit,
status, times) served from warm pools of locked-down container sandboxes.

Owns ``pool`` (host side: pools, sizing, worker replacement) and ``worker`` (the fork-server
source run inside each warm sandbox by the image's python). Creates its sandboxes only through
the edge; must not touch the container backend's or the edge's internals beyond opening the
worker's exec on the sandbox's agent channel.
"""
from rollbox.backends.fncall.pool import FNCALL_IMAGE, FnCallBackend, PoolConfig

__all__ = ["FNCALL_IMAGE", "FnCallBackend", "PoolConfig"]
