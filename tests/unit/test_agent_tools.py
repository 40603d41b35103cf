"""PlatformTools around a stand-in agent channel: a guest's tool that stalls, floods while
told to stop, or never exits is bounded on the host side (the real runs are in
tests/integration/test_agent_files.py and test_microvm_files.py)."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from rollbox import errors
from rollbox.agent import protocol as P
from rollbox.agent import tools as T


class StalledSession:
    """A session that sends ``chunks`` then nothing, ignoring SIGSTOP unless ``obeys``."""

    def __init__(self, chunks: list[bytes], obeys: bool = True) -> None:
        self.chunks, self.obeys = chunks, obeys
        self.signals: list[int] = []
        self.killed = asyncio.Event()
        self.id = 1

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        for c in self.chunks:
            while self.obeys and signal.SIGSTOP in self.signals[-1:]:
                await asyncio.sleep(0.01)
            yield ("stdout", c)
            await asyncio.sleep(0)
        await self.killed.wait()
        yield ("exited", P.Exited(-1, 9, False, 0, 0, 0, 0))

    async def signal(self, sig: int) -> None:
        self.signals.append(sig)

    async def kill(self) -> None:
        self.killed.set()


class Channel:
    def __init__(self, sess: StalledSession) -> None:
        self.sess = sess

    async def exec(self, req: P.ExecRequest) -> StalledSession:
        assert req.platform_tool and req.argv[0] == "cat"
        return self.sess


async def test_a_stalled_stream_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "STREAM_IDLE_S", 0.3)
    sess = StalledSession([b"x" * 10])
    tools = T.PlatformTools(lambda: Channel(sess))  # type: ignore[arg-type, return-value]
    got = []
    with pytest.raises(errors.InfraError, match="sent nothing"):
        async for c in tools.stream(["cat", "/f"], max_stdout=100, on_end=lambda r: None):
            got.append(c)
    assert got == [b"x" * 10] and sess.killed.is_set()


async def test_a_stream_ignoring_sigstop_is_killed() -> None:
    sess = StalledSession([b"y" * (1 << 20)] * 40, obeys=False)
    tools = T.PlatformTools(lambda: Channel(sess))  # type: ignore[arg-type, return-value]
    with pytest.raises(errors.InfraError, match="told to stop"):
        async for _ in tools.stream(["cat", "/f"], max_stdout=1 << 30, on_end=lambda r: None):
            await asyncio.sleep(1)  # a consumer far behind
    assert signal.SIGSTOP in sess.signals and sess.killed.is_set()


async def test_a_run_that_never_ends_has_a_host_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "HOST_GRACE_S", 0.1)
    sess = StalledSession([])
    tools = T.PlatformTools(lambda: Channel(sess), timeout_s=0.2)  # type: ignore[arg-type, return-value]
    with pytest.raises(errors.InfraError, match="did not finish"):
        await tools.run(["cat", "/f"])
    assert sess.killed.is_set()
