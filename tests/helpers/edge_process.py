"""One edge in a process of its own, served over HTTP (``edge.service``), for fault drills
that stop (SIGSTOP) or kill (SIGKILL) a node's edge: ``EdgeProcess(settings)`` runs
``python -m tests.helpers.edge_process`` with the node's settings in its environment; its
``remote()`` is a RemoteEdge to it. SIGTERM (``stop()``) closes the edge destroying its
sandboxes; ``kill()`` leaves them running (re-adopted by the next start, as after a crash)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollbox.config import Settings
from rollbox.embedded import ChildProcess

REPO = Path(__file__).resolve().parents[2]


async def _serve(port: int, token: str) -> None:
    from rollbox.edge.edge import Edge
    from rollbox.edge.service import serve_edge
    from rollbox.events.store import EventLog

    s = Settings()
    events = EventLog(s.data_dir / "events.db")
    edge = Edge(s, events)
    await edge.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        async with serve_edge(edge, "127.0.0.1", port, token):
            print("ready", flush=True)
            await stop.wait()
    finally:
        await edge.close(destroy=True)
        events.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EdgeProcess(ChildProcess):
    def __init__(self, settings: Settings, token: str) -> None:
        self.settings = settings
        self.token = token
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, name = tempfile.mkstemp(prefix="rollbox-edge-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> float:
        """Start it and wait until it serves; returns the seconds that took."""
        self.become_subreaper()  # stop() reaps a killed edge's agents
        env = {**os.environ, **self.settings.environ(),
               "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
        t0 = time.monotonic()
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.edge_process", str(self.port), self.token],
                stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # "ready" once it serves
            line = self.proc.stdout.readline()
            if line.strip() == b"ready":
                return time.monotonic() - t0
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"edge process did not start: {self.log.read_text()[-2000:]}")

    def remote(self):  # noqa: ANN201 - a RemoteEdge
        from rollbox.edge.remote import RemoteEdge

        return RemoteEdge(self.settings.node_id, self.url, self.token)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT): the edge destroys its sandboxes and exits."""
        from rollbox.embedded import reap_sandbox_orphans

        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        reap_sandbox_orphans(self.settings.node_id)

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), sys.argv[2]))
