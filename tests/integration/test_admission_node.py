"""Admission on a real edge: sandboxes that really allocate make creates fail before host
MemAvailable crosses the node reserve; a node filled to refusal still grades every sandbox
(the reserved share); project quotas and bad quotas through the api, SDK and CLI."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore, SQLiteLedger
from rollbox.iam.quotas import SQLiteQuotas
from rollbox.models import ExecSpec, GradeSpec, Quota, Resources, SandboxSpec
from rollbox.watcher import placement_over

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
PY = "python:3.11"
HOLD_MIB = 900
# Fault in 900 MiB and keep it until killed; "ok" once every page is touched.
HOLD = ("import sys, time\nb = bytearray(b'x') * (%d << 20)\nprint('ok', flush=True)\n"
        "time.sleep(3600)\n" % HOLD_MIB)


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("no MemAvailable")


async def hold_memory(edge, sid: str) -> None:  # noqa: ANN001
    exec_id = await edge.exec_start(sid, ExecSpec(cmd=["python3", "-c", HOLD],
                                                  background=True))
    async for item in edge.exec_stream(sid, exec_id):
        if item.kind == "stdout" and b"ok" in item.data:
            return
        assert item.kind not in ("exit", "error"), item
    raise AssertionError("allocation never finished")


async def test_allocating_sandboxes_are_refused_before_the_reserve_then_all_grade(
        edge) -> None:  # noqa: ANN001
    made: list[str] = []
    refused: errors.CapacityExceeded | None = None
    try:
        # A reserve ~3 GiB below what is free now: only a few GiB of this host are needed.
        # Other work on the host moves MemAvailable too: if even the first create is refused,
        # measure again from the new level (a few times).
        for _attempt in range(3):
            reserve = mem_available_mib() - 3000
            edge.limits.reserve_mib = reserve
            for _ in range(8):
                try:
                    info = await edge.create(SandboxSpec(
                        image=PY, resources=Resources(memory_mib=HOLD_MIB + 200)), "t")
                except errors.CapacityExceeded as exc:
                    refused = exc
                    break
                made.append(info.id)
                await hold_memory(edge, info.id)
            if made:
                break
        assert refused is not None and refused.retryable, "never refused"
        print(f"admitted {len(made)} x {HOLD_MIB} MiB, reserve {reserve} MiB: {refused}")
        assert refused.details["reason"] == "memory_available", refused.details
        assert made, "the first create should fit"
        # Refused while the node was still above its reserve, after at most the budget.
        assert refused.details["available_mib"] >= reserve, (refused.details, reserve)
        assert len(made) * HOLD_MIB <= 3000

        # The node is full for new creates; every sandbox still grades (reserved share).
        for sid in made:
            await edge.file_write(sid, "/tmp/answer", b"42\n", 0o644)
        grades = await asyncio.gather(*(edge.grade(sid, GradeSpec(
            files=["/tmp/answer"], cmd="grep -qx 42 /tmp/answer",
            resources=Resources(memory_mib=64)), "t") for sid in made))
        assert [g.result.exit_code for g in grades] == [0] * len(made)
    finally:
        await asyncio.gather(*(edge.delete(sid) for sid in made), return_exceptions=True)


async def test_full_node_drains_grades_through_the_reserved_share(edge) -> None:  # noqa: ANN001
    edge.limits.max_sandboxes = 6
    edge.limits.reserved_share = 0.34  # 2 of 6 kept for grades
    episodes = [await edge.create(SandboxSpec(image=BB), "t") for _ in range(4)]
    with pytest.raises(errors.CapacityExceeded) as exc:
        await edge.create(SandboxSpec(image=BB), "t")
    assert exc.value.details["reason"] == "sandboxes"
    for sb in episodes:
        await edge.file_write(sb.id, "/answer", sb.id.encode(), 0o644)

    async def grade(sid: str):  # noqa: ANN202
        return await edge.grade(sid, GradeSpec(files=["/answer"], cmd=f"grep -qx {sid} "
                                               "/answer && sleep 0.3"), "t")

    # Four grades at once on two reserved slots: they queue, ahead of new creates.
    running = asyncio.gather(*(grade(sb.id) for sb in episodes))
    await asyncio.sleep(0.1)
    with pytest.raises(errors.CapacityExceeded):
        await edge.create(SandboxSpec(image=BB), "t")
    results = await asyncio.wait_for(running, 60)
    assert [r.result.exit_code for r in results] == [0, 0, 0, 0]
    assert len(edge.live) == 4  # every grader is gone


async def test_quotas_over_the_api_sdk_and_cli(edge, tmp_path: Path) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from rollbox.cli import app as cli_app

    keys = KeyStore(tmp_path / "keys.db")
    ledger = SQLiteLedger(tmp_path / "keys.db")
    edge.quotas = keys  # the node's own per-node check reads the same limits
    app = create_app(placement_over([edge]), keys, ledger=ledger)
    admin, team = keys.create("ops", admin=True), keys.create("team")
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, admin) as a, \
                rollbox.AsyncClient(srv.url, team) as t:
            assert await a.project_quota("team") == Quota()
            q = await a.set_project_quota("team", sandboxes=2, memory_mib=1536)
            assert q == Quota(sandboxes=2, memory_mib=1536)
            one = await t.create(BB, memory_mib=512)
            with pytest.raises(errors.QuotaExceeded) as exc:  # 512 + 1024 > 1536: memory
                await t.create(BB, memory_mib=1100)
            assert exc.value.details["field"] == "memory_mib" and not exc.value.retryable
            two = await t.create(BB, memory_mib=512)
            with pytest.raises(errors.QuotaExceeded) as exc:
                await t.create(BB, memory_mib=64)
            assert exc.value.details["field"] == "sandboxes"
            # A grade is not a new sandbox of the project: it still runs at the quota.
            await two.files.write("/x", "1")
            assert (await two.grade("test -f /x", files=["/x"])).result.exit_code == 0
            # ... but no way around it: a grade asking more than the quota is refused.
            with pytest.raises(errors.QuotaExceeded) as exc:
                await two.grade("true", files=["/x"], resources={"memory_mib": 2048})
            assert exc.value.details["field"] == "memory_mib"
            await one.delete()
            three = await t.create(BB, memory_mib=512)

            # Bad quotas: typed errors, nothing stored.
            cap = (await edge.capacity())["limits"]
            for bad in ({"sandboxes": -1}, {"cpus": -0.5},
                        {"sandboxes": int(cap["sandboxes"]) + 1},
                        {"memory_mib": int(cap["memory_mib"]) + 1},
                        {"cpus": cap["cpus"] * 2}, {"layer_mib": int(cap["layer_mib"]) + 1}):
                with pytest.raises(errors.BadRequest):
                    await a.set_project_quota("team", **bad)
            with pytest.raises(errors.BadRequest):
                await a.project_quota("bad name!")
            with pytest.raises(errors.Forbidden):  # a project key can not raise its own
                await t.set_project_quota("team", sandboxes=100)
            assert (await t.project_quota("team")).sandboxes == 2  # but may read it
            with pytest.raises(errors.Forbidden):
                await t.project_quota("ops")
            assert await a.project_quota("team") == Quota(sandboxes=2, memory_mib=1536)

            # The CLI, through the api with an admin key: set keeps the other limits.
            env = {"ROLLBOX_API_KEY": admin, "ROLLBOX_URL": srv.url}
            runner = CliRunner()
            res = await asyncio.to_thread(runner.invoke, cli_app, [
                "project", "quota", "team", "--cpus", "4", "--layer-mib", "100"], env=env)
            assert res.exit_code == 0, res.output
            assert json.loads(res.output) == {"project": "team", "sandboxes": 2, "cpus": 4.0,
                                              "memory_mib": 1536, "layer_mib": 100}
            res = await asyncio.to_thread(runner.invoke, cli_app, [
                "project", "quota", "team", "--sandboxes", "-3"], env=env)
            assert res.exit_code == 2 and "bad_request" in res.output, res.output
            assert (await a.project_quota("team")).sandboxes == 2
            for sb in (two, three):
                await sb.delete()
    finally:
        edge.quotas = None
        ledger.close()
        keys.close()


async def test_grade_takes_resources_in_the_sdk(edge, tmp_path: Path) -> None:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    app = create_app(placement_over([edge]), keys)
    key = keys.create("proj")
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
            async with await c.create(BB, memory_mib=256) as sb:
                await sb.files.write("/x", "1")
                g = await sb.grade("test -f /x", files=["/x"],
                                   resources={"memory_mib": 768, "cpus": 0.5})
                assert g.result.exit_code == 0
                grader = await edge.get(g.grader_id)
                assert (grader.resources.memory_mib, grader.resources.cpus) == (768, 0.5)
                with pytest.raises(errors.BadRequest):
                    await sb.grade("true", files=["/x"], resources={"memory_mib": -1})
    finally:
        keys.close()


async def test_restart_keeps_admission_and_quota_usage(tmp_node_dir: Path) -> None:
    """Re-adopted sandboxes count again: a restart can not reset a project's usage."""
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from tests.conftest import node_settings

    settings = node_settings(tmp_node_dir)
    events = EventLog(tmp_node_dir / "events.db")
    quotas = SQLiteQuotas(tmp_node_dir / "quotas.db")
    quotas.set("team", Quota(sandboxes=2))
    e1 = Edge(settings, events, quotas=quotas)
    await e1.start()
    made = [await e1.create(SandboxSpec(image=BB, resources=Resources(memory_mib=300)), "team")
            for _ in range(2)]
    await e1.close(destroy=False)
    e2 = Edge(settings, events, quotas=quotas)
    await e2.start()
    try:
        cap = await e2.capacity()
        assert (cap["sandboxes"], cap["requested_memory_mib"]) == (2, 600)
        with pytest.raises(errors.QuotaExceeded):
            await e2.create(SandboxSpec(image=BB), "team")
        await e2.delete(made[0].id)
        extra = await e2.create(SandboxSpec(image=BB), "team")
        for sb in (made[1], extra):
            await e2.delete(sb.id)
        assert (await e2.capacity())["sandboxes"] == 0
    finally:
        await e2.close(destroy=True)
        events.close()
        quotas.close()


async def test_fncall_workers_start_from_the_reserved_share(edge) -> None:  # noqa: ANN001
    from rollbox.fncall import FnCallBackend, PoolConfig
    from rollbox.models import FnCallSpec
    from tests.conftest import have_image

    if not have_image("fncall:1"):
        pytest.fail("fncall:1 not built (run `make images`)")
    edge.limits.max_sandboxes = 3
    edge.limits.reserved_share = 0.34  # 1 of 3 kept
    held = [await edge.create(SandboxSpec(image=BB), "t") for _ in range(2)]
    with pytest.raises(errors.CapacityExceeded):
        await edge.create(SandboxSpec(image=BB), "t")
    async with FnCallBackend(edge, PoolConfig(max_workers=1)) as fb:
        r = await fb.call(FnCallSpec(language="python", code="print(6 * 7)"))
        assert (r.status, r.stdout) == ("ok", "42\n")
    for sb in held:
        await edge.delete(sb.id)
