"""Cluster nodes on one host get disjoint host resources and the cluster's whole port range as
platform ports; the port range reads back through ROLLBOX_PLATFORM_PORTS."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.cluster.local import node_env, node_settings, ports_text
from rollbox.cluster.ray_nodes import MAX_NODES, ClusterPorts, node_args
from rollbox.config import Settings, ports
from rollbox.isolation import hostclaims


def _base(tmp_path: Path) -> Settings:
    s = Settings()
    s.cluster_dir = tmp_path
    s.cluster_port_base = 47100
    return s


def test_co_hosted_nodes_share_no_host_resource(tmp_path: Path) -> None:
    s = _base(tmp_path)
    nodes = [node_settings(s, f"n{i}", i) for i in range(MAX_NODES)]
    for field in ("node_id", "data_dir", "run_dir", "cgroup_parent", "net_pool"):
        assert len({str(getattr(n, field)) for n in nodes}) == MAX_NODES, field
    bands = sorted((n.uid_base, n.uid_base + n.uid_slots * 65536) for n in nodes)
    assert all(a[1] <= b[0] for a, b in zip(bands, bands[1:])), bands
    # above the embedded node's band and the test runs' bands (tests/conftest.py)
    assert bands[0][0] >= s.uid_base + (s.uid_slots + 64 + 1024 * 8) * 65536
    assert all(not n.net_pool.overlaps(s.net_pool) for n in nodes)
    pools = [n.net_pool for n in nodes]
    assert all(not a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1:])
    assert all(n.images_dir == s.images_dir for n in nodes)  # built layers, read-only
    # what each edge claims at start: no two nodes', nor the embedded node's, collide (but
    # for the id "n0" this test gives both: `cluster up` names its nodes <node>c<i>)
    held = [hostclaims.Holding.of(n) for n in nodes]
    assert all(hostclaims.conflicts(a, b) == [] for i, a in enumerate(held) for b in held[i + 1:])
    embedded = hostclaims.Holding.of(s)
    assert all([r for r, _ in hostclaims.conflicts(h, embedded)] in ([], ["node_id"])
               for h in held)
    assert all(n.net_pool.subnet_of(n.net_host_range) for n in nodes)
    assert node_settings(s, "n1", 1, nodes=4).node_share == 0.25


def test_every_port_of_the_cluster_is_a_platform_port(tmp_path: Path) -> None:
    s = _base(tmp_path)
    p = ClusterPorts(s.cluster_port_base)
    env = node_env(s, "n1", 1)
    platform = set(ports(env["ROLLBOX_PLATFORM_PORTS"]))
    used = {p.gcs, p.dashboard, p.postgres, p.api, *(p.replica(i) for i in range(5))}
    for i in range(MAX_NODES):
        used |= {int(a) for a in node_args(p, i) if a.isdigit()} | {p.edge(i)}
        b = p.node_block(i)
        used |= set(range(b + 7, b + 20))  # Ray's worker ports
    assert used <= platform
    assert max(used) == p.last


def test_ports_text_round_trips() -> None:
    xs = (80, 7440, 7441, 7442, 9000, 9002, 9003)
    assert ports_text(xs) == "80,7440-7442,9000,9002-9003"
    assert ports(ports_text(xs)) == xs
    assert ports("7440-7442, 8080, x, 5-") == (7440, 7441, 7442, 8080)


def test_out_of_range_node_and_replica_are_refused() -> None:
    p = ClusterPorts(47100)
    with pytest.raises(errors.BadRequest):
        p.node_block(MAX_NODES)
    with pytest.raises(errors.BadRequest):
        p.replica(5)


def test_the_edge_actor_reads_back_what_its_node_claims(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    s = _base(tmp_path)
    for k in [k for k in os.environ if k.startswith("ROLLBOX_")]:
        monkeypatch.delenv(k)
    for k, v in node_env(s, "n1", 1, nodes=2).items():
        monkeypatch.setenv(k, v)
    child, want = Settings(), node_settings(s, "n1", 1, nodes=2)
    assert hostclaims.Holding.of(child) == hostclaims.Holding.of(want)
    assert (child.node_share, child.host_auto) == (0.5, True)


def test_the_cluster_token_file_is_root_only(tmp_path: Path) -> None:
    """The token lets anything that holds it drive every edge: its file is 0600 when made, and
    one found more open (made before, copied in) is made 0600; write_secret over an old
    0644 file leaves it 0600 too (O_CREAT's mode is only a new file's)."""
    from rollbox.cluster.local import ensure_token, write_secret

    s = Settings()
    s.cluster_dir = tmp_path / "cluster"
    path = ensure_token(s)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text().strip()) >= 32
    token = path.read_text()
    path.chmod(0o644)
    assert ensure_token(s) == path and path.read_text() == token  # the same token, made 0600
    assert path.stat().st_mode & 0o777 == 0o600
    other = tmp_path / "dsn"
    other.write_text("old")
    other.chmod(0o644)
    write_secret(other, "new")
    assert other.stat().st_mode & 0o777 == 0o600 and other.read_text() == "new\n"


def test_an_edge_actor_reads_its_token_from_a_root_only_file(tmp_path: Path) -> None:
    """Edge actors get the path of the node's token file (their arguments sit in Ray's GCS),
    never the token: each node's file is its own, in its dir, and one that is missing, empty,
    a symlink or readable by others is refused (InfraError), the twin 0600 file read back."""
    import inspect

    from rollbox.cluster.edge_actor import EdgeActor, create_edge, read_token
    from rollbox.cluster.local import node_token_path, write_secret

    s = _base(tmp_path)
    paths = {node_token_path(s, f"n{i}", i) for i in range(3)}
    assert len(paths) == 3
    assert all(p.parent == node_settings(s, p.parent.name, 0).data_dir for p in paths)
    assert "token" not in inspect.signature(EdgeActor).parameters
    assert "token" not in inspect.signature(create_edge).parameters
    path = node_token_path(s, "n0", 0)
    write_secret(path, "t" * 43)
    assert read_token(str(path)) == "t" * 43
    path.chmod(0o640)
    with pytest.raises(errors.InfraError, match="readable by others"):
        read_token(str(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    path.chmod(0o600)
    with pytest.raises(errors.InfraError):
        read_token(str(link))
    write_secret(path, "")
    with pytest.raises(errors.InfraError, match="empty"):
        read_token(str(path))
    with pytest.raises(errors.InfraError):
        read_token(str(tmp_path / "missing"))
