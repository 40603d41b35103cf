"""The grammar of image names and layer digests, checked by every module of
:mod:`rollbox.images` (the store's layout, its mount points, chunk stores, the lazy daemon).

A leaf: imports nothing of rollbox but the errors.
"""
from __future__ import annotations

import re

from rollbox.errors import BadRequest

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._\-/]*(:[A-Za-z0-9._\-]+)?")
NAME_MAX = 200
DIGEST_RE = re.compile(r"sha256-[0-9a-f]{64}")


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid image name, else raise BadRequest."""
    if not isinstance(name, str) or not name:
        raise BadRequest("image name must be a non-empty string")
    if len(name) > NAME_MAX:
        raise BadRequest(f"image name longer than {NAME_MAX} characters", name=name[:NAME_MAX])
    repo = name.split(":")[0]
    if (not NAME_RE.fullmatch(name) or repo.endswith("/")
            or any(part in ("", ".", "..") for part in repo.split("/"))):
        raise BadRequest(
            f"invalid image name {name!r}: expected [a-z0-9][a-z0-9._-/]*(:[A-Za-z0-9._-]+)?",
            name=name,
        )
    return name


def validate_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise BadRequest(f"invalid layer digest {digest!r}: expected sha256-<64 hex>")
    return digest


def is_digest(value: str) -> bool:
    return bool(DIGEST_RE.fullmatch(value))
