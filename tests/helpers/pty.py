"""Helpers of the PTY exec tests (tests/integration/test_exec_pty.py, test_microvm_pty.py,
tests/redteam/test_pty_output.py): a sandbox of a fresh project through the api, reading a
pty command's output until a pattern, draining a local terminal."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
from collections.abc import AsyncIterator
from typing import Any

import rollbox


@contextlib.asynccontextmanager
async def api_sandbox(api_server: Any, project: str, image: str = "busybox:test",
                      **create: Any) -> AsyncIterator[tuple[str, str, rollbox.AsyncSandbox]]:
    """(url, key, sandbox) of a new project's key on the ``api_server`` fixture; the sandbox
    is deleted at the end, also on failure."""
    url, keys = api_server
    key = keys.create(project)
    async with rollbox.AsyncClient(url, key) as c:
        sb = await c.create(image, **create)
        try:
            yield url, key, sb
        finally:
            await sb.delete()


async def read_until(proc: rollbox.AsyncProcess, pattern: str, offset: int = 0,
                     timeout: float = 20) -> tuple[str, int]:
    """Attach from ``offset`` until ``pattern`` (a regex) shows up in what was read: (the
    text read, the offset after it)."""
    seen = b""
    async with asyncio.timeout(timeout):
        async with contextlib.aclosing(proc.attach(stdout_offset=offset)) as chunks:
            async for chunk in chunks:
                assert chunk.stream == "stdout"  # a terminal has one output stream
                seen += chunk.data
                if re.search(pattern, seen.decode("utf-8", "replace")):
                    break
    return seen.decode("utf-8", "replace"), offset + len(seen)


def drain(fd: int, idle_s: float = 0.2) -> bytes:
    """What a terminal's leader side has to read, until ``idle_s`` passes without more or the
    other side is closed (EIO)."""
    out = b""
    while select.select([fd], [], [], idle_s)[0] and (chunk := read_chunk(fd)):
        out += chunk
    return out


def read_chunk(fd: int) -> bytes:
    """One read of a terminal's leader side; b"" once the other side is closed (EOF, EIO)."""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""
