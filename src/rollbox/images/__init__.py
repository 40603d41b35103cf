"""Image layer store: EROFS layers addressed by content, named images, shared read-only mounts.

Owns everything under ``Settings().images_dir``: ``layers/`` (``<digest>.erofs`` + metadata),
``refs/`` (named images), ``mnt/`` (one read-only mount per layer per node), ``tmp/`` (staging),
``logs/``, ``manifests/`` and ``lazy/``. Must not compose per-sandbox overlays, idmap mounts or
know about sandboxes: the container backend does that on top of
:meth:`~rollbox.images.mounts.LayerMounts.ensure_mounted`; nor import a backend, the edge or
anything above (a build's sandbox comes in through :class:`.sources.commands.BuildSandboxes`).

Its modules, each importing only those above it in this list (no cycle)::

    names         image names, layer digests (the grammar)
    mountpoints   mnt/<digest> as the kernel has them: users, unmount, locks
    lazy.paths    the lazy loader's on-disk layout
    store         layer files, refs, gc                      (ImageStore)
    overlay       the overlayfs format of a layer tree; scrub: what layers leave out
    stores        chunk stores: base, local (dir://), posix, s3; open_store
    chunks        push / pull of layers through a chunk store
    layer_files   a layer as a plain local file (VM disks; a lazy one pulled whole)
    mounts        one read-only mount per layer; lazy layers through the LazyLayers protocol
    lazy.loader   the FUSE daemon's supervisor (a LazyLayers); lazy.daemon; lazy.mounts wires it
    git           git history of layers (the only host-side git)
    snapshot      a writable layer -> a layer (snapshots, builds); snapshot_tar (a VM's stream)
    sources       directory, OCI archive, debootstrap, busybox, commands (a caller's sandbox)
    squash        consecutive layers -> one

The ``GET /v1/images/stats`` route lives with the api (``api/routes/images.py``).
"""
