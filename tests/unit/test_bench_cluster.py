"""``bench/cluster.py`` (``rollbox bench cluster``): the module loads, its co-hosted nodes'
settings share no host resource with each other or the host's node, the halves merge into
one rate, the child entry refuses an unknown role; a ``--quick`` run (slow tier) ends with
one JSON line carrying the targets' keys and leaves no process behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollbox.benchkit import bench_path, load_bench
from rollbox.config import Settings


@pytest.fixture(scope="module")
def cl():  # noqa: ANN201
    return load_bench("cluster")


def test_loads_with_its_entry_points(cl) -> None:  # noqa: ANN001
    assert callable(cl.main) and callable(cl.child_main)
    assert (cl.EDGES, cl.REPLICAS) == (3, 2)
    assert cl.TOPOLOGY.startswith("assembled") and cl.TOPOLOGY_RAY.startswith("ray")


def test_unknown_topology_is_bad_request(cl) -> None:  # noqa: ANN001
    from rollbox import errors

    with pytest.raises(errors.BadRequest):
        cl.main(quick=True, topology="k8s")


def test_free_port_base_is_free(cl) -> None:  # noqa: ANN001
    import socket

    from rollbox.cluster.ray_nodes import ClusterPorts

    base = cl.free_port_base()
    assert 24000 <= base < 32000 and base % 400 == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", ClusterPorts(base).last))


def test_node_settings_are_disjoint(cl, tmp_path: Path) -> None:  # noqa: ANN001
    host = Settings()
    nodes = [cl.node_settings(tmp_path, f"bct{i}", cl.NODE_INDEX0 + i, [41001, 41002])
             for i in range(cl.EDGES)]
    bands = [host.uid_band, *(n.uid_band for n in nodes)]
    for i, a in enumerate(bands):
        for b in bands[i + 1:]:
            assert a[1] <= b[0] or b[1] <= a[0], (a, b)
    pools = [host.net_pool, *(n.net_pool for n in nodes)]
    assert all(not a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1:])
    assert len({n.data_dir for n in nodes}) == len({n.run_dir for n in nodes}) == cl.EDGES
    assert len({n.cgroup_parent for n in nodes} | {host.cgroup_parent}) == cl.EDGES + 1
    for n in nodes:
        assert n.data_dir.parent == tmp_path and n.images_dir == host.images_dir
        assert {41001, 41002} <= set(n.platform_ports)
        assert n.node_share == pytest.approx(host.node_share / cl.EDGES)


def test_merge_is_successes_over_total_wall(cl) -> None:  # noqa: ANN001
    runs = [{"n": 10, "errors": 0, "wall_s": 2.0, "p50_ms": 5.0, "p99_ms": 9.0},
            {"n": 10, "errors": 2, "wall_s": 2.0, "p50_ms": 7.0, "p99_ms": 20.0}]
    m = cl.merge(runs)
    assert m["per_s"] == pytest.approx(18 / 4.0)
    assert (m["n"], m["errors"], m["p99_ms"]) == (20, 2, 20.0)


def test_child_refuses_unknown_role(cl) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        cl.child_main(["_nope", "--port", "1", "--token-file", "/dev/null"])


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.parametrize("flags", [[], ["--assembled"]], ids=["ray", "assembled"])
def test_quick_run_ends_with_the_json_line(flags: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    p = subprocess.run([sys.executable, str(bench_path("cluster")), "--quick", "--json",
                        *flags],
                       capture_output=True, text=True, timeout=900, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for k in ("cluster_vs_embedded_c8", "cluster_vs_embedded_c32", "node_loss_detect_s",
              "cluster_c8_ops_per_s", "embedded_c32_ops_per_s"):
        assert res[k] is not None and res[k] > 0, k
    assert res["cluster_c32_errors"] == res["embedded_c32_errors"] == 0
    left = subprocess.run(["pgrep", "-f", f"{bench_path('cluster')} _"], capture_output=True,
                          text=True, check=False).stdout
    assert not left, left
