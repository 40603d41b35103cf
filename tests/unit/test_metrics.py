"""Metrics (``rollbox.metrics``): bounded labels (top-level projects, a cap, a configured list,
fixed reasons), the api's request histogram by route template, and ``/metrics`` for an admin
key only, parsed with Prometheus' own text parser. The edge's families on a real edge:
tests/integration/test_metrics_edge.py."""
from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollbox import errors, metrics
from test_api_support import ApiStack


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def test_project_labels_are_bounded() -> None:
    m = metrics.Metrics()
    assert m.project("acme/team/run7") == "acme" and m.project("acme") == "acme"
    assert m.project("") == "other" and m.project(None) == "other"
    for i in range(metrics.MAX_PROJECTS + 20):
        m.project(f"p{i}/x")
    seen = {m.project(f"p{i}") for i in range(metrics.MAX_PROJECTS + 20)}
    assert len(seen - {"other"}) == metrics.MAX_PROJECTS - 1  # "acme" took one
    assert "other" in seen
    c = metrics.Metrics()
    c.configure(["acme", "lab"])
    assert [c.project(x) for x in ("acme/a", "lab", "zeta", "zeta/acme")] == [
        "acme", "lab", "other", "other"]
    assert metrics.Metrics.delete_reason(None) == "requested"
    assert metrics.Metrics.delete_reason("ttl expired") == "expired"
    assert metrics.Metrics.delete_reason("oom") == "oom"
    assert metrics.Metrics.delete_reason("sandbox died (agent exited)") == "died"
    assert metrics.Metrics.delete_reason("n-0123 /tmp/x: whatever a backend said") == "other"
    assert metrics.Metrics.refusal_reason({"reason": "memory"}) == "memory"
    assert metrics.Metrics.refusal_reason({"reason": "n0-abc"}) == "other"
    assert metrics.Metrics.refusal_reason({}) == "other"


def test_collectors_merge_and_go() -> None:
    m = metrics.Metrics()
    h1 = m.add_collector(lambda: [metrics.gauge("rollbox_x", "x", ["node"], [(["a"], 1.0)])])
    m.add_collector(lambda: [metrics.gauge("rollbox_x", "x", ["node"], [(["b"], 2.0)])])
    got = dict((s[0]["node"], s[1]) for s in samples(m.exposition().decode(), "rollbox_x"))
    assert got == {"a": 1.0, "b": 2.0}
    m.remove_collector(h1)
    got = dict((s[0]["node"], s[1]) for s in samples(m.exposition().decode(), "rollbox_x"))
    assert got == {"b": 2.0}


async def test_metrics_need_an_admin_key_and_name_routes_not_paths(tmp_path: Path) -> None:
    async with ApiStack(tmp_path) as s, s.client(s.key_a) as c:
        sb = await c.create("busybox:test")
        await c.get(sb.id)
        with pytest.raises(errors.NotFound):
            await c.get("n0-000000000000")
        async with aiohttp.ClientSession() as h:
            async with h.get(f"{s.url}/metrics") as r:
                assert r.status == 401
            async with h.get(f"{s.url}/metrics",
                             headers={"Authorization": f"Bearer {s.key_a}"}) as r:
                assert r.status == 403
            async with h.get(f"{s.url}/metrics",
                             headers={"Authorization": f"Bearer {s.admin_key}"}) as r:
                assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
                text = await r.text()
        await sb.delete()
    rows = samples(text, "rollbox_api_request_seconds_count")
    routes = {(lab["method"], lab["route"], lab["status"]) for lab, _ in rows}
    assert ("GET", "/v1/sandboxes/{sandbox_id}", "200") in routes
    assert ("GET", "/v1/sandboxes/{sandbox_id}", "404") in routes
    assert ("POST", "/v1/sandboxes", "200") in routes or ("POST", "/v1/sandboxes", "201") in routes
    assert sb.id not in text and "n0-000000000000" not in text  # ids never label anything
    assert samples(text, "rollbox_process_start_time_seconds")


def test_cluster_metrics_targets_name_every_replica_and_edge() -> None:
    from rollbox.cluster.local import ClusterState, NodeRecord, ReplicaRecord, metrics_targets

    state = ClusterState(port_base=7500, address="10.0.0.1", api_url="http://10.0.0.1:7500",
                         admin_key="/k", token_file="/t",
                         nodes=[NodeRecord("n0", 0, True, "http://10.0.0.1:7510"),
                                NodeRecord("n1", 1, False, "http://10.0.0.2:7511")],
                         replicas=[ReplicaRecord("r0", 1, "http://10.0.0.1:7501"),
                                   ReplicaRecord("r1", 2, "http://10.0.0.1:7502")])
    groups = metrics_targets(state)
    assert groups[0] == {"targets": ["10.0.0.1:7501", "10.0.0.1:7502"],
                         "labels": {"job": "rollbox-api", "__metrics_path__": "/metrics"}}
    assert [(g["targets"], g["labels"]["node"], g["labels"]["__metrics_path__"])
            for g in groups[1:]] == [(["10.0.0.1:7510"], "n0", "/edge/v1/metrics"),
                                     (["10.0.0.2:7511"], "n1", "/edge/v1/metrics")]


def test_metrics_off_record_nothing() -> None:
    m = metrics.Metrics(enabled=False)
    m.creates.labels("container", "p", "created").inc()
    m.exec_seconds.labels("container").observe(1.0)
    assert m.add_collector(lambda: []) == 0
    assert m.exposition() == b""
    on = metrics.Metrics()
    on.creates.labels("container", "p", "created").inc()
    assert samples(on.exposition().decode(), "rollbox_sandbox_creates_total") == [
        ({"backend": "container", "project": "p", "outcome": "created"}, 1.0)]


def test_collector_histogram_is_cumulative_and_checked() -> None:
    """A histogram another process keeps (per-bucket counts, +Inf last) is exposed with
    cumulative buckets, its count and sum; counts that do not fit the bounds are refused."""
    m = metrics.Metrics()
    m.add_collector(lambda: [metrics.histogram("rollbox_h_seconds", "h", ["kind"],
                                               [(["d"], (0.01, 0.1), [2, 3, 1], 0.75)])])
    text = m.exposition().decode()
    assert samples(text, "rollbox_h_seconds_bucket") == [
        ({"kind": "d", "le": "0.01"}, 2.0), ({"kind": "d", "le": "0.1"}, 5.0),
        ({"kind": "d", "le": "+Inf"}, 6.0)]
    assert samples(text, "rollbox_h_seconds_count") == [({"kind": "d"}, 6.0)]
    assert samples(text, "rollbox_h_seconds_sum") == [({"kind": "d"}, 0.75)]
    with pytest.raises(ValueError, match="3 bucket counts for 2 buckets"):
        metrics.histogram("rollbox_h_seconds", "h", [], [([], (0.01,), [1, 2, 3], 0.0)])


def test_docs_and_dashboard_name_the_families_that_exist() -> None:
    import json
    import re

    from rollbox.config import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"`(rollbox_[a-z_]+)`", doc))
    m = metrics.Metrics()
    for fam in m.registry.collect():
        if fam.name.startswith("rollbox_"):
            name = fam.name + ("_total" if fam.type == "counter" else "")
            assert name in documented, name
    dash = json.loads((REPO_ROOT / "docs" / "grafana" / "rollbox.json").read_text())
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for p in dash["panels"]
            for t in p["targets"] for n in re.findall(r"rollbox_[a-z_]+", t["expr"])}
    assert used and used <= documented, used - documented
