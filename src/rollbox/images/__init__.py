"""Image layer store: EROFS layers addressed by content, named images, shared read-only mounts.

Owns everything under ``Settings().images_dir``: ``layers/`` (``<digest>.erofs`` + metadata),
``refs/`` (named images), ``mnt/`` (one read-only mount per layer per node), ``tmp/`` (staging)
and ``logs/``. Builds layers from directories, OCI/docker archives, debootstrap and overlayfs
upper dirs. Must not compose per-sandbox overlays, idmap mounts or know about sandboxes: the
container backend does that on top of :meth:`LayerMounts.ensure_mounted`.
"""
