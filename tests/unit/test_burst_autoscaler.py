"""The autoscaler config of a cluster's burst nodes (rollbox.cluster.autoscaler): this host's
provider config and an operator's YAML with the burst node types merged in; the burst slots'
node settings (rollbox.cluster.local.burst_slots); cluster up's bad input about bursting
(refused before anything starts); this host's provider (rollbox.cluster.burst_provider) around
a start that misses Ray's registration (ray_nodes.start_node faked: the real one is the burst
drill's, tests/integration/test_burst_ray.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.cluster import local, ray_nodes
from rollbox.cluster.autoscaler import PROVIDER_MODULE, local_config, operator_config
from rollbox.cluster.ray_nodes import ClusterPorts
from rollbox.config import Settings

SLOTS = {"nb0": 1, "nb1": 2}


def test_local_config_one_type_per_slot_on_this_hosts_provider() -> None:
    cfg = local_config(ClusterPorts(7440), "n", SLOTS, address="127.0.0.1",
                       object_store_mib=256)
    assert cfg["provider"]["type"] == "external"
    assert cfg["provider"]["module"] == PROVIDER_MODULE
    assert cfg["provider"]["nodes"] == SLOTS and cfg["provider"]["port_base"] == 7440
    assert cfg["provider"]["use_node_id_as_ip"] and cfg["provider"]["disable_node_updaters"]
    types = cfg["available_node_types"]
    assert types["rollbox.burst.1"]["resources"]["rollbox_node:nb1"] == 1
    assert types["rollbox.burst.0"]["resources"]["rollbox_burst"] == 1
    assert cfg["max_workers"] == 2 and cfg["head_node_type"] in types
    json.dumps(cfg)  # what ray start reads


def write(tmp: Path, cfg: object) -> Path:
    p = tmp / "cloud.yaml"
    p.write_text(json.dumps(cfg))
    return p


CLOUD = {
    "cluster_name": "prod", "max_workers": 3,
    "provider": {"type": "aws", "region": "eu-west-1"},
    "auth": {"ssh_user": "ubuntu"},
    "available_node_types": {
        "head": {"resources": {}, "node_config": {"InstanceType": "m5.large"}, "max_workers": 0},
        "rollbox.burst": {"resources": {"CPU": 16, "memory": 1 << 36},
                          "node_config": {"InstanceType": "c5.4xlarge"}},
    },
    "head_node_type": "head",
}


def test_operator_config_merges_burst_types_from_its_template(tmp_path: Path) -> None:
    cfg = operator_config(write(tmp_path, CLOUD), "n", 2, object_store_mib=256)
    assert cfg["provider"] == CLOUD["provider"] and cfg["auth"] == CLOUD["auth"]
    types = cfg["available_node_types"]
    assert "rollbox.burst" not in types and "head" in types
    for k in (0, 1):
        t = types[f"rollbox.burst.{k}"]
        assert t["node_config"] == {"InstanceType": "c5.4xlarge"}
        assert t["resources"]["CPU"] == 16 and t["resources"]["memory"] == 1 << 36
        assert t["resources"]["rollbox_burst"] == 1
        assert t["resources"][f"rollbox_node:nb{k}"] == 1
        assert t["max_workers"] == 1 and t["min_workers"] == 0
    assert cfg["max_workers"] == 3  # the operator's own, already enough
    # yaml proper (not only JSON)
    y = tmp_path / "c.yaml"
    y.write_text("provider: {type: gcp}\navailable_node_types:\n  rollbox.burst:\n"
                 "    node_config: {machineType: n2-standard-8}\n")
    assert operator_config(y, "n", 4, object_store_mib=256)["max_workers"] == 4


@pytest.mark.parametrize("bad", [
    "not: [yaml",
    json.dumps({"provider": {"type": "aws"}}),  # no node types
    json.dumps({**CLOUD, "available_node_types": {"head": CLOUD["available_node_types"]["head"]}}),
    json.dumps({**CLOUD, "available_node_types": {  # the template names rollbox's resources
        "rollbox.burst": {"node_config": {}, "resources": {"rollbox_burst": 1}}}}),
    json.dumps({**CLOUD, "available_node_types": {  # a type of rollbox's name
        **CLOUD["available_node_types"], "rollbox.burst.0": {"node_config": {}}}}),
    json.dumps([1, 2]),
])
def test_operator_config_bad(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(bad)
    with pytest.raises(errors.BadRequest):
        operator_config(p, "n", 1, object_store_mib=256)
    with pytest.raises(errors.BadRequest):
        operator_config(tmp_path / "missing.yaml", "n", 1, object_store_mib=256)


def test_burst_slots_are_burst_nodes_with_their_own_host_resources(tmp_path: Path) -> None:
    s = Settings()
    s.cluster_dir = tmp_path
    s.node_id = "n"
    own = local.node_env(s, "nc0", 0, nodes=1)
    slots = local.burst_slots(s, {"nb0": 1, "nb1": 2}, nodes=1)
    ports = ClusterPorts(s.cluster_port_base)
    assert [v["port"] for v in slots.values()] == [ports.edge(1), ports.edge(2)]
    envs = [own, *(v["env"] for v in slots.values())]
    assert [e.get("ROLLBOX_NODE_BURST") for e in envs] == [None, "1", "1"]
    for var in ("ROLLBOX_NODE", "ROLLBOX_DATA", "ROLLBOX_RUN", "ROLLBOX_CGROUP",
                "ROLLBOX_UID_BASE", "ROLLBOX_NET_POOL"):
        assert len({e[var] for e in envs}) == 3, var
    assert [v["token_file"] for v in slots.values()] == [
        str(local.node_token_path(s, n, i)) for n, i in (("nb0", 1), ("nb1", 2))]


@pytest.mark.parametrize("kw", [{"nodes": 1, "burst_nodes": ray_nodes.MAX_NODES},
                                {"nodes": 2, "burst_nodes": -1},
                                {"nodes": 1, "burst_nodes": 0,
                                 "autoscaler_config": Path("/nonexistent.yaml")}])
def test_cluster_up_bad_burst_input_starts_nothing(tmp_path: Path, kw: dict) -> None:  # type: ignore[type-arg]
    s = Settings()
    s.cluster_dir = tmp_path / "c"
    with pytest.raises(errors.BadRequest):
        local.up(s, **kw)
    assert not s.cluster_dir.exists()


def test_provider_restarts_a_start_that_missed_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that times out is not recorded (start_node killed it); the next one, under a
    fresh Ray node id, is; a start failing otherwise fails the launch."""
    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    from rollbox.cluster import burst_provider

    calls: list[dict[str, str]] = []

    def start_node(ports, node_id, index, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append({"node": node_id, "index": index, **kw["env"], "res": kw["resources"]})
        if len(calls) == 1:
            raise errors.InfraError("ray start of node nb0 failed: The current node timed out "
                                    "during startup.")
        if node_id == "nb1":
            raise errors.InfraError("ray start of node nb1 failed: port taken")

    killed: list[str] = []
    monkeypatch.setattr(burst_provider.ray_nodes, "start_node", start_node)
    monkeypatch.setattr(burst_provider.ray_nodes, "kill_node",
                        lambda ports, nid: killed.append(nid))
    p = burst_provider.LocalBurstProvider(
        {"port_base": 7440, "nodes": SLOTS, "gcs_address": "127.0.0.1:7440"}, "c")
    res = {"CPU": 0, "rollbox_burst": 1, "rollbox_node:nb0": 1, "object_store_memory": 1}
    p.create_node_with_resources_and_labels({}, {"ray-user-node-type": "rollbox.burst.0"}, 1,
                                            res, {})
    assert [c["index"] for c in calls] == [1, 1]
    first, second = (c["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] for c in calls)
    assert first != second and calls[1]["res"] == {"rollbox_burst": 1.0}
    workers = [n for n in p.non_terminated_nodes({}) if p._nodes[n].get("node")]
    assert workers == [second]
    with pytest.raises(errors.InfraError):
        p.create_node_with_resources_and_labels(
            {}, {"ray-user-node-type": "rollbox.burst.1"}, 1,
            {"rollbox_burst": 1, "rollbox_node:nb1": 1}, {})
    assert len(calls) == 3  # not retried: not a registration timeout
    p.terminate_node(second)
    assert killed == ["nb0"] and second not in p.non_terminated_nodes({})


def test_the_scaler_takes_no_token_argument() -> None:
    """Ray keeps actor arguments in its GCS: the scaler reads the token from its file."""
    import inspect

    from rollbox.cluster.burst_actor import BurstScalerActor, start_scaler

    for fn in (BurstScalerActor.__init__, start_scaler):
        params = inspect.signature(fn).parameters
        assert "token" not in params and "token_file" in params


def test_the_dead_run_sweep_knows_cluster_and_burst_nodes() -> None:
    """tests/conftest.py: a cluster node's cgroup parent, its sandboxes' mounts and its run
    dir name the test run (the session cluster's t<run>c<i>, the burst drill's t<run>xc0 and
    burst nodes t<run>xb<k>); other names do not."""
    from tests.conftest import TEST_CLUSTER_RUN_DIR, TEST_SANDBOX_MOUNT, cgroup_run

    assert [cgroup_run(n) for n in ("rollbox-tab12c0", "rollbox-tab12xc0", "rollbox-tab12xb3",
                                    "rollbox-test-ab12-n1", "rollbox-tab12b0")] == ["ab12"] * 5
    assert cgroup_run("rollbox-tab12y0") is None and cgroup_run("rollbox-bdevb0") is None
    for node in ("tab12c2", "tab12xb0", "tab12abcdef"):
        m = TEST_SANDBOX_MOUNT.search(f"/run/x/roots/{node}-0123456789ab/merged")
        assert m is not None and m.group(1) == "ab12", node
    m = TEST_CLUSTER_RUN_DIR.match("/run/rollbox-cluster-22800/tab12xb0")
    assert m is not None and m.group(1) == "ab12"
    assert TEST_CLUSTER_RUN_DIR.match("/run/rollbox-cluster-22800/bdevb0") is None
