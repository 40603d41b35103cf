"""Many grades at once: a GRPO group grades all its samples together. Each grade streams the
declared files into its grader through worker threads; more concurrent copies than the event
loop's default executor has threads (cpu_count + 4) must not starve each other."""
from __future__ import annotations

import asyncio
import os

import pytest

from rollbox.models import ExecSpec, GradeSpec, SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


async def test_more_concurrent_grades_than_executor_threads(edge) -> None:  # noqa: ANN001
    n = min(32, (os.cpu_count() or 1) + 4) + 4  # asyncio's default executor size, and more
    sb = await edge.create(SandboxSpec(image=BB), "p")
    eid = await edge.exec_start(sb.id, ExecSpec(
        cmd="mkdir -p /w/d && echo fixed > /w/answer.txt && echo x > /w/d/f", timeout_s=30))
    assert (await edge.exec_wait(sb.id, eid)).exit_code == 0
    specs = [GradeSpec(files=["/w/answer.txt"], cmd="grep -qx fixed /w/answer.txt"),
             GradeSpec(files=["/w/d"], cmd="grep -qx x /w/d/f")]  # a file and a directory

    graded = await asyncio.wait_for(asyncio.gather(
        *(edge.grade(sb.id, specs[i % 2], "p") for i in range(n))), 120)
    assert [g.result.exit_code for g in graded] == [0] * n
    assert {sb.id} == set(edge.live)  # every grader deleted
