"""Network policy change latency on a live sandbox (`rollbox bench netpolicy [--json]`).

An edge in a private data dir runs one python:3.11 sandbox with a network policy; an echo
server listens on a host-side address (a veth pair on the host, not loopback). Measured on the
host's clock, from the moment set_network is called:

* cut: the sandbox sends a byte every ~1 ms on a connection opened while allowed; the time
  until the server receives its last byte after the permission is removed;
* open: the sandbox retries connect() every ~1 ms while denied; the time until the server
  accepts after the permission is added.

Target: both <= 50 ms at p99.
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, latency_ms
from rollbox.config import Settings
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec

CLIENT = """
import socket, sys, time, errno
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(n):
    while True:  # open: retry until allowed
        s = socket.socket()
        try:
            s.connect((ip, port)); break
        except OSError:
            s.close(); time.sleep(0.001)
    s.settimeout(0.2)
    try:
        while True:  # cut: send until the packets stop
            s.sendall(b'x'); s.recv(1); time.sleep(0.001)
    except OSError:
        pass
    s.close()
"""


class Server:
    def __init__(self, ip: str) -> None:
        self.srv = socket.create_server((ip, 0))
        self.port = self.srv.getsockname()[1]
        self.accepts: list[float] = []
        self.last_rx = 0.0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.accepts.append(time.monotonic())
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c: socket.socket) -> None:
        with c:
            try:
                while data := c.recv(64):
                    self.last_rx = time.monotonic()
                    c.sendall(data)
            except OSError:
                pass


async def run(rounds: int) -> dict[str, Any]:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    tmp = Path(tempfile.mkdtemp(prefix="rollbox-bench-net-"))
    tmp.chmod(0o711)
    ifname = f"rbtsrv{secrets.token_hex(3)}"
    ip = f"198.51.100.{secrets.randbelow(200) + 20}"
    subprocess.run(["ip", "link", "add", ifname, "type", "veth", "peer", "name", ifname + "p"],
                   check=True)
    s = Settings.scratch(tmp)
    s.cgroup_parent = f"rollbox-bench-{secrets.token_hex(2)}"
    s.node_id = f"b{secrets.token_hex(3)}"
    events = EventLog(tmp / "events.db")
    edge = Edge(s, events)
    try:
        subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", ifname], check=True)
        subprocess.run(["ip", "link", "set", ifname, "up"], check=True)
        srv = Server(ip)
        await edge.start()
        info = await edge.create(SandboxSpec(image="python:3.11", network=NetworkPolicy()), "bench")
        allow = NetworkPolicy(allow=[f"{ip}:{srv.port}"])
        deny = NetworkPolicy(allow=[])
        eid = await edge.exec_start(info.id, ExecSpec(
            cmd=["python3", "-c", CLIENT, ip, str(srv.port), str(rounds)], timeout_s=600))
        await asyncio.sleep(0.5)  # the client is retrying connect() now
        opens, cuts, calls = [], [], []
        for _ in range(rounds):
            n = len(srv.accepts)
            t0 = time.monotonic()
            await edge.set_network(info.id, allow)
            calls.append(time.monotonic() - t0)
            while len(srv.accepts) == n:
                await asyncio.sleep(0.0005)
            opens.append(srv.accepts[-1] - t0)
            await asyncio.sleep(0.05)  # traffic flows
            t0 = time.monotonic()
            await edge.set_network(info.id, deny)
            calls.append(time.monotonic() - t0)
            await asyncio.sleep(0.3)  # past the client's 0.2 s stall detection
            cuts.append(max(0.0, srv.last_rx - t0))
        await edge.exec_wait(info.id, eid)
        return {"rounds": rounds, **latency_ms(calls, "set_network_call_"),
                **latency_ms(opens, "open_"), **latency_ms(cuts, "cut_"), "target_ms": 50}
    finally:
        await edge.close(destroy=True)
        events.close()
        subprocess.run(["ip", "link", "del", ifname], capture_output=True)
        from rollbox.isolation import cgroups
        cgroups.remove_parent_if_empty(s.cgroup_parent)
        shutil.rmtree(tmp, ignore_errors=True)


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    res = emit(asyncio.run(run(10 if quick else 40)), json_out, digits=2)
    if not json_out:
        for k, v in res.items():
            print(f"{k:28s} {v}")
    return res


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
