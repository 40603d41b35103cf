"""A create cancelled midway (either backend's) ends cancelled and leaves nothing: a step with
host side effects (a thread, the jailer, runc) ends before the cancellation goes on, so the
teardown sees what it made, and a teardown that fails never replaces the cancellation (it did:
a template build looked failed, the create booted cold and finished)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from rollbox.agent.channel import AgentChannel
from rollbox.backends.cancellation import teardown_after, to_the_end
from rollbox.errors import InfraError


async def test_a_cancelled_step_ends_before_the_cancellation_goes_on() -> None:
    made: list[str] = []
    disposed: list[str] = []
    started = threading.Event()

    def make() -> str:  # a thread goes on whatever its awaiting task does
        started.set()
        time.sleep(0.3)
        made.append("subvolume")
        return "subvolume"

    task = asyncio.ensure_future(to_the_end(asyncio.to_thread(make), dispose=disposed.append))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made == ["subvolume"]  # ended before the caller saw its cancellation
    assert disposed == ["subvolume"]  # what it made is handed back, not dropped


async def test_a_cancelled_step_that_fails_still_raises_the_cancellation() -> None:
    async def step() -> None:
        await asyncio.sleep(0.1)
        raise InfraError("jailer failed")

    task = asyncio.ensure_future(to_the_end(step()))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_uncancelled_step_returns_or_raises_as_it_is() -> None:
    async def ok() -> int:
        return 7

    async def bad() -> None:
        raise InfraError("no cgroup")

    assert await to_the_end(ok()) == 7
    with pytest.raises(InfraError, match="no cgroup"):
        await to_the_end(bad())


async def failing_teardown() -> None:
    raise InfraError("teardown incomplete")


async def test_a_failed_teardown_never_replaces_a_cancellation() -> None:
    async def create() -> None:
        try:
            await asyncio.sleep(10)  # booting
        except BaseException as exc:
            await teardown_after(exc, failing_teardown())
            raise

    task = asyncio.ensure_future(create())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failed_teardown_after_an_error_is_raised() -> None:
    with pytest.raises(InfraError, match="teardown incomplete"):
        await teardown_after(InfraError("boot failed"), failing_teardown())
    await teardown_after(InfraError("boot failed"), asyncio.sleep(0))  # a clean teardown


async def test_a_cancelled_agent_handshake_leaves_no_socket(tmp_path) -> None:  # noqa: ANN001
    """The last step of a container create: a cancel meeting the handshake (an agent that
    has not said READY yet) closes the channel's socket."""
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)  # the kernel queues the connection; nobody answers it
    fds = set(os.listdir("/proc/self/fd"))
    connect = asyncio.ensure_future(AgentChannel.connect(str(path), timeout=30))
    await asyncio.sleep(0.05)
    assert not connect.done()
    connect.cancel()
    with pytest.raises(asyncio.CancelledError):
        await connect
    assert set(os.listdir("/proc/self/fd")) <= fds
    listener.close()
