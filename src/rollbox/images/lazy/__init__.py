"""Lazy loading of image layers: a per-node FUSE daemon serves layer files from a sparse node
cache, fetching missing chunks from a chunk store on first read; EROFS is mounted file-backed on
top (by :class:`rollbox.images.mounts.LayerMounts`), so a node has one page cache per layer.

Owns everything under ``<image store root>/lazy`` (see :mod:`.paths`), the daemon process
(:mod:`.daemon`), its supervisor and the layer records (:mod:`.loader`), and the
``GET /v1/images/stats`` route (:mod:`.api`). Must not touch the chunk store's contents (it only
reads through :mod:`rollbox.images.chunks`) nor compose sandbox mounts.
"""
from typing import Any

__all__ = ["LazyLoader", "loader_for", "register_lazy_image"]


def __getattr__(name: str) -> Any:
    # Lazy: store.py imports .paths, which must not pull in the loader (and the chunk store).
    if name in __all__:
        from rollbox.images.lazy import loader

        return getattr(loader, name)
    raise AttributeError(name)
