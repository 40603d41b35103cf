"""``dir://``: a chunk store in a local directory (the embedded default).

Objects are written under a temp name unique per host and process, then renamed into place
(atomic on POSIX), so readers never see a partial object and concurrent writers of the same
content need no lock (objects are immutable and content-addressed; refs: last writer wins).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import IO

from rollbox.errors import StoreUnreachable
from rollbox.images.stores.base import ObjectStore


class FileChunkStore(ObjectStore):
    """A directory tree (``dir://``; ``posix://`` is :class:`rollbox.images.stores.posix.
    PosixChunkStore`, the same tree on a filesystem other nodes share).

    Writes go to a temp name unique per host and process, then ``rename``; no locks, no
    reliance on O_EXCL or mtime across clients."""

    shared = False  # other nodes read this tree (posix://)

    def __init__(self, url: str, root: Path, *, compression: str = "none",
                 latency_ms: float = 0.0) -> None:
        super().__init__(url, compression, latency_ms)
        self.root = root
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {url}: {exc}", store=url) from exc
        self._tag = f"{socket.gethostname()}.{os.getpid()}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def _get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            if not self.root.is_dir():
                raise StoreUnreachable(f"chunk store {self.url}: {self.root} is gone",
                                       store=self.url) from None
            raise KeyError(key) from None
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {self.url}: {exc}", store=self.url) from exc

    def _has(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {self.url}: {exc}", store=self.url) from exc

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.parent / f".{path.name}.{self._tag}.{os.urandom(4).hex()}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                self._written(f)
            os.chmod(tmp, 0o644)
            os.rename(tmp, path)
            self._renamed(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreUnreachable(f"chunk store {self.url}: write {key}: {exc}",
                                   store=self.url) from exc

    def _written(self, f: IO[bytes]) -> None:
        """After an object's bytes are written to its temp file (before the rename)."""

    def _renamed(self, directory: Path) -> None:
        """After an object is renamed into ``directory``."""
