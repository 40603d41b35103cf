"""``posix://``: a chunk store on a POSIX filesystem other nodes share (NFS, 3FS, ...).

The tree and the writes of ``dir://`` (:class:`rollbox.images.stores.local.FileChunkStore`:
temp name unique per host and process, then ``rename``, atomic on NFS within one directory),
made durable across clients: the file and its directory are fsynced before a write returns, so
other nodes that see the name see the whole content.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO

from rollbox.images.stores.local import FileChunkStore


class PosixChunkStore(FileChunkStore):
    shared = True

    def _written(self, f: IO[bytes]) -> None:
        f.flush()
        os.fsync(f.fileno())

    def _renamed(self, directory: Path) -> None:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
