"""Checks both file APIs apply to hostile input alike: the host-side one of containers
(``rollbox.hostfs``) and the one through the agent (``agent.files``). Here, below
both, so each imports the one copy (``agent`` sits below ``backends``).

Owns: the write-size check, the tar entry cap and what counts as a malformed tar stream. Not:
which typed error a bad stream becomes (a client's bad tar and a guest's differ: callers say).
"""
from __future__ import annotations

import lzma
import tarfile
import zlib
from collections.abc import Iterator

from rollbox import errors

# What tarfile and the decompressors raise on bad data (besides a bare OSError).
MALFORMED_TAR = (tarfile.TarError, EOFError, ValueError, UnicodeError, zlib.error,
                 lzma.LZMAError)


def tar_malformed(exc: BaseException) -> bool:
    """Whether ``exc`` means the tar stream is bad data (not a failing file operation)."""
    if isinstance(exc, MALFORMED_TAR):
        return True
    # decompressors report bad data as a bare OSError
    return isinstance(exc, OSError) and exc.errno is None


def capped_members(tf: tarfile.TarFile, max_entries: int) -> Iterator[tarfile.TarInfo]:
    """The members of ``tf``; ``PayloadTooLarge`` once there are more than ``max_entries``."""
    entries = 0
    for member in tf:
        entries += 1
        if entries > max_entries:
            raise errors.PayloadTooLarge(f"tar has more than {max_entries} entries",
                                         limit=max_entries)
        yield member


def check_write_data(data: object, max_write: int) -> None:
    """A whole-file write's content: bytes, at most ``max_write`` of them."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise errors.BadRequest("file content must be bytes")
    if len(data) > max_write:
        raise errors.PayloadTooLarge(f"{len(data)} bytes is above the "
                                     f"{max_write}-byte write cap",
                                     size=len(data), limit=max_write)
