"""The node's MAC keys: a configured secret, else a root-only key file made once.

The api's port tokens (``api.ports``) and the E2B door's envd access tokens
(``compat.e2b.state``) are HMACs under a key that must outlive a restart and be shared by the
replicas that read the same file. :func:`node_secret` is the one way to get such a key.

Owns: reading and making those key files. Does not issue or check tokens (each caller does,
with its own message format) and knows nothing of what the key protects.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def node_secret(configured: str | None, path: Path) -> bytes:
    """``configured`` (a setting) as bytes, else the hex key in ``path``, made once (32 random
    bytes, mode 0600). The file appears whole: it is written beside ``path`` and linked into
    place, so a concurrent reader never sees it half written, and the first writer wins (the
    others read its key). OSError if it can not be made; ValueError if it holds no hex key."""
    if configured:
        return configured.encode()
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    key = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        key = bytes.fromhex(path.read_text().strip())
    finally:
        tmp.unlink(missing_ok=True)
    return key
