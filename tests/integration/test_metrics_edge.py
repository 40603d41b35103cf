"""The edge's metrics on a real edge with real sandboxes, scraped from the edge's own HTTP
``/metrics`` (the cluster token, as every edge route) and parsed with Prometheus' text parser:
a create, a command, a command past its timeout, a refused create and a delete each move their
family by exactly what happened (deltas: the registry is the process's), the live-sandbox
gauge counts the sandbox while it lives, and no sandbox id is a label."""
from __future__ import annotations

import os

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollbox import errors
from rollbox.edge import wire
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from tests.conftest import CLUSTER_TOKEN, served_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


async def scrape(url: str, token: str | None = CLUSTER_TOKEN) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, \
            s.get(url + wire.PREFIX + "/metrics", headers=headers) as r:
        return r.status, await r.text()


def value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def moved(before: str, after: str, name: str, **labels: str) -> float:
    """How far ``name`` (with ``labels``) moved between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


async def test_edge_families_move_by_what_happened(edge) -> None:  # noqa: ANN001
    async with served_edge(edge) as remote:
        assert (await scrape(remote.url, None))[0] == 401
        assert (await scrape(remote.url, "x" * len(CLUSTER_TOKEN)))[0] == 401
        _, before = await scrape(remote.url)
        info = await remote.create(SandboxSpec(image=BB), "acme/team")
        r = await remote.exec_run(info.id, ExecSpec(cmd=["true"]))
        assert r.exit_code == 0
        r = await remote.exec_run(info.id, ExecSpec(cmd=["sleep", "30"], timeout_s=0.5))
        assert r.timed_out
        _, alive = await scrape(remote.url)
        edge.limits.max_sandboxes = len(edge.live)
        try:
            with pytest.raises(errors.CapacityExceeded):
                await remote.create(SandboxSpec(image=BB), "acme")
        finally:
            edge.limits.max_sandboxes = 4096
        await remote.delete(info.id)
        _, after = await scrape(remote.url)

    assert moved(before, after, "rollbox_sandbox_creates_total", backend="container", project="acme",
                 outcome="created") == 1
    assert moved(before, after, "rollbox_sandbox_create_seconds_count", backend="container") == 1
    assert moved(before, after, "rollbox_sandbox_first_exec_seconds_count", backend="container") == 1
    assert moved(before, after, "rollbox_exec_seconds_count", backend="container") == 2
    assert moved(before, after, "rollbox_timeouts_total", kind="exec") == 1
    assert moved(before, after, "rollbox_admission_refusals_total", reason="sandboxes") == 1
    assert moved(before, after, "rollbox_sandbox_deletes_total", backend="container", project="acme",
                 reason="requested") == 1
    node = edge.node_id
    assert value(alive, "rollbox_sandboxes", node=node, state="running", project="acme") == 1
    assert value(after, "rollbox_sandboxes", node=node, project="acme") == 0
    assert value(alive, "rollbox_node_capacity", node=node, what="sandboxes") == 4096
    assert value(alive, "rollbox_node_use", node=node, what="sandboxes") >= 1
    assert info.id not in alive and info.id not in after


async def test_network_denials_are_counted(edge) -> None:  # noqa: ANN001
    """A sandbox whose policy allows nothing: a refused name and refused connects reach the
    DNS-gate and filter families once the edge logs its net.denied (at the latest, at delete)."""
    async with served_edge(edge) as remote:
        _, before = await scrape(remote.url)
        info = await remote.create(SandboxSpec(image=BB, network=NetworkPolicy(allow=[])), "p")
        await remote.exec_run(info.id, ExecSpec(cmd=[
            "sh", "-c", "nslookup blocked.example; nc -w 1 10.9.8.7 80 </dev/null; "
                        "nc -w 1 10.9.8.7 81 </dev/null; true"], timeout_s=30))
        await remote.delete(info.id)
        _, after = await scrape(remote.url)
    assert value(after, "rollbox_dns_gate_refusals_total", backend="container") - value(
        before, "rollbox_dns_gate_refusals_total", backend="container") >= 1
    assert value(after, "rollbox_filter_denials_total", backend="container", kind="connect") \
        - value(before, "rollbox_filter_denials_total", backend="container", kind="connect") >= 2


async def test_fncall_pools_and_waits(edge) -> None:  # noqa: ANN001
    from rollbox.fncall import FnCallBackend, PoolConfig
    from rollbox.metrics import process_metrics
    from rollbox.models import FnCallSpec
    from tests.conftest import have_image

    if not have_image("fncall:1"):
        pytest.skip("fncall:1 not built (run `make images`)")
    m = process_metrics()
    before = value(m.exposition().decode(), "rollbox_fncall_wait_seconds_count", pool="python")
    async with FnCallBackend(edge, PoolConfig(max_workers=2)) as fb:
        for _ in range(2):
            r = await fb.call(FnCallSpec(language="python", code="print(1)"))
            assert r.status == "ok"
        text = m.exposition().decode()
    assert value(text, "rollbox_fncall_wait_seconds_count", pool="python") - before == 2
    assert value(text, "rollbox_fncall_pool", pool="python", what="workers") >= 1
    assert value(text, "rollbox_fncall_workers_cap") == 2
    assert "rollbox_fncall_pool{" not in m.exposition().decode()  # gone with the backend


async def test_writable_layer_and_memory_use_against_capacity(edge) -> None:  # noqa: ANN001
    """8 MiB written into a sandbox's writable layer (disk tier) show in ``disk_mib_used``
    against the sum of the live sandboxes' disk caps, once the usage sampler has seen them;
    the sandboxes' memory is against the node's memory, requests against the budgets."""
    import asyncio

    async with served_edge(edge) as remote:
        info = await remote.create(SandboxSpec(image=BB), "acme")
        try:
            r = await remote.exec_run(info.id, ExecSpec(cmd=[
                "sh", "-c", "dd if=/dev/urandom of=/big bs=1M count=8 && sync"], timeout_s=30))
            assert r.exit_code == 0
            used = 0.0
            for _ in range(50):  # the qgroup's count follows the commit within seconds
                edge._record_usage()  # the sampler's round, now
                _, text = await scrape(remote.url)
                used = value(text, "rollbox_node_use", node=edge.node_id, what="disk_mib_used")
                if used >= 8:
                    break
                await asyncio.sleep(0.2)
        finally:
            await remote.delete(info.id)
    node = edge.node_id
    assert 8 <= used < 2048
    assert value(text, "rollbox_node_capacity", node=node, what="disk_mib_used") >= 2048
    assert value(text, "rollbox_node_use", node=node, what="memory_mib_used") > 0
    assert value(text, "rollbox_node_capacity", node=node, what="memory_mib_used") == \
        edge.admission.host_mem_mib
    assert value(text, "rollbox_node_capacity", node=node, what="memory_mib_requested") == \
        edge.admission.budgets()["memory_mib"]


async def test_oom_kills_and_ttl_timeouts_are_counted(edge) -> None:  # noqa: ANN001
    """A command past its sandbox's 64 MiB limit moves ``rollbox_oom_kills{what=command}``; a
    sandbox past its TTL moves ``rollbox_timeouts{kind=ttl}`` and ends as ``expired``."""
    import asyncio

    from rollbox.models import Resources

    async with served_edge(edge) as remote:
        _, before = await scrape(remote.url)
        small = await remote.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)),
                                    "acme")
        try:
            r = await remote.exec_run(small.id, ExecSpec(cmd=[
                "dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"], timeout_s=30))
            assert r.oom_killed, r
        finally:
            await remote.delete(small.id)
        brief = await remote.create(SandboxSpec(image=BB, ttl_s=1), "acme")
        for _ in range(100):
            if brief.id not in edge.live:
                break
            await asyncio.sleep(0.1)
        await edge.wait_deleted(brief.id)
        _, after = await scrape(remote.url)

    assert moved(before, after, "rollbox_oom_kills_total", backend="container", what="command") == 1
    assert moved(before, after, "rollbox_timeouts_total", kind="ttl") == 1
    assert moved(before, after, "rollbox_sandbox_deletes_total", backend="container", project="acme",
                 reason="expired") == 1


async def test_a_grade_moves_the_grade_latency_histogram(edge) -> None:  # noqa: ANN001
    """One grade over the edge service adds one sample to ``rollbox_grade_seconds`` of the
    source's backend, at least as long as the grader's command took (it sleeps 0.3 s)."""
    from rollbox.models import GradeSpec

    async with served_edge(edge) as remote:
        info = await remote.create(SandboxSpec(image=BB), "acme")
        try:
            r = await remote.exec_run(info.id, ExecSpec(cmd="echo fixed > /answer"))
            assert r.exit_code == 0
            _, before = await scrape(remote.url)
            graded = await remote.grade(info.id, GradeSpec(
                files=["/answer"], cmd="sleep 0.3; grep -qx fixed /answer"), "acme")
            assert graded.result.exit_code == 0
            _, after = await scrape(remote.url)
        finally:
            await remote.delete(info.id)

    assert moved(before, after, "rollbox_grade_seconds_count", backend="container") == 1
    assert moved(before, after, "rollbox_grade_seconds_sum", backend="container") >= 0.3
    assert info.id not in after
