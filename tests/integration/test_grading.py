"""Grading boundary: a fresh sandbox of the pristine layers plus only the declared files.

The agent's sandbox edits the tests, plants a conftest.py, replaces a tool in /usr/bin and plants
symlinks inside the declared directory; none of it may change what the grader runs or sees."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.iam import KeyStore
from rollbox.images.sources import build_from_directory
from rollbox.images.store import ImageStore
from rollbox.models import ExecSpec, GradeSpec, SandboxSpec
from tests.conftest import BOTH_TRANSPORTS, api_app

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
# The grader's check: the solution file says "fixed", and the (pristine) test file is intact.
CHECK = ("grep -qx fixed /task/src/solution.txt && grep -qx pristine-test /task/tests/t.txt "
         "&& test ! -e /task/conftest.py && /bin/true")


@pytest.fixture
def task_image(edge) -> str:  # noqa: ANN001
    """A workspace layer (src + tests) and a hidden-check layer, on top of busybox."""
    store: ImageStore = edge.store
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        (ws / "task/src").mkdir(parents=True)
        (ws / "task/src/solution.txt").write_text("buggy\n")
        (ws / "task/tests").mkdir()
        (ws / "task/tests/t.txt").write_text("pristine-test\n")
        build_from_directory(store, ws, "test/grade-ws:1")
        hidden = Path(tmp) / "hidden"
        (hidden / "task/hidden").mkdir(parents=True)
        (hidden / "task/hidden/check.sh").write_text(CHECK + "\n")
        build_from_directory(store, hidden, "test/grade-hidden:1")
    return "test/grade-ws:1"


async def _run(edge, sid: str, cmd: str) -> None:  # noqa: ANN001
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=30))
    res = await edge.exec_wait(sid, eid)
    assert res.exit_code == 0, res


async def test_grade_sees_only_declared_files(edge, task_image: str,  # noqa: ANN001
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    specs: list[SandboxSpec] = []
    admitted_create = edge._admitted_create

    async def recording(spec: SandboxSpec, *args, **kw):  # noqa: ANN002, ANN003, ANN202
        specs.append(spec)
        return await admitted_create(spec, *args, **kw)

    monkeypatch.setattr(edge, "_admitted_create", recording)
    sb = await edge.create(SandboxSpec(image=BB, layers=[task_image],
                                       hidden_paths=["/task/tests"]), "p")
    try:
        # The hidden tests are absent for the agent's commands...
        eid = await edge.exec_start(sb.id, ExecSpec(cmd="cat /task/tests/t.txt", timeout_s=10))
        assert (await edge.exec_wait(sb.id, eid)).exit_code != 0
        # ...and everything the agent does besides the declared file stays behind.
        await _run(edge, sb.id, "echo fixed > /task/src/solution.txt; echo pwn > /task/conftest.py"
                                "; mkdir -p /task/src/d && echo x > /task/src/d/f"
                                "; ln -s /task/hidden /task/src/link"
                                "; rm -f /bin/true /bin/grep; printf '#!/bin/sh\\nexit 0\\n' > /bin/grep"
                                "; chmod +x /bin/grep")
        spec = GradeSpec(files=["/task/src"], layers=["test/grade-hidden:1"],
                         cmd="sh /task/hidden/check.sh && test ! -e /task/src/link "
                             "&& cat /task/src/d/f")
        graded = await edge.grade(sb.id, spec, "p")
        assert graded.result.exit_code == 0, graded.result
        assert graded.result.stdout == "x\n"
        assert graded.copied_bytes > 0 and graded.grader_id != sb.id
        assert (await edge.get(graded.grader_id)).state == "deleted"  # the grader is gone
        # the sandbox is a project's (batch), its grader latency-sensitive
        assert [(s.qos, "rollbox.grader-of" in s.labels) for s in specs] == [
            ("batch", False), ("latency", True)]

        # A wrong solution fails the same check, whatever the agent planted.
        await _run(edge, sb.id, "echo wrong > /task/src/solution.txt")
        graded = await edge.grade(sb.id, spec, "p")
        assert graded.result.exit_code != 0
    finally:
        await edge.delete(sb.id)


async def test_grade_bad_input(edge, task_image: str) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, layers=[task_image]), "p")
    try:
        with pytest.raises(errors.NotFound):
            await edge.grade(sb.id, GradeSpec(files=["/task/nope"], cmd="true"), "p")
        await _run(edge, sb.id, "mkfifo /task/src/fifo && ln -s /etc /task/src/l")
        with pytest.raises(errors.BadRequest):
            await edge.grade(sb.id, GradeSpec(files=["/task/src/fifo"], cmd="true"), "p")
        with pytest.raises(errors.BadRequest):
            await edge.grade(sb.id, GradeSpec(files=["/task/src/l"], cmd="true"), "p")
        with pytest.raises(errors.NotFound):
            await edge.grade(sb.id, GradeSpec(files=["/task/src"], layers=["no/such:1"],
                                              cmd="true"), "p")
        await _run(edge, sb.id, "head -c 300000 /dev/zero > /task/src/big")
        with pytest.raises(errors.PayloadTooLarge):
            await edge.grade(sb.id, GradeSpec(files=["/task/src"], cmd="true",
                                              max_bytes=100_000), "p")
        assert [i.id for i in await edge.list(None, {})] == [sb.id]  # no grader left over
    finally:
        await edge.delete(sb.id)
    with pytest.raises((errors.NotFound, errors.SandboxDead)):
        await edge.grade(sb.id, GradeSpec(files=["/task/src"], cmd="true"), "p")


@BOTH_TRANSPORTS
async def test_grade_over_sdk(edge, api_edge, task_image: str,  # noqa: ANN001
                             tmp_path: Path) -> None:
    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys)
    key = keys.create("proj")
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
            async with await c.create(BB, layers=[task_image]) as sb:
                await sb.files.write("/task/src/solution.txt", "fixed\n")
                await sb.files.write("/task/tests/t.txt", "edited-by-agent\n")
                g = await sb.grade("sh /task/hidden/check.sh", files=["/task/src"],
                                   layers=["test/grade-hidden:1"])
                assert g.result.exit_code == 0, g.result
                with pytest.raises(errors.BadRequest):
                    await sb.grade("true", files=["relative/path"])
            kinds = [e.kind for e in await sb.events()]
            assert "sandbox.graded" in kinds
    finally:
        keys.close()
