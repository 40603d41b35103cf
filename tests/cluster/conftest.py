"""One real cluster per test session on this host (``cluster.local.up``): a Ray head and two
simulated Ray worker nodes, an edge actor on each, two api replicas behind one port, in a
scratch cluster dir and a port range of this run's own. Torn down at the end (replicas, edges
with their sandboxes, every Ray process, the Ray temp dir), with a check that nothing is left."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.config import Settings
from tests.conftest import (
    TEST_NODE,
    TEST_RUN,
    forget_run_cluster,
    register_run_cluster,
    register_run_owner,
)

NODES = 3
REPLICAS = 2


def cluster_settings(root: Path) -> Settings:
    s = Settings()
    s.cluster_dir = root
    # below the ephemeral range; one of 8 ranges per run, apart from `rollbox cluster up`'s
    s.cluster_port_base = 20000 + 400 * (int(TEST_RUN, 16) % 8)
    s.node_id = TEST_NODE
    return s


@pytest.fixture(scope="session")
def cluster() -> Iterator:
    """(ClusterState, Settings) of the session's cluster."""
    from rollbox.cluster import local, ray_nodes
    from rollbox.isolation import cgroups

    if os.geteuid() != 0:
        pytest.skip("a cluster's edges need root")
    root = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-cluster-"))
    root.chmod(0o711)  # runc resolves rootfs paths as the sandbox's unprivileged host uid
    register_run_owner()
    s = cluster_settings(root)
    register_run_cluster(s)  # a killed run's cluster is taken down by the next run's sweep
    try:
        state = local.up(s, replicas=REPLICAS, nodes=NODES)
        yield state, s
    finally:
        local.down(s)
        ports = ray_nodes.ClusterPorts(s.cluster_port_base)
        nodes = [local.node_settings(s, f"{TEST_NODE}c{i}", i, nodes=NODES)
                 for i in range(NODES)]
        left = {
            "ray cgroups": ray_nodes.local_nodes(ports),
            "ray temp dir": ray_nodes.temp_dir(ports).exists(),
            "sandbox cgroups": [str(p) for n in nodes for p in cgroups.leftover(n.cgroup_parent)],
            "postgres": (root / "pg" / "postmaster.pid").exists(),
            "mounts": [m for m in open("/proc/self/mounts").read().splitlines()
                       if str(root) in m or any(str(n.run_dir) in m for n in nodes)],
        }
        for n in nodes:
            shutil.rmtree(n.run_dir, ignore_errors=True)
        # their parent, /run/rollbox-cluster-<port base> (only if empty: a run beside on the
        # same port base keeps its own)
        with contextlib.suppress(OSError):
            nodes[0].run_dir.parent.rmdir()
        shutil.rmtree(root, ignore_errors=True)
        forget_run_cluster(s)
        assert not any(left.values()), f"the cluster left: {left}"
