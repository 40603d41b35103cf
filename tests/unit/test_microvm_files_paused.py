"""File operations on a paused microVM answer SandboxPaused at once: its agent is stopped with
the vCPUs, so a request would only wait out the host deadline (the VM here is a stand-in whose
channel never answers, as a stopped guest's)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from rollbox.backends.microvm.files import vm_files
from rollbox.errors import SandboxPaused


class FrozenChannel:
    """A stopped guest's agent: a request is never answered."""

    async def exec(self, req: Any) -> Any:
        await asyncio.Event().wait()

    def __getattr__(self, name: str) -> Any:
        async def never(*a: Any, **kw: Any) -> Any:
            await asyncio.Event().wait()
        return never


@dataclass
class PausedVM:
    id: str = "vmpaused"
    paused: bool = True
    channel: Any = None


async def test_file_ops_on_a_paused_vm_fail_at_once() -> None:
    vm = PausedVM(channel=FrozenChannel())
    files = vm_files(vm)

    async def chunks():  # noqa: ANN202
        yield b""

    calls = [lambda: files.read("/etc/hostname"), lambda: files.write("/tmp/x", b"x"),
             lambda: files.stat("/"), lambda: files.list("/"), lambda: files.mkdir("/tmp/d"),
             lambda: files.remove("/tmp/x"), lambda: files.upload_tar("/tmp", chunks())]
    for call in calls:
        with pytest.raises(SandboxPaused, match="resume it first"):
            await asyncio.wait_for(call(), 2.0)
    with pytest.raises(SandboxPaused):
        await asyncio.wait_for(files.download_tar("/tmp").__anext__(), 2.0)
