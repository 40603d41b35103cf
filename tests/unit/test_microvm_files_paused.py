"""File operations on a paused microVM answer SandboxPaused at once: its agent is stopped with
the vCPUs, so a request would only wait out the host deadline (the VM here is a stand-in whose
channel never answers, as a stopped guest's). Those in progress when the pause comes fail at
once too, and their tool is killed (the kill waits on the channel for the guest to run)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from rollbox.agent import tools as tools_mod
from rollbox.backends.microvm.files import cut_file_ops, vm_files
from rollbox.errors import InfraError, SandboxPaused


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
    files: Any = None


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


class StuckSession:
    """A tool the guest started and then froze with (optionally after some output)."""

    def __init__(self, first: bytes = b"") -> None:
        self.first = first
        self.killed = 0

    async def events(self):  # noqa: ANN201
        if self.first:
            yield "stdout", self.first
        await asyncio.Event().wait()

    async def signal(self, sig: int) -> None:
        pass

    async def kill(self) -> None:
        self.killed += 1

    async def write_stdin(self, data: bytes) -> None:
        await asyncio.Event().wait()  # a stopped guest grants no credit

    async def close_stdin(self) -> None:
        pass


class StartedChannel:
    def __init__(self, first: bytes = b"") -> None:
        self.sessions: list[StuckSession] = []
        self.first = first

    async def exec(self, req: Any) -> StuckSession:
        self.sessions.append(StuckSession(self.first))
        return self.sessions[-1]


async def pause_during(vm: PausedVM, op: Any, after: float = 0.2) -> BaseException:
    """Run ``op`` on the running VM, pause it meanwhile; what ``op`` raised, within 2 s."""
    task = asyncio.ensure_future(op())
    await asyncio.sleep(after)
    assert not task.done()
    vm.paused = True
    cut_file_ops(vm)
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert done, "the file operation still waits on the paused VM"
    exc = task.exception()
    assert exc is not None
    return exc


@pytest.mark.parametrize("chan", [StartedChannel, FrozenChannel])
async def test_file_ops_in_progress_fail_when_the_vm_is_paused(chan: type) -> None:
    vm = PausedVM(paused=False, channel=chan())
    files = vm.files = vm_files(vm)

    async def chunks():  # noqa: ANN202
        while True:
            yield b"x" * 512

    for op in (lambda: files.read("/etc/hostname"), lambda: files.stat("/"),
               lambda: files.write("/tmp/x", b"x"), lambda: files.upload_tar("/tmp", chunks())):
        vm.paused = False
        exc = await pause_during(vm, op)
        assert isinstance(exc, SandboxPaused) and "paused during" in str(exc)
    if isinstance(vm.channel, StartedChannel):
        await asyncio.sleep(0)  # the queued kills
        assert vm.channel.sessions and all(s.killed for s in vm.channel.sessions)
    vm.paused = False  # resumed: a new operation is not failed by the old pause
    task = asyncio.ensure_future(files.stat("/"))
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()


async def test_a_stream_in_progress_fails_when_the_vm_is_paused() -> None:
    vm = PausedVM(paused=False, channel=StartedChannel(first=b"\0" * 512))
    files = vm.files = vm_files(vm)
    stream = files.tools.stream(["cat", "/big"], max_stdout=1 << 20, on_end=lambda r: None)
    assert await stream.__anext__() == b"\0" * 512  # a chunk came, then the guest froze
    exc = await pause_during(vm, stream.__anext__)
    assert isinstance(exc, SandboxPaused)
    await stream.aclose()


async def test_a_tool_the_agent_never_starts_is_given_up(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(tools_mod, "START_TIMEOUT_S", 0.3)
    files = vm_files(PausedVM(paused=False, channel=FrozenChannel()))
    with pytest.raises(InfraError, match="not started"):
        await asyncio.wait_for(files.stat("/"), 5.0)
