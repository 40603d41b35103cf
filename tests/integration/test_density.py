"""Density on a real edge (slow tier): a few hundred idle sandboxes with default resources held
at once, every one answering an exec at the end; the edge's descriptors per sandbox within
``admission.FDS_PER_SANDBOX`` (what admission's fd cap counts on) and its cached user
namespace fds within ``userns.USERNS_CACHED``; all of it gone after the deletes (the ``edge``
fixture checks each sandbox's leftovers)."""
from __future__ import annotations

import asyncio
import os

import pytest

from rollbox.edge.admission import FDS_PER_SANDBOX
from rollbox.isolation.userns import USERNS_CACHED
from rollbox.models import ExecSpec, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]
N = USERNS_CACHED + 64  # more slots than the cache keeps


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_hundreds_of_idle_sandboxes_all_answer_and_hold_few_fds(edge) -> None:  # noqa: ANN001
    sem = asyncio.Semaphore(16)
    made: list[str] = []

    async def one() -> None:
        async with sem:
            made.append((await edge.create(SandboxSpec(image="busybox:test"), "t")).id)

    async def check(sid: str) -> int:
        async with sem:
            return (await edge.exec_run(sid, ExecSpec(cmd=["true"]))).exit_code

    base = _fds() - edge.slots.cached_fds()
    try:
        await asyncio.gather(*(one() for _ in range(N)))
        assert len(made) == N
        cached = edge.slots.cached_fds()
        assert cached <= USERNS_CACHED
        per_sandbox = (_fds() - cached - base) / N
        assert per_sandbox <= FDS_PER_SANDBOX + 0.1, per_sandbox
        codes = await asyncio.gather(*(check(sid) for sid in made))
        assert codes == [0] * N  # every one, not a sample
    finally:
        async def rm(sid: str) -> None:
            async with sem:
                await edge.delete(sid)
        await asyncio.gather(*(rm(sid) for sid in made))
    assert edge.slots.cached_fds() <= USERNS_CACHED
