"""Audit counters of a real networked sandbox: every refusal of its policy — a name the DNS
gate REFUSED, a connect or UDP send the BPF filter denied, packets it dropped after a rule was
removed — is counted per sandbox, shown in GET (``SandboxInfo.audit``) and logged as
``net.denied`` events (rate-limited; flushed at delete). A sandbox whose traffic is all allowed
counts nothing (the counters are not noise)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

import rollbox.edge.edge as edge_mod
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import link
from tests.conftest import needs_python
from tests.integration.test_netpolicy_live import HostServer, connect, run, testhost  # noqa: F401

pytestmark = [needs_python]

# One DNS question (A, "exfil.example") straight to the gate: exactly one REFUSED.
DNS_ONCE = r"""
import socket, struct, sys
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in "exfil.example".split(".")) + b"\0"
q += struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
s.sendto(q, (sys.argv[1], 53)); r = s.recv(512)
print("rcode", r[3] & 0x0F)
"""
UDP_SEND = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", ("203.0.113.9", 9)); print("sent")
except OSError as e:
    print("err", e.errno)
"""
CONNECT6 = r"""
import socket
s = socket.socket(socket.AF_INET6); s.settimeout(2)
try:
    s.connect(("2001:db8::1", 80)); print("ok")
except OSError as e:
    print("err", e.errno)
"""
HOLD = """
import socket, time
s = socket.create_connection(('{ip}', {port}), timeout=5)
s.settimeout(0.5)
print('connected', flush=True)
while True:
    try:
        s.sendall(b'x'); s.recv(1); time.sleep(0.01)
    except OSError:
        print('cut', flush=True); break
"""


async def _events(edge, sid: str) -> list[dict]:  # noqa: ANN001
    return [json.loads(ev.data) async for ev in edge.events(sid, 0, False)
            if ev.kind == "net.denied"]


async def test_refusals_are_counted_shown_and_logged(edge, testhost: HostServer,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge_mod, "AUDIT_EVERY_S", 1)
    allowed = f"{testhost.ip}:{testhost.port}"
    sid = (await edge.create(SandboxSpec(image="python:3.11",
                                         network=NetworkPolicy(allow=[allowed])))).id
    gate = link.find(sid).gate_ip  # type: ignore[union-attr]
    assert (await edge.get(sid)).audit.model_dump() == {  # type: ignore[union-attr]
        "dns_refused": 0, "connect_denied": 0, "sendmsg_denied": 0, "packets_dropped": 0}
    assert await connect(edge, sid, testhost.ip, testhost.port) == "ok hi"  # allowed: no count
    assert await connect(edge, sid, testhost.ip, testhost.port + 1) == "err 1"
    assert await connect(edge, sid, "192.0.2.7", 80) == "err 1"
    assert await run(edge, sid, ["python3", "-c", CONNECT6]) == "err 1"
    assert await run(edge, sid, ["python3", "-c", UDP_SEND]) == "err 1"
    assert await run(edge, sid, ["python3", "-c", DNS_ONCE, gate]) == "rcode 5"  # REFUSED
    # a connection opened while allowed, cut by removing its rule: its packets are dropped
    eid = await edge.exec_start(sid, ExecSpec(cmd=["python3", "-c", HOLD.format(
        ip=testhost.ip, port=testhost.port)], timeout_s=20))
    deadline = time.monotonic() + 10
    while testhost.conns < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    await edge.set_network(sid, NetworkPolicy(allow=[]))
    assert "cut" in (await edge.exec_wait(sid, eid)).stdout
    audit = (await edge.get(sid)).audit
    assert audit is not None
    assert (audit.dns_refused, audit.connect_denied, audit.sendmsg_denied) == (1, 3, 1), audit
    assert audit.packets_dropped >= 1, audit
    # net.denied events: totals and increments, at most one per AUDIT_EVERY_S
    deadline = time.monotonic() + 5
    while not await _events(edge, sid) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    events = await _events(edge, sid)
    assert events and all(set(e) == {"total", "new", "names"} for e in events), events
    assert sum(e["new"]["connect_denied"] for e in events) <= 3
    await edge.delete(sid)  # flushes what the last sweep did not log
    events = await _events(edge, sid)
    last = events[-1]["total"]
    assert (last["dns_refused"], last["connect_denied"], last["sendmsg_denied"]) == (1, 3, 1)
    for key in last:
        assert sum(e["new"][key] for e in events) == last[key], events
    assert [n for e in events for n in e["names"]] == ["exfil.example"], events


async def test_allowed_traffic_counts_nothing(edge, testhost: HostServer,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge_mod, "AUDIT_EVERY_S", 1)
    sid = (await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy(
        allow=[f"{testhost.ip}:{testhost.port}"])))).id
    for _ in range(3):
        assert await connect(edge, sid, testhost.ip, testhost.port) == "ok hi"
    await asyncio.sleep(1.5)
    audit = (await edge.get(sid)).audit
    assert audit is not None and not any(audit.model_dump().values()), audit
    await edge.delete(sid)
    assert await _events(edge, sid) == []
    # no policy, no audit
    plain = await edge.create(SandboxSpec(image="python:3.11"))
    assert (await edge.get(plain.id)).audit is None
