"""Squash: collapse consecutive layers of an image into one EROFS layer, offline.

Each layer is mounted privately (file-backed EROFS, read-only) under a staging directory and
copied out *with* its overlay markers (whiteout devices, opaque xattrs); the copies are then
merged top-over-bottom with :func:`rollbox.images.overlay.merge_layer_dir`, the same code the OCI
importer uses, so the squashed layer over the untouched lower layers shows exactly the tree the
original stack showed. A squash from layer 0 has nothing below it: its markers are dropped.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from rollbox.errors import BadRequest, InfraError
from rollbox.images.mountpoints import MOUNT_FLAGS
from rollbox.images.overlay import SMALL_LAYER_BYTES, merge_layer_dir, strip_overlay_markers
from rollbox.images.store import Image, ImageStore, Progress
from rollbox.isolation import syscalls


def default_squash_start(store: ImageStore, image: Image,
                         small_bytes: int = SMALL_LAYER_BYTES) -> int | None:
    """Start of the trailing run of small layers (>= 2 of them), or None if there is none.

    Only a trailing run: squashing a run in the middle would change the digests of the layers
    above it no less, and the top layers are the ones that pile up (workspace, toolkits)."""
    start = len(image.layers)
    while start > 0 and int(store.layer_meta(image.layers[start - 1])["size"]) < small_bytes:
        start -= 1
    return start if len(image.layers) - start >= 2 else None


def _copy_layer(store: ImageStore, digest: str, mnt: Path, dest: Path) -> None:
    mnt.mkdir()
    syscalls.mount(str(store.layer_path(digest)), mnt, "erofs", MOUNT_FLAGS)
    try:
        # cp -a keeps ownership, modes, times, hard links, xattrs (trusted.overlay.opaque as
        # root) and the 0:0 character devices that are whiteouts.
        proc = subprocess.run(["cp", "-a", "--", f"{mnt}/.", str(dest)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise InfraError(f"copying layer {digest} failed: {proc.stderr.strip()[-500:]}")
    finally:
        syscalls.umount(mnt, syscalls.MNT_DETACH)
    mnt.rmdir()


def squash_image(store: ImageStore, name: str, *, start: int | None = None,
                 tag: str | None = None, progress: Progress | None = None) -> Image:
    """Replace ``layers[start:]`` of image ``name`` by one layer; tag the result as ``tag``
    (default: ``name`` itself). ``start`` None: the trailing run of small layers."""
    image = store.resolve(name)
    n = len(image.layers)
    if start is None:
        start = default_squash_start(store, image)
        if start is None:
            raise BadRequest(f"image {name!r} has no run of 2 or more small layers on top; "
                             "give --from N to squash layers N.. regardless of size")
    if not 0 <= start <= n - 2:
        raise BadRequest(f"--from {start}: image {name!r} has {n} layers; need 0 <= N <= {n - 2}")
    say = progress or (lambda _m: None)
    staging = store.staging_dir("squash")
    try:
        group = staging / "merged"
        group.mkdir()
        for i in range(start, n):
            digest = image.layers[i]
            say(f"copying layer {i} ({digest[:19]})")
            dest = group if i == start else staging / f"l{i}"
            dest.mkdir(exist_ok=True)
            _copy_layer(store, digest, staging / f"m{i}", dest)
            if dest is not group:
                merge_layer_dir(group, dest, keep_whiteouts=start > 0)
                shutil.rmtree(dest)
        if start == 0:
            strip_overlay_markers(group)
        say("building the squashed layer")
        digest = store.add_layer_from_dir(
            group, source=f"squash:{image.name}[{start}:{n}]", progress=progress)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return store.tag(tag or image.name, list(image.layers[:start]) + [digest], image.config)
