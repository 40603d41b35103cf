"""One shared read-only mount per layer per node, at ``<store root>/mnt/<digest>``.

Every sandbox on the node that uses a layer stacks its overlay on the same mount, so the layer
has one page cache. File-backed EROFS needs no loop device: ``mount(2)`` with the file as source.
State lives in the kernel (``/proc/self/mountinfo``, :mod:`.mountpoints`), so a restarted
process finds its mounts.

A lazy layer's file is served by the lazy-loading daemon; these mounts get it through the
:class:`LazyLayers` they are given (the node's loader: :mod:`rollbox.images.lazy.mounts` wires
it) and never import the loader. Must not compose per-sandbox overlays.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

from rollbox.errors import InfraError
from rollbox.images.lazy.paths import LazyPaths
from rollbox.images.mountpoints import MOUNT_FLAGS, LayerMountPoints
from rollbox.images.store import ImageStore
from rollbox.isolation import syscalls

__all__ = ["LayerMounts", "LazyLayers"]


class LazyLayers(Protocol):
    """Files of lazy layers, served by one daemon generation at a time
    (:class:`rollbox.images.lazy.loader.LazyLoader`)."""

    def ensure_layer_sync(self, layer: str) -> Path:
        """The served file of ``layer``, its first chunk fetched (the daemon started or
        repaired); a typed, retryable error if the chunk can not be had."""
        ...

    def generation(self) -> int:
        """The daemon generation serving now (its files' paths name it)."""
        ...

    def serves(self, generation: int) -> bool:
        """Whether daemon ``generation`` still runs and answers (a mount made on its file
        is good)."""
        ...


class LayerMounts(LayerMountPoints):
    """Mounts layers of ``store`` read-only, once per node; thread-, async- and process-safe.
    ``lazy``: serves the store's lazy layers (None: a lazy layer is refused)."""

    def __init__(self, store: ImageStore, lazy: LazyLayers | None = None) -> None:
        super().__init__(store.mnt_dir, store.root)
        self.store = store
        self.lazy = lazy
        self._verified: dict[str, int] = {}  # digest -> st_dev of its mounted root
        self._lazy: dict[str, int] = {}  # lazy layer -> daemon generation it is mounted on

    def ensure_mounted(self, digest: str) -> Path:
        """Mount the layer if it is not mounted yet; return its read-only mount point."""
        target = self.mount_point(digest)
        # Hot path (every sandbox start): a layer this process saw mounted stays mounted
        # until unmount(); checked with one stat instead of parsing mountinfo.
        dev = self._verified.get(digest)
        if dev is not None:
            try:
                if os.stat(target).st_dev == dev and (
                        digest not in self._lazy or self._lazy_healthy(digest)):
                    return target
            except OSError:
                pass
            self._verified.pop(digest, None)
        path = self._ensure_mounted_slow(digest)
        self._verified[digest] = os.stat(path).st_dev
        return path

    def _lazy_layers(self, digest: str) -> LazyLayers:
        if self.lazy is None:
            raise InfraError(f"layer {digest} is served lazily and these layer mounts have no "
                             "lazy loader", digest=digest)
        return self.lazy

    def _lazy_healthy(self, digest: str) -> bool:
        # A lazy layer's mount is good while the daemon generation it was mounted on lives.
        return self._lazy_layers(digest).serves(self._lazy[digest])

    def _ensure_mounted_slow(self, digest: str) -> Path:
        lazy_gen = None
        if self.store.is_lazy(digest):
            # Starts/repairs the lazy-loading daemon and fetches the layer's first chunk:
            # a dead store fails here with a typed, retryable error.
            lazy = self._lazy_layers(digest)
            layer = lazy.ensure_layer_sync(digest)
            lazy_gen = lazy.generation()
        else:
            layer = self.store.layer_path(digest)
        target = self.mount_point(digest)
        with self._locked(digest):
            current = self._current(digest)
            if current is not None:
                fstype, source = current
                if fstype == "erofs" and os.path.realpath(source) == os.path.realpath(layer):
                    self._note_lazy(digest, lazy_gen)
                    return target
                if not (fstype == "erofs" and self._stale_lazy_source(source)):
                    raise InfraError(f"{target} has a foreign mount ({fstype} from {source})")
                # Mounted on a crashed lazy daemon's file: replace it unless a sandbox uses it.
                users = self.users(digest)
                if users:
                    raise InfraError(f"layer {digest} is mounted on a crashed lazy-loading "
                                     f"daemon and still used by {len(users)} mount(s); retry "
                                     "once they are gone", digest=digest)
                try:
                    syscalls.umount(target, syscalls.UMOUNT_NOFOLLOW)
                except OSError as exc:
                    raise InfraError(f"cannot unmount stale lazy layer {target}: {exc}") from exc
            target.mkdir(mode=0o755, exist_ok=True)
            try:
                syscalls.mount(str(layer), target, "erofs", MOUNT_FLAGS)
            except OSError as exc:
                raise InfraError(f"cannot mount layer {digest} at {target}: {exc}") from exc
            self._note_lazy(digest, lazy_gen)
            return target

    def _note_lazy(self, digest: str, generation: int | None) -> None:
        if generation is None:
            self._lazy.pop(digest, None)
        else:
            self._lazy[digest] = generation

    def _stale_lazy_source(self, source: str) -> bool:
        lazy_fs = os.path.realpath(LazyPaths(self.store.root).fs) + "/"
        return os.path.normpath(os.path.join(os.getcwd(), source)).startswith(lazy_fs)

    async def ensure_mounted_async(self, digest: str) -> Path:
        return await asyncio.to_thread(self.ensure_mounted, digest)

    def unmount(self, digest: str) -> None:
        """Unmount the layer (no-op if not mounted); InfraError if a sandbox still uses it."""
        self._verified.pop(digest, None)
        super().unmount(digest)
