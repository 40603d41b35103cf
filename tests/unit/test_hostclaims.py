"""Host resources of co-hosted edges: Settings.for_node derives disjoint ones, and the host
claims (rollbox.isolation.hostclaims) refuse a second edge that asks for one a live edge holds,
each resource on its own."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollbox.config import UID_BAND_EXTRA, UID_RANGE, SettingError, Settings
from rollbox.errors import BadRequest, HostResourceConflict
from rollbox.isolation import hostclaims


@pytest.fixture
def base(tmp_path: Path) -> Settings:
    s = Settings.scratch(tmp_path / "base")
    s.host_auto = False
    s.host_dir = tmp_path / "host"  # a private registry: nothing of the real host's
    s.uid_base, s.uid_slots = 2_000_000_000 // UID_RANGE * UID_RANGE, 64
    s.net_host_range = ipaddress.IPv4Network("10.250.0.0/16")
    s.net_pool = ipaddress.IPv4Network("10.250.0.0/20")
    return s


def nodes(base: Settings, n: int = 3) -> list[Settings]:
    return [Settings.for_node(base, f"n{i + 1}", i, nodes=n) for i in range(n)]


def test_for_node_gives_each_node_its_own_host_resources(base: Settings) -> None:
    all_ = [base, *nodes(base)]
    for a in all_:
        for b in all_:
            if a is b:
                continue
            assert a.node_id != b.node_id and a.data_dir != b.data_dir and a.run_dir != b.run_dir
            assert a.cgroup_parent != b.cgroup_parent and a.netns_prefix != b.netns_prefix
            assert not a.netns_prefix.startswith(b.netns_prefix)
            assert a.uid_band[1] <= b.uid_band[0] or b.uid_band[1] <= a.uid_band[0]
            assert not a.net_pool.overlaps(b.net_pool)
            assert hostclaims.conflicts(hostclaims.Holding.of(a), hostclaims.Holding.of(b)) == []
    n1 = all_[1]
    assert n1.node_share == pytest.approx(1 / 3) and n1.net_pool.subnet_of(base.net_host_range)
    assert n1.images_dir == base.images_dir  # the layer store is shared by design
    assert n1.uid_band[1] - n1.uid_band[0] == (64 + UID_BAND_EXTRA) * UID_RANGE


@pytest.mark.parametrize("bad", [dict(node_id="n-1", index=0), dict(node_id="", index=0),
                                 dict(node_id="n1", index=-1), dict(node_id="n1", index=99)])
def test_for_node_refuses_what_does_not_fit(base: Settings, bad: dict) -> None:
    with pytest.raises(SettingError):
        Settings.for_node(base, bad["node_id"], bad["index"])
    with pytest.raises(SettingError):  # the base node's own id
        Settings.for_node(base, base.node_id, 0)
    with pytest.raises(SettingError):  # 40 bands of 8192 slots are far past uid 2**32
        Settings.for_node(base, "n40", 40, uid_slots=8192)


def test_a_node_id_with_a_dash_is_refused_when_read() -> None:
    # "a" would take node "a-b"'s sandboxes ("a-b-<hex>") for its own leftovers.
    with pytest.raises(SettingError):
        Settings.__dataclass_fields__["node_id"].metadata["var"].read({"ROLLBOX_NODE": "a-b"})


# Each resource alone: a node like n2 but with exactly one of n1's resources.
ONE_RESOURCE = {
    "node_id": lambda mine, other: {"node_id": other.node_id},
    "data_dir": lambda mine, other: {"data_dir": other.data_dir},
    "run_dir": lambda mine, other: {"run_dir": other.run_dir / "inner"},  # nested counts too
    "cgroup_parent": lambda mine, other: {"cgroup_parent": other.cgroup_parent + "/sub"},
    "uid_band": lambda mine, other: {"uid_base": other.uid_band[1] - UID_RANGE},  # one range
    "net_pool": lambda mine, other: {"net_pool": ipaddress.IPv4Network(
        f"{other.net_pool.broadcast_address - 3}/30")},  # one /30
}


@pytest.mark.parametrize("resource", sorted(ONE_RESOURCE))
def test_a_second_edge_asking_for_a_held_resource_fails_typed(base: Settings,
                                                              resource: str) -> None:
    n1, n2, _ = nodes(base)
    held = hostclaims.claim(n1)
    try:
        mine = dataclasses.replace(n2, **ONE_RESOURCE[resource](n2, n1))
        assert [r for r, _ in hostclaims.conflicts(hostclaims.Holding.of(mine),
                                                   held.holding)] == [resource]
        with pytest.raises(HostResourceConflict) as err:
            hostclaims.claim(mine)
        assert err.value.details["resource"] == resource and err.value.details["holder"] == "n1"
        assert "n1" in err.value.message and err.value.code == "host_resource_conflict"
        assert sorted(p.name for p in hostclaims.claims_dir(base).glob("*.claim")) == ["n1.claim"]
        hostclaims.claim(n2).release()  # the node as derived is n1's neighbour, not a rival
    finally:
        held.release()
    hostclaims.claim(mine).release()  # released: free again


def test_claims_of_settings_that_name_no_valid_resource_are_bad_requests(base: Settings) -> None:
    n1 = nodes(base)[0]
    for change in ({"node_id": "a-b"}, {"net_pool": ipaddress.IPv4Network("10.9.0.0/24")},
                   {"uid_base": (1 << 32) - UID_RANGE}):
        with pytest.raises(BadRequest):
            hostclaims.claim(dataclasses.replace(n1, **change))


def test_a_dead_edges_claim_is_taken_over(base: Settings, tmp_path: Path) -> None:
    import pickle

    n1 = nodes(base)[0]
    (tmp_path / "n1.pickle").write_bytes(pickle.dumps(n1))
    code = ("import sys, pickle; from rollbox.isolation import hostclaims; "
            "c = hostclaims.claim(pickle.load(open(sys.argv[1], 'rb'))); "
            "print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "n1.pickle")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(HostResourceConflict):  # another process, alive
            hostclaims.claim(n1)
    finally:
        proc.kill()
        proc.wait()
    hostclaims.claim(n1).release()  # killed -9: its lock went with it


def test_host_auto_takes_free_bands_and_keeps_them_for_restarts(base: Settings,
                                                                tmp_path: Path) -> None:
    def auto(name: str) -> Settings:
        s = Settings.scratch(tmp_path / name)
        s.host_dir, s.uid_base, s.uid_slots = base.host_dir, base.uid_base, 64
        s.net_host_range, s.net_pool = base.net_host_range, base.net_pool
        s.node_id = name
        return s

    fixed = hostclaims.claim(nodes(base)[0])  # band 1 and the first /20 beside base's
    a, b = auto("a"), auto("b")
    ca, cb = hostclaims.claim(a), hostclaims.claim(b)
    try:
        assert a.uid_base == base.uid_base and b.uid_base != a.uid_base
        for x, y in ((a, b), (a, fixed.holding), (b, fixed.holding)):
            hx = hostclaims.Holding.of(x) if isinstance(x, Settings) else x
            hy = hostclaims.Holding.of(y) if isinstance(y, Settings) else y
            assert hostclaims.conflicts(hx, hy) == []
        kept_a = (a.uid_base, a.net_pool)
    finally:
        cb.release()
        ca.release()
    again = auto("a")
    hostclaims.claim(again).release()
    assert (again.uid_base, again.net_pool) == kept_a  # from its data dir, not re-picked
    fixed.release()
