"""Red-team class 27 in cluster mode: from a sandbox of the cluster, none of the cluster's own
ports on this host is reachable - Ray's GCS, raylets, object managers, agents and workers, the
edges' HTTP services, the api's shared and replica ports - not even with a rule naming exactly
the host address and the port (what opens any other host port, the twin below). They are kept
by the edges' platform ports (the cluster's whole range, ``node_settings``): Ray binds 0.0.0.0
whatever address it is given. PostgreSQL listens on loopback only, which a sandbox's loopback
is not. Containers (cgroup-BPF filter) and microVMs (nftables at the tap; the guest's root owns
its network stack, so that filter is all there is) take the same port set: one run each, the
microVM's one boot under TCG."""
from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.root, pytest.mark.skipif(not have_image("debian:bookworm"),
                                                   reason="debian:bookworm not built")]
PROBE = ("for t in \"$@\"; do if timeout 2 bash -c \"exec 3<>/dev/tcp/${t%:*}/${t#*:}\" "
         "2>/dev/null; then echo \"$t open\"; else echo \"$t shut\"; fi; done")


def listening_ports(lo: int, hi: int) -> set[int]:
    """TCP ports in [lo, hi] with a listener on this host (any address)."""
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            port = local.rsplit(":", 1)[1]
            if state == "0A" and lo <= int(port, 16) <= hi:
                out.add(int(port, 16))
    return out


def host_ip() -> str:
    from rollbox.netpolicy.policy import host_addresses

    pools = ipaddress.IPv4Network("10.0.0.0/8")
    ips = sorted(str(a) for a in host_addresses() if not a.is_loopback and a not in pools)
    assert ips, "no host address other than loopback and the sandboxes' links"
    return ips[0]


# the microVM's one boot under TCG on a loaded 2-core host can take minutes (pytest's 300 s
# default covered both runs with the cluster's start only just)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["container", "microvm"])
async def test_d27_no_port_of_the_cluster_is_reachable_from_a_sandbox(
        cluster, backend: str) -> None:  # noqa: ANN001
    state, _ = cluster
    ports = state.ports
    open_ports = listening_ports(ports.base, ports.last)
    # What must be there: the GCS, every node's raylet and object manager (on every address),
    # the edges and the api (on the cluster address: loopback here, a host address when nodes
    # join from other hosts; covered by the same range either way).
    expected = {ports.gcs, ports.api, *(ports.replica(i) for i in range(len(state.replicas)))}
    for n in state.nodes:
        b = ports.node_block(n.index)
        expected |= {b, b + 1, ports.edge(n.index)}
    assert expected <= open_ports, sorted(expected - open_ports)
    ip = host_ip()
    twin = socket.create_server(("0.0.0.0", 0))  # any other host service on every address
    threading.Thread(target=lambda: [twin.accept()[0].close() for _ in range(3)],
                     daemon=True).start()
    twin_port = twin.getsockname()[1]
    targets = [f"{ip}:{p}" for p in sorted(open_ports)] + [f"{ip}:{twin_port}"]
    key = Path(state.admin_key).read_text().strip()
    try:
        async with AsyncClient(state.api_url, key) as c:
            try:
                # half a CPU: a co-hosted node's share of this host (2 CPUs / 3 nodes) is
                # below the one CPU a sandbox asks by default
                sb = await c.create("debian:bookworm", ttl_s=600, network=targets,
                                    backend=backend, cpus=0.5)
            except errors.BadRequest as exc:
                if exc.details.get("backend") == backend:
                    pytest.skip(f"the cluster's nodes offer no {backend} ({exc.message})")
                raise
            try:
                r = await sb.exec(["bash", "-c", PROBE, "probe", *targets], timeout=300)
            finally:
                await sb.delete()
    finally:
        twin.close()
    seen = dict(line.rsplit(" ", 1) for line in r.stdout.split("\n") if line)
    # Twin: the same rule form does open a host port that is not the cluster's.
    assert seen.pop(f"{ip}:{twin_port}") == "open", r.stdout
    assert seen == {t: "shut" for t in targets[:-1]}, r.stdout
