"""Network policy on real sandboxes: default deny, allow-lists, live cuts, never-reachable
destinations, bad input, clean teardown (the DNS gate: test_netpolicy_dns.py)."""
from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from rollbox.errors import BadRequest, SandboxDead
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import bpf, link
from tests.conftest import needs_python

pytestmark = [needs_python]


class HostServer:
    """A host-side address (TEST-NET-2 on a dummy link, not loopback) with a TCP echo server."""

    def __init__(self) -> None:
        self.ifname = f"rbtsrv{secrets.token_hex(3)}"
        self.ip = f"198.51.100.{secrets.randbelow(200) + 20}"
        # A veth pair with both ends on the host: a host-side address that is not loopback.
        subprocess.run(["ip", "link", "add", self.ifname, "type", "veth", "peer", "name",
                        self.ifname + "p"], check=True)
        subprocess.run(["ip", "addr", "add", f"{self.ip}/32", "dev", self.ifname], check=True)
        subprocess.run(["ip", "link", "set", self.ifname, "up"], check=True)
        self.srv = socket.create_server((self.ip, 0))
        self.port = self.srv.getsockname()[1]
        self.conns = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        with c:
            try:
                while data := c.recv(4096):
                    c.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self.srv.close()
        subprocess.run(["ip", "link", "del", self.ifname], capture_output=True)


@pytest.fixture
def testhost() -> Iterator[HostServer]:
    h = HostServer()
    try:
        yield h
    finally:
        h.close()


CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); s.sendall(b'hi'); print('ok', s.recv(10).decode())
except OSError as e:
    print('err', e.errno)
"""


async def run(edge, sid: str, cmd: list[str], timeout: float = 20) -> str:
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=timeout))
    res = await edge.exec_wait(sid, eid)
    return res.stdout.strip() + res.stderr.strip()


async def connect(edge, sid: str, ip: str, port: int) -> str:
    return await run(edge, sid, ["python3", "-c", CONNECT, ip, str(port)])


async def test_default_deny_then_allow_then_live_cut(edge, testhost: HostServer) -> None:
    info = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy()))
    sid = info.id
    assert link.exists(sid)
    assert await connect(edge, sid, testhost.ip, testhost.port) == "err 1"  # EPERM at connect
    await edge.set_network(sid, NetworkPolicy(allow=[f"{testhost.ip}:{testhost.port}"]))
    assert await connect(edge, sid, testhost.ip, testhost.port) == "ok hi"
    # Other ports of the same host stay closed.
    assert await connect(edge, sid, testhost.ip, testhost.port + 1) == "err 1"

    # A connection opened while allowed dies when the permission is removed.
    loop_script = f"""
import socket, time
s = socket.create_connection(('{testhost.ip}', {testhost.port}), timeout=5)
s.settimeout(0.5)
print('connected', flush=True)
n = 0
while True:
    try:
        s.sendall(b'x'); s.recv(1); n += 1; time.sleep(0.01)
    except OSError as e:
        print('cut after', n, flush=True); break
"""
    before = testhost.conns
    eid = await edge.exec_start(sid, ExecSpec(cmd=["python3", "-c", loop_script], timeout_s=20))
    deadline = time.monotonic() + 10
    while testhost.conns == before and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await edge.set_network(sid, NetworkPolicy(allow=[]))
    assert time.monotonic() - t0 < 0.5
    res = await edge.exec_wait(sid, eid)
    assert "connected" in res.stdout and "cut after" in res.stdout, res.stdout + res.stderr
    assert not res.timed_out

    await edge.delete(sid)
    assert not link.exists(sid)
    assert sid not in link.list_links().values()
    assert edge.leftovers(sid) == []


async def test_never_reachable(edge, testhost: HostServer, monkeypatch) -> None:
    # A "platform port" served on every host address, and a host-loopback-only service.
    platform = socket.create_server(("0.0.0.0", 0))
    pport = platform.getsockname()[1]
    loopback = socket.create_server(("127.0.0.1", 0))
    lport = loopback.getsockname()[1]
    monkeypatch.setattr(edge.settings, "platform_ports", (pport,))
    try:
        a = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy(
            allow=[f"0.0.0.0/0:{pport}", f"0.0.0.0/0:{lport}", "0.0.0.0/0:9999"])))
        b = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy()))
        la, lb = a.id, b.id
        gate_a = link.find(la).gate_ip
        b_ip = link.find(lb).sandbox_ip
        host_ip = testhost.ip
        # the platform's port: on a host address and on the gate, even with 0.0.0.0/0 allowed
        assert await connect(edge, la, host_ip, pport) == "err 1"
        assert await connect(edge, la, gate_a, pport) == "err 1"
        # the host's loopback: 127.0.0.1 is the sandbox's own; the gate never leads there
        assert (await connect(edge, la, "127.0.0.1", lport)).startswith("err 111")
        assert await connect(edge, la, gate_a, lport) == "err 1"
        # another sandbox
        listen = "import socket,time; s=socket.create_server(('0.0.0.0', 9999)); time.sleep(15)"
        await edge.exec_start(lb, ExecSpec(cmd=["python3", "-c", listen], background=True,
                                           timeout_s=20))
        await asyncio.sleep(0.3)
        assert await connect(edge, la, b_ip, 9999) == "err 1"
    finally:
        platform.close()
        loopback.close()


async def test_bad_input(edge) -> None:
    with pytest.raises(BadRequest, match="unknown network permission"):
        await edge.create(SandboxSpec(image="debian:bookworm",
                                      network=NetworkPolicy(allow=["nosuchperm"])))
    info = await edge.create(SandboxSpec(image="debian:bookworm"))
    sid = info.id
    assert not link.exists(sid)  # no policy: no link, no programs
    assert bpf.attached_programs(edge.live[sid].box.v2_cgroup) == []
    for bad in ["nosuchperm", "host:99999", "1.2.3.4/40:80", "1.2.3.4:80/icmp", "bad!host:1",
                "10.0.0.1/8:80"]:
        with pytest.raises(BadRequest):
            await edge.set_network(sid, NetworkPolicy(allow=[bad]))
    assert not link.exists(sid)
    await edge.delete(sid)
    with pytest.raises(SandboxDead):
        await edge.set_network(sid, NetworkPolicy(allow=[]))
