"""The DNS gate on real sandboxes: allowed names over UDP and TCP open their ports, AAAA of an
allowed name is empty (IPv6 is closed), learned addresses leave the allow-list with the TTL
(not while a connection uses them), and a policy change drops a removed name's addresses."""
from __future__ import annotations

import asyncio
import json

from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import sandbox_net
from tests.conftest import needs_python
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    CONNECT,
    DNS_CLIENT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)

pytestmark = [needs_python]
A, AAAA, TXT = 1, 28, 16


async def run(edge, sid: str, cmd: list[str], timeout: float = 20) -> str:
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=timeout))
    res = await edge.exec_wait(sid, eid)
    return res.stdout.strip() + res.stderr.strip()


async def connect(edge, sid: str, ip: str, port: int, proto: str = "tcp") -> str:
    return await run(edge, sid, ["python3", "-c", CONNECT, ip, str(port), proto])


async def dnsq(edge, sid: str, specs: list[list]) -> dict[str, str]:
    return json.loads(await run(edge, sid, ["python3", "-c", DNS_CLIENT, json.dumps(specs)]))


async def test_allowed_names_udp_tcp_aaaa(edge, internet: FakeInternet,  # noqa: F811
                                          upstream: FakeUpstream) -> None:  # noqa: F811
    info = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy(
        allow=["allowed.example:8080", "*.wild.example:443"])))
    sid = info.id
    internet.route_from(sid)
    ip = internet.ips[0]
    assert await connect(edge, sid, ip, 8080) == "err 1"  # not resolved yet: closed
    out = await dnsq(edge, sid, [["allowed.example", A, True], ["allowed.example", AAAA, False],
                                 ["allowed.example", TXT, True], ["x.wild.example", A, False]])
    assert out == {"allowed.example/1/tcp": "rcode 0 answers 1",
                   "allowed.example/28/udp": "rcode 0 answers 0",
                   "allowed.example/16/tcp": "rcode 0 answers 0",
                   "x.wild.example/1/udp": "rcode 0 answers 1"}, out
    assert await connect(edge, sid, ip, 8080) == "ok hi"
    assert await connect(edge, sid, ip, 443) == "ok hi"  # the wildcard name's port
    assert await connect(edge, sid, ip, 80) == "err 1"  # no name opened 80
    # Only A questions ever reach the upstream (AAAA/TXT are answered empty at the gate).
    assert sorted(set(upstream.log)) == [("udp", "A", "allowed.example"),
                                         ("udp", "A", "x.wild.example")], upstream.log
    # getaddrinfo (AAAA + A) still works for the sandbox's own tools.
    got = await run(edge, sid, ["python3", "-c",
                                "import socket; print(sorted({a[4][0] for a in "
                                "socket.getaddrinfo('allowed.example', 8080)}))"])
    assert got == str([ip]), got
    # Removing a name takes its learned addresses out of the allow-list at once.
    await edge.set_network(sid, NetworkPolicy(allow=["*.wild.example:443"]))
    assert await connect(edge, sid, ip, 8080) == "err 1"
    assert await connect(edge, sid, ip, 443) == "ok hi"


async def test_learned_addresses_expire_with_ttl(edge, internet: FakeInternet,  # noqa: F811
                                                 upstream: FakeUpstream, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(sandbox_net, "MIN_TTL", 1)
    monkeypatch.setattr(sandbox_net, "SWEEP_S", 0.2)
    upstream.ttl = 1
    info = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy(
        allow=["short.example:8080"])))
    sid = info.id
    internet.route_from(sid)
    ip = internet.ips[0]
    net = edge.live[sid].box.network
    # A connection opened while the address is allowed, kept open past its expiry.
    hold = """
import socket, sys, time
ip = socket.gethostbyname('short.example')
s = socket.create_connection((ip, 8080), timeout=3)
print('open', flush=True)
time.sleep(2.5)
s.sendall(b'still'); print(s.recv(5).decode(), flush=True)
"""
    eid = await edge.exec_start(sid, ExecSpec(cmd=["python3", "-c", hold], timeout_s=20))
    res = await edge.exec_wait(sid, eid)
    assert res.stdout.split() == ["open", "still"], res.stdout + res.stderr
    # Nothing uses it any more: it leaves the allow-list within a sweep or two.
    for _ in range(50):
        if not net.dns_ips:
            break
        await asyncio.sleep(0.1)
    assert net.dns_ips == {}
    assert await connect(edge, sid, ip, 8080) == "err 1"
    # Asking again opens it again.
    assert (await dnsq(edge, sid, [["short.example", A, False]])) == {
        "short.example/1/udp": "rcode 0 answers 1"}
    assert await connect(edge, sid, ip, 8080) == "ok hi"
