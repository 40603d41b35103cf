"""Layer storage of projects on one node: accounting, limits, and images uploaded through the
api.

A project owns the images its sandboxes snapshot and the images it uploads (``config["owner"]``);
its usage is the size of the distinct layers of those images, not counting layers of the
node's own images (a snapshot's base). Deleting an image frees its share at once (its layers
go with the next gc). New layers (snapshots, uploads) are admitted against the project's limit
and the image store's free-space reserve; the final check and the tag happen under one lock,
so two concurrent ones can not both pass the limit, and a refused layer is removed again.

An upload's tar is extracted by SandboxFS (the file API's safe-tar code: in-root resolution, no
device nodes, no setuid bits, no xattrs, capped bytes and entries) into a private staging dir,
scrubbed like a snapshot (every ``__pycache__``; git history beyond HEAD) and packed by
mkfs.erofs on this host: a client-supplied filesystem image is never mounted.

Owns: this accounting and the upload staging. Not: the store's layout (images.store), tar
extraction (rollbox.hostfs), sandboxes and their snapshots (edge.edge).
"""
from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from rollbox.hostfs import SandboxFS
from rollbox.config import Settings
from rollbox.errors import (
    BadRequest, CapacityExceeded, NotFound, PayloadTooLarge, QuotaExceeded, RollboxError,
    without_paths,
)
from rollbox.images import git
from rollbox.images.scrub import dropped_bytecode
from rollbox.images.store import Image, ImageStore, validate_name
from rollbox.models import ImageInfo, LayerUsage

UPLOAD_MAX_ENTRIES = 1_000_000
RESERVE_MIN_BYTES = 5 << 30
RESERVE_FRACTION = 0.05


def project_image_name(name: str) -> str:
    """Validate the name of an image a project makes (snapshot, upload). Names without a "/"
    (python:3.11, debian:bookworm) are the operator's: a project must not squat one before the
    node builds it."""
    validate_name(name)
    if "/" not in name.split(":")[0]:
        raise BadRequest(f"image name {name!r} needs a path, e.g. 'myproject/env:1'",
                         image=name)
    return name


@dataclass(eq=False)
class Room:
    """What a new layer of a project may take now, and the error past that."""

    bytes: int
    error: RollboxError
    project: str = ""


