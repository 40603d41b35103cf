"""The embedded default: api, placement, watcher and one edge in one process, SQLite for state
(the IAM store and quota ledger in ``keys.db``), the local image store. No external service.
``rollbox serve`` runs it."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from rollbox.api.app import create_app
from rollbox.api.liveview import ViewConfig
from rollbox.api.ports import PortConfig
from rollbox.api.server import BackgroundServer, serve_app
from rollbox.edge.server import wait_healthy
from rollbox.compat.frontdoors import FRONT_DOORS
from rollbox.config import Settings
from rollbox.edge.edge import Edge, Limits
from rollbox.events.store import EventLog
from rollbox.iam import SQLiteIam, SQLiteLedger
from rollbox.isolation import syscalls
from rollbox.jobs import SqliteLeaseStore
from rollbox.placement import Placement, PlacementConfig
from rollbox.placement.registry import EdgeRegistry
from rollbox.watcher import Watcher

log = logging.getLogger(__name__)
DEFAULT_PORT = 7420


class EmbeddedNode:
    def __init__(self, settings: Settings | None = None, limits: Limits | None = None) -> None:
        self.settings = settings or Settings()
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.events: EventLog | None = None
        self.keys: SQLiteIam | None = None
        self.ledger: SQLiteLedger | None = None
        self.leases: SqliteLeaseStore | None = None
        self.edge: Edge | None = None
        self.registry: EdgeRegistry | None = None
        self.watcher: Watcher | None = None

    async def start(self):  # noqa: ANN201 - returns the FastAPI app
        s = self.settings
        self.events = EventLog(s.data_dir / "events.db")
        # The flat IAM's quotas.db is carried into keys.db once (then left alone).
        self.keys = SQLiteIam(s.data_dir / "keys.db", legacy_quotas=s.data_dir / "quotas.db")
        self.ledger = SQLiteLedger.of(self.keys)
        self.leases = SqliteLeaseStore(s.data_dir / "leases.db")
        self.ensure_admin_key()
        self.edge = Edge(s, self.events, limits=self.limits, leases=self.leases,
                         quotas=self.keys)
        await self.edge.start()
        # The node's own edge, probed in this process: not fenced (it stops with the watcher).
        # The watcher reconciles the quota ledger with the edge's live set (TTL, job lease and
        # OOM ends happen on the edge, not through the api).
        self.registry = EdgeRegistry([self.edge])
        self.watcher = Watcher(self.registry, local={self.edge.node_id}, settings=s,
                               ledger=self.ledger)
        await self.watcher.start()
        # Placement decides from the watcher's view, never an edge call per decision.
        placement = Placement(self.registry, self.watcher,
                              config=PlacementConfig.from_settings(s))
        ports = PortConfig.from_settings(s)
        return create_app(placement, self.keys,
                          leases=self.leases, ledger=self.ledger, front_doors=FRONT_DOORS,
                          watcher=self.watcher, port_config=ports,
                          view_config=ViewConfig.from_settings(s, ports.secret))

    def ensure_admin_key(self) -> str:
        """The local admin key, kept root-only next to the data (SDK default on this host)."""
        assert self.keys is not None
        path = self.settings.admin_key_path
        if path.exists():
            key = path.read_text().strip()
            try:
                self.keys.verify(key)
                return key
            except Exception:  # noqa: BLE001 - stale file: issue a new key
                pass
        key = self.keys.create("admin", admin=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key

    async def stop(self, destroy: bool = False) -> None:
        if self.watcher:
            await self.watcher.stop()
            self.watcher = None
        if self.edge:
            await self.edge.close(destroy=destroy)
        if self.events:
            self.events.close()
        if self.keys:
            self.keys.close()
        if self.ledger:
            self.ledger.close()
        if self.leases:
            self.leases.close()

    async def serve(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        app = await self.start()
        assert self.edge is not None
        for line in backend_lines(await self.edge.capacity()):  # e.g. the microVM accelerator
            print(line, file=sys.stderr, flush=True)
        try:
            await serve_app(app, host, port)
        finally:
            await self.stop()

    async def background(self, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
        """Start the api on a background task of this loop (tests); caller stops it."""
        app = await self.start()
        srv = BackgroundServer(app, host, port)
        await srv.start()
        return srv


def backend_lines(capacity: dict) -> list[str]:
    """One line per backend kind for `rollbox serve`: offered or why not, and its facts."""
    lines = []
    for kind, cap in sorted(dict(capacity.get("backends", {})).items()):
        if not cap.get("offered"):
            lines.append(f"backend {kind}: not offered ({cap.get('reason')})")
            continue
        facts = cap.get("facts") or {}
        if "accel" in facts:
            lines.append(f"backend {kind}: accelerator {facts['accel']} "
                         f"({facts.get('accel_reason', '')})")
        else:
            lines.append(f"backend {kind}: offered")
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChildProcess:
    """A child process of this one that tests and benchmarks kill -9 and start again (the
    node's server, :class:`ServerProcess`; an edge of its own, tests.helpers.edge_process):
    ``proc`` while it runs."""

    proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def become_subreaper() -> None:
        """Before starting the child: the agents of a killed child's sandboxes become this
        process's children (not init's, which on some hosts never reaps), so they can be
        reaped (:func:`reap_sandbox_orphans`) once a later child kills them."""
        syscalls.become_subreaper()

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind (its sandboxes and commands keep running)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class ServerProcess(ChildProcess):
    """``rollbox serve`` as a child process (its own core, as deployed) on a fixed port, which
    can be killed (``kill -9``) and started again on the same node: restart tests, ``bench``.
    With ``settings`` (tests) the child runs that node (data dir, cgroup parent, node id, uid
    range); ``env``: variables of settings the child has on top (``ROLLBOX_*``). Its log goes
    to a file, not a pipe: a pipe nobody drains fills up during a long benchmark and blocks the
    server on its next log line."""

    def __init__(self, settings: Settings | None = None, port: int | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.own_node = settings is None
        self.env = (None if settings is None and env is None else
                    {**os.environ, **(settings.environ() if settings else {}), **(env or {})})
        self.settings = settings or Settings()
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, name = tempfile.mkstemp(prefix="rollbox-serve-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def key(self) -> str:
        """The admin key (ROLLBOX_API_KEY for the node's own server)."""
        from rollbox.sdk import default_api_key  # the SDK's client: not for `rollbox serve`

        return ((self.own_node and default_api_key())
                or self.settings.admin_key_path.read_text().strip())

    def start(self, wait: bool = True) -> None:
        self.become_subreaper()  # reap_orphans() reaps a killed server's agents
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollbox.cli", "serve", "--port", str(self.port)],
                stdout=subprocess.DEVNULL, stderr=err, env=self.env)
        if wait:
            proc = self.proc
            wait_healthy(self.url, lambda: proc.poll() is None, self.log)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), SIGKILL after 30 s; the log goes."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self.log.unlink(missing_ok=True)
        self.reap_orphans()

    def reap_orphans(self) -> None:
        """Reap the zombies of this node's sandboxes that a killed server left to this process
        (:func:`reap_sandbox_orphans`)."""
        reap_sandbox_orphans(self.settings.node_id)


def reap_sandbox_orphans(node_id: str) -> None:
    """Reap the zombies of node ``node_id``'s sandboxes that a killed edge process left to this
    one (a child subreaper): their agents, killed by a later edge that was not their parent.
    (Unreaped, each holds a uid slot's ids, which later sandboxes reuse.) Only processes in one
    of this node's sandbox cgroups are waited for, never another child of this process."""
    me, node = os.getpid(), f"/{node_id}-"
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cgroup = (d / "cgroup").read_text()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == me and node in cgroup:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(d.name), 0)


@contextlib.contextmanager
def server_process(url: str | None = None, settings: Settings | None = None,
                   env: Mapping[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """(url, api key) of a running server: ``url`` if given, else a :class:`ServerProcess`
    started for ``settings`` (default: this node) and ``env`` and stopped on exit."""
    if url is not None:
        from rollbox.sdk import default_api_key

        wait_healthy(url, None)
        yield url, (default_api_key()
                    or (settings or Settings()).admin_key_path.read_text().strip())
        return
    srv = ServerProcess(settings, env=env)
    try:
        srv.start()
        yield srv.url, srv.key
    finally:
        srv.stop()
