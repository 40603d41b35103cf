"""Lazy loading of image layers: a per-node FUSE daemon serves layer files from a sparse node
cache, fetching missing chunks from a chunk store on first read; EROFS is mounted file-backed on
top (by :class:`rollbox.images.mounts.LayerMounts`, given the loader as its ``LazyLayers``:
:mod:`.mounts`), so a node has one page cache per layer.

Owns everything under ``<image store root>/lazy`` (see :mod:`.paths`), the daemon process
(:mod:`.daemon`), its supervisor and the layer records (:mod:`.loader`); the stats it keeps
are served by the api's ``GET /v1/images/stats`` (``api/routes/images.py``). Must not touch the chunk store's contents (it only
reads through :mod:`rollbox.images.chunks`) nor compose sandbox mounts.
"""