class LayerStorage:
    def __init__(self, store: ImageStore, settings: Settings,
                 limit_mib: Callable[[str], int | None] | None = None) -> None:
        """``limit_mib``: a project's layer quota in MiB (None: the node's default)."""
        self.store = store
        self.settings = settings
        self._limit_mib = limit_mib
        self._lock = asyncio.Lock()
        # Rooms promised to layers being made (uploads, snapshots) until their commit: what
        # their staging copies may still write.
        self._promised: dict[int, Room] = {}

    # ---- accounting ----------------------------------------------------------------------
    def limit_bytes(self, project: str) -> int:
        mib = self._limit_mib(project) if self._limit_mib is not None else None
        return (self.settings.project_layer_mib if mib is None else mib) << 20

    def reserve_bytes(self) -> int:
        if self.settings.image_store_reserve_bytes is not None:
            return self.settings.image_store_reserve_bytes
        vfs = os.statvfs(self.store.root)
        return max(RESERVE_MIN_BYTES, int(vfs.f_blocks * vfs.f_frsize * RESERVE_FRACTION))

    def free_bytes(self) -> int:
        vfs = os.statvfs(self.store.root)
        return vfs.f_bavail * vfs.f_frsize

    def _layer_size(self, digest: str) -> int:
        try:
            return int(self.store.layer_meta(digest).get("size", 0))
        except RollboxError:
            return 0  # removed meanwhile

    def _used(self, project: str, extra: Iterable[str] = ()) -> tuple[int, int]:
        """(bytes, images) of ``project``'s layers, counting ``extra`` layers as its too."""
        images = self.store.list()
        node = {d for i in images if i.config.get("owner") is None for d in i.layers}
        own = [i for i in images if i.config.get("owner") == project]
        layers = ({d for i in own for d in i.layers} | set(extra)) - node
        return sum(self._layer_size(d) for d in layers), len(own)

    def usage(self, project: str) -> LayerUsage:
        used, images = self._used(project)
        return LayerUsage(project=project, used_bytes=used, limit_bytes=self.limit_bytes(project),
                          images=images, store_free_bytes=self.free_bytes(),
                          store_reserve_bytes=self.reserve_bytes())

    def room(self, project: str) -> Room:
        """Bytes a new layer of ``project`` may take now: CapacityExceeded (retryable: space
        may come back) when the store is at its reserve or the project's rest of its limit is
        held by uploads under way, QuotaExceeded at the project's limit. Rooms promised to
        uploads under way count as taken."""
        promised = list(self._promised.values())
        free = self.free_bytes() - sum(r.bytes for r in promised)
        reserve = self.reserve_bytes()
        full = CapacityExceeded(
            f"the image store has {max(free, 0) >> 20} MiB free (beyond what uploads under "
            f"way may still take), at or below its reserve of {reserve >> 20} MiB: no new "
            "layers now", free_bytes=free, reserve_bytes=reserve)
        if free <= reserve:
            raise full
        used, _ = self._used(project)
        held = sum(r.bytes for r in promised if r.project == project)
        limit = self.limit_bytes(project)
        over = QuotaExceeded(f"project {project!r} has {used >> 20} of its {limit >> 20} MiB of "
                             "layer storage in use; delete images to make room",
                             used_bytes=used, limit_bytes=limit)
        busy = CapacityExceeded(f"project {project!r}: {held >> 20} MiB of its layer storage "
                                "is held by uploads under way; retry when they are done",
                                used_bytes=used, held_bytes=held, limit_bytes=limit)
        if used >= limit:
            raise over
        if used + held >= limit:
            raise busy
        if limit - used - held < free - reserve:
            return Room(limit - used - held, busy if held else over)
        return Room(free - reserve, full)

    def promise(self, project: str, want: int) -> Room:
        """:meth:`room`, at most ``want`` bytes of it, promised to one upload of ``project``
        until :meth:`release`: concurrent uploads (and snapshots) count the promises, so the
        uploads' staging copies together stay within the project's limit and above the store's
        reserve. Snapshots take no promise: many run at once (RL), most far below their cap,
        and holding the cap of each would refuse them; the final check still bounds them."""
        room = self.room(project)
        promised = Room(min(want, room.bytes), room.error, project)
        self._promised[id(promised)] = promised
        return promised

    def release(self, room: Room) -> None:
        self._promised.pop(id(room), None)

    async def commit(self, project: str, name: str, layers: list[str], config: dict,
                     new_layer: str | None) -> Image:
        """Tag ``name`` = ``layers`` (``new_layer`` among them; None: a machine snapshot's
        image, no new layer) for ``project`` once the final check passes; on any refusal
        ``new_layer`` is removed again (unless something else uses it)."""
        async with self._lock:
            try:
                if self.store.exists(name):
                    raise BadRequest(f"image {name!r} was created meanwhile", image=name)
                used, _ = self._used(project, layers)
                limit = self.limit_bytes(project)
                if used > limit:
                    raise QuotaExceeded(
                        f"the new layer would take project {project!r} to {used >> 20} MiB of "
                        f"layer storage, above its {limit >> 20} MiB", used_bytes=used,
                        limit_bytes=limit)
                return self.store.tag(name, layers, {**config, "owner": project})
            except BaseException:
                if new_layer is not None:
                    await asyncio.to_thread(self.store.remove_layer_if_unused, new_layer)
                raise

    # ---- images of a project -------------------------------------------------------------
    def info(self, image: Image) -> ImageInfo:
        return ImageInfo(name=image.name, layers=list(image.layers),
                         owner=image.config.get("owner"), created=image.created,
                         size=sum(self._layer_size(d) for d in image.layers))

    def visible(self, project: str | None) -> list[ImageInfo]:
        """The node's images and ``project``'s own (None: every image, for admins)."""
        return [self.info(i) for i in self.store.list()
                if project is None or i.config.get("owner") in (None, project)]

    def delete(self, name: str, project: str | None) -> Image:
        """Remove ``project``'s image ``name`` (None: an admin, any project's); returns it.
        The node's own images are the operator's (`rollbox image rm`); another project's look
        absent."""
        try:
            image = self.store.resolve(validate_name(name))
        except NotFound:  # the store's own error names its host path
            raise NotFound(f"no image {name!r}", image=name) from None
        owner = image.config.get("owner")
        if owner is None:
            raise BadRequest(f"image {name!r} is one of the node's own images; the operator "
                             "removes it with `rollbox image rm`", image=name)
        if project is not None and owner != project:
            raise NotFound(f"no image {name!r}", image=name)
        self.store.remove(image.name)
        return image

    async def upload(self, project: str, name: str, chunks: AsyncIterator[bytes],
                     base: Image | None) -> ImageInfo:
        """Build image ``name`` for ``project`` from a tar stream (optionally gz/bz2/xz): one
        new layer over ``base``'s layers (or alone). Capped by ``image_upload_max_bytes`` (bytes
        of its files) and by the project's room; nothing stays behind when refused."""
        project_image_name(name)
        if self.store.exists(name):
            raise BadRequest(f"image {name!r} already exists; pick a new name", image=name)
        upload_max = self.settings.image_upload_max_bytes
        room = self.promise(project, upload_max)
        try:
            return await self._upload(project, name, chunks, base, room)
        finally:
            self.release(room)

    async def _upload(self, project: str, name: str, chunks: AsyncIterator[bytes],
                      base: Image | None, room: Room) -> ImageInfo:
        upload_max = self.settings.image_upload_max_bytes
        cap = room.bytes
        staging = self.store.staging_dir("upload")
        try:
            root = staging / "rootfs"
            root.mkdir(0o755)
            fs = SandboxFS(root, 0, max_upload=cap, max_entries=UPLOAD_MAX_ENTRIES)
            try:
                await fs.upload_tar("/", chunks)
            except PayloadTooLarge as exc:
                if exc.details.get("limit") == cap and cap < upload_max:
                    raise room.error from exc
                raise
            finally:
                fs.close()

            def build() -> str:
                repos = git.process_tree(root, keep_history=False, scratch=staging)
                # Removed from the staging tree (ours), not excluded by mkfs.erofs: one
                # argument per path would let a tree of many go past ARG_MAX.
                for rel in dropped_bytecode(root, keep_library=False):
                    path = root / rel
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                return self.store.add_layer_from_dir(root, source=f"upload:{project}",
                                                     git_repos=repos)

            try:
                digest = await asyncio.to_thread(build)
            except RollboxError as exc:
                raise without_paths(exc, {staging / "rootfs": "/",
                                          staging: "<staging>"}) from None
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        layers = (list(base.layers) if base is not None else []) + [digest]
        image = await self.commit(project, name, layers,
                                  dict(base.config) if base is not None else {}, digest)
        meta = self.store.layer_meta(digest)
        return self.info(image).model_copy(update={"layer": digest, "files": meta.get("files")})
