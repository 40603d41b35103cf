"""A container's files: :class:`rollbox.hostfs.SandboxFS` on its merged root (host side,
in-root resolution), as the backends' async ``SandboxFiles`` (rollbox.backends.base).

Owns this adapter only; the file operations themselves are ``rollbox.hostfs``'s.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from rollbox.hostfs import SandboxFS
from rollbox.models import FileStat


class ContainerFiles:
    """A container's :class:`SandboxFS` as the backends' async ``SandboxFiles``
    (rollbox.backends.base): blocking calls run in a worker thread."""

    def __init__(self, fs: SandboxFS) -> None:
        self.fs = fs

    async def read(self, path: str, max_bytes: int | None = None) -> bytes:
        return await self.fs.aread(path, max_bytes)

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.fs.awrite(path, data, mode)

    def read_stream(self, path: str, max_bytes: int | None = None,
                    offset: int = 0) -> AsyncIterator[bytes]:
        return self.fs.read_stream(path, max_bytes, offset)

    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], mode: int = 0o644,
                           max_bytes: int | None = None,
                           xattrs: dict[str, str] | None = None) -> int:
        return await self.fs.write_stream(path, chunks, mode, max_bytes=max_bytes, xattrs=xattrs)

    async def stat(self, path: str) -> FileStat:
        return await self.fs.astat(path)

    async def list(self, path: str) -> list[FileStat]:
        return await self.fs.alist(path)

    async def mkdir(self, path: str, parents: bool = False) -> None:
        await self.fs.amkdir(path, parents)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self.fs.aremove(path, recursive)

    async def upload_tar(self, path: str, chunks: AsyncIterator[bytes], *,
                         links: bool = True) -> int:
        return await self.fs.upload_tar(path, chunks, links=links)

    def download_tar(self, path: str) -> AsyncIterator[bytes]:
        return self.fs.download_tar(path)

    def close(self) -> None:
        self.fs.close()
