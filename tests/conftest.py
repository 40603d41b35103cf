"""Shared fixtures: a real edge on this host, in its own data dir, cgroup parent and uid range,
and a suite-wide check that nothing of any sandbox is left on the host afterwards."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollbox.config import Settings
from rollbox.isolation import cgroups, netns

# Per test run, so two runs on one machine (developers, helpers) never see each other's
# sandboxes in the suite-end leak check.
TEST_RUN = secrets.token_hex(2)
TEST_CGROUP = f"rollbox-test-{TEST_RUN}"
TEST_NODE = f"t{TEST_RUN}"
# Above the node's own and its image builds' uid ranges, in one of 8 bands picked per run, so
# concurrent test runs (whose sandboxes are checked for leftover processes by host uid) rarely
# share a range.
BASE_UID = Settings().uid_base + (Settings().uid_slots + 64
                                  + 1024 * (int(TEST_RUN, 16) % 8)) * 65536


def node_settings(tmp: Path, node: str | None = None, run_dir: Path | None = None) -> Settings:
    """Settings of a test edge. Each gets its own node id and cgroup parent (an edge cleans up
    host resources of its node's sandboxes it has no record of, so two edges must never share
    one; the host claims refuse it), and takes a free uid band and subnet when it starts."""
    s = Settings.scratch(tmp)  # the node's built images, shared read-only
    s.run_dir = run_dir or s.run_dir  # no run tmpfs here: test_run_tmpfs covers that path
    s.node_id = node or f"{TEST_NODE}{secrets.token_hex(3)}"
    s.cgroup_parent = f"{TEST_CGROUP}-{s.node_id}"  # one per edge (host claims)
    # host_auto (scratch): the edge takes the first free band from here and /22 of the range.
    s.uid_base = BASE_UID
    s.uid_slots = 1024
    s.net_pool = next(n for n in s.net_host_range.subnets(new_prefix=22)
                      if not n.overlaps(Settings().net_pool))
    s.vm_templates = False  # microVMs boot cold; the one template of a run: vm_template_node
    s.vm_full_templates = "off"  # full VMs too (a disk image's template: the tests that ask)
    s.vm_fork_spares = 0  # a fork's children start their own QEMUs (test_fork_microvm_spares: n)
    register_run_owner()
    return s


def have_image(name: str) -> bool:
    from rollbox.images.store import ImageStore

    try:
        ImageStore(Settings().images_dir).resolve(name)
        return True
    except Exception:  # noqa: BLE001
        return False


@contextlib.contextmanager
def private_image_store(root: Path) -> Iterator:
    """An ImageStore under ``root``; on exit unmount what was mounted below ``root`` (overlays
    first: they pin the layer mounts) and fail if anything had to be forced."""
    from rollbox.images.mounts import LayerMounts
    from rollbox.images.store import ImageStore
    from rollbox.isolation import syscalls
    from rollbox.isolation.syscalls import read_mountinfo

    store = ImageStore(root / "images")
    yield store
    for mnt, fstype, _src in reversed(read_mountinfo()):
        if mnt.startswith(str(root)) and fstype == "overlay":
            syscalls.umount(mnt, syscalls.MNT_DETACH)
    LayerMounts(store).unmount_all()
    leftover = [m for m, _, _ in read_mountinfo() if m.startswith(str(root))]
    for mnt in reversed(leftover):
        syscalls.umount(mnt, syscalls.MNT_DETACH)
    assert not leftover, f"test leaked mounts: {leftover}"


@pytest.fixture
def names(edge) -> Iterator[list[str]]:  # noqa: ANN001
    """Image names the test tags (see new_name); their refs are removed afterwards (layers
    go with gc)."""
    from rollbox import errors

    made: list[str] = []
    yield made
    for name in made:
        try:
            edge.store.remove(name)
        except errors.NotFound:
            pass


def new_name(names: list[str], what: str = "snap") -> str:
    name = f"test/{what}-{secrets.token_hex(4)}:1"
    names.append(name)
    return name


needs_python = pytest.mark.skipif(not have_image("python:3.11"),
                                  reason="python:3.11 not built (run `make images`)")


@pytest.fixture
def tmp_node_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-"))
    d.chmod(0o711)  # runc resolves the rootfs as the sandbox's unprivileged host uid
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def vm_template_node() -> Iterator[Settings]:
    """A test node whose microVM template cache holds this session's one template
    (tests/helpers/vm_template.py: python:3.11, 256 MiB); built on first use."""
    from tests.helpers.vm_template import TEMPLATE_IMAGE, template_node

    s = Settings()
    if os.geteuid() != 0 or not have_image(TEMPLATE_IMAGE) or not s.vm_kernel.is_file() \
            or not s.vm_jailer.is_file():
        pytest.skip("needs root, python:3.11, make guest and make native")
    d = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-"))
    d.chmod(0o711)
    try:
        with template_node(node_settings(d)) as settings:
            yield settings
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def desktop_disk():  # noqa: ANN201 - a VmDisk
    """The node's desktop:1 disk (tests/helpers/desktop.py), built on first use."""
    from tests.helpers.desktop import ensure_desktop_disk

    return ensure_desktop_disk()


@pytest.fixture
def edge_settings() -> dict:
    """Settings fields the ``edge`` fixture's edge gets (a test module overrides this)."""
    return {}


@pytest.fixture
async def edge(tmp_node_dir: Path, edge_settings: dict) -> AsyncIterator:
    """A started edge (with the node's job leases, ``edge.leases``); destroys whatever
    sandboxes remain at the end and checks no leak."""
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from rollbox.jobs import SqliteLeaseStore

    settings = node_settings(tmp_node_dir)
    for name, value in edge_settings.items():
        setattr(settings, name, value)
    events = EventLog(tmp_node_dir / "events.db")
    leases = SqliteLeaseStore(settings.data_dir / "leases.db")
    e = Edge(settings, events, leases=leases)
    await e.start()
    created: list[str] = []
    orig_create = e.create

    async def tracking_create(spec, owner="test", **kw):  # noqa: ANN001, ANN003, ANN202
        info = await orig_create(spec, owner, **kw)
        created.append(info.id)
        return info

    e.create = tracking_create  # type: ignore[method-assign]
    try:
        yield e
    finally:
        await e.close(destroy=True)
        leases.close()
        events.close()
        leaks = {sid: e.leftovers(sid) for sid in created}
        leaks = {k: v for k, v in leaks.items() if v}
        shutil.rmtree(settings.run_dir, ignore_errors=True)
        assert not leaks, f"sandbox resources leaked: {leaks}"


@pytest.fixture
async def api_server(edge, api_edge, tmp_path: Path) -> AsyncIterator:  # noqa: ANN001
    """(url, KeyStore) of the real api (uvicorn on this loop) over ``edge`` (``api_edge``:
    maybe over HTTP), with its job leases; make keys with ``keys.create(project)``."""
    from rollbox.api import BackgroundServer
    from rollbox.iam import KeyStore

    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys, leases=edge.leases)
    try:
        async with BackgroundServer(app) as srv:
            yield srv.url, keys
    finally:
        keys.close()


@pytest.fixture
def chromium() -> Iterator:
    """A selenium WebDriver on real headless chromium (tests.helpers.chromium), quit at the
    end; the test is skipped where chromium, its driver or selenium is not installed."""
    from tests.helpers import chromium as browser

    why = browser.missing()
    if why is not None:
        pytest.skip(why)
    with browser.chromium() as driver:
        yield driver


@pytest.fixture(scope="session")
def postgres() -> Iterator:
    """One real PostgreSQL server for the session (``rollbox.cluster.postgres.PostgresServer``,
    unix socket only, in a fresh dir), started on first use and stopped, its data removed,
    at the end: ``postgres.dsn``. Tests take a clean database from ``pg_dsn``."""
    from rollbox.cluster.postgres import PostgresServer

    root = Path(tempfile.mkdtemp(prefix=f"rollbox-pg-{TEST_RUN}-"))
    root.chmod(0o755)  # the postgres user walks into it
    srv = PostgresServer(root / "data", port=None, socket_dir=root / "sock")
    try:
        srv.start()
        yield srv
    finally:
        srv.destroy()
        shutil.rmtree(root, ignore_errors=True)


async def clean_pg(postgres) -> str:  # noqa: ANN001
    """The server's DSN with the IAM tables emptied (made if missing) and no job leases."""
    from rollbox.iam.postgres import create_pool

    pool = await create_pool(postgres.dsn)
    try:
        await pool.execute("TRUNCATE api_keys, ledger, projects")
        await pool.execute("DROP TABLE IF EXISTS job_leases")  # rollbox.jobs.postgres makes it
    finally:
        await pool.close()
    return str(postgres.dsn)


@pytest.fixture
async def pg_dsn(postgres) -> str:  # noqa: ANN001
    """The session server's DSN with the IAM tables emptied."""
    return await clean_pg(postgres)


@pytest.fixture(params=["sqlite", "postgres"])
async def iam_stores(request, tmp_path: Path) -> AsyncIterator:  # noqa: ANN001
    """(IamStore, QuotaLedger) of each backend: SQLite in a tmp file, PostgreSQL on the
    session's server; the same tests run against both."""
    if request.param == "sqlite":
        from rollbox.iam import SQLiteIam, SQLiteLedger

        iam = SQLiteIam(tmp_path / "keys.db")
        ledger = SQLiteLedger(tmp_path / "keys.db")
        try:
            yield iam, ledger
        finally:
            ledger.close()
            iam.close()
        return
    from rollbox.iam.postgres import PostgresIam, PostgresLedger

    dsn = await clean_pg(request.getfixturevalue("postgres"))
    iam = await PostgresIam.open(dsn)
    try:
        ledger = await PostgresLedger.open(dsn)
        try:
            yield iam, ledger
        finally:
            await ledger.close()
    finally:
        await iam.close()


# The cluster token of the test edges served over HTTP (edge.service).
CLUSTER_TOKEN = secrets.token_urlsafe(24)
# Runs a test that takes ``edge_transport`` (through ``api_edge`` or ``api_server``) with the
# api over the edge itself and over a RemoteEdge to it served over HTTP (the cluster's path).
BOTH_TRANSPORTS = pytest.mark.parametrize("edge_transport", ["local", "remote"], indirect=True)


@contextlib.asynccontextmanager
async def served_edge(edge, token: str = CLUSTER_TOKEN, **kw: float) -> AsyncIterator:  # noqa: ANN001
    """A RemoteEdge to ``edge`` served over HTTP on loopback (``edge.service``); ``kw``:
    the RemoteEdge's timeouts. The server and the client stop at the end."""
    from rollbox.edge.remote import RemoteEdge
    from rollbox.edge.service import serve_edge

    async with serve_edge(edge, "127.0.0.1", 0, token) as srv:
        remote = RemoteEdge(edge.node_id, srv.url, token, **kw)
        try:
            yield remote
        finally:
            await remote.close()


@pytest.fixture(params=["local"])
def edge_transport(request: pytest.FixtureRequest) -> str:
    """How the api reaches the test edge: "local" (in-process) unless BOTH_TRANSPORTS."""
    return str(request.param)


@pytest.fixture
async def api_edge(edge, edge_transport: str) -> AsyncIterator:  # noqa: ANN001
    """The EdgeAPI the test's api is given: ``edge`` itself, or a RemoteEdge to it."""
    if edge_transport == "local":
        yield edge
        return
    async with served_edge(edge) as remote:
        yield remote


def api_app(face, edge, keys, **kw):  # noqa: ANN001, ANN003, ANN201 - a FastAPI app
    """The api over ``face`` (``api_edge``: ``edge`` or a RemoteEdge to it). The audit trail
    is the edge's either way (``EdgeAPI.events``), as on a cluster node."""
    from rollbox.api import create_app
    from rollbox.watcher import placement_over

    return create_app(placement_over([face]), keys, **kw)


class NodeRestarts:
    """One test node's edges started one after another (restart tests), on the same settings
    and event log: ``start()`` makes the next edge, ``stop()`` closes the current one the way
    a crash leaves it (its sandboxes keep running). Each edge opens the node's job leases anew
    (``edge.leases``, the file a restarted server reopens). At the end the current edge, or a
    new one that re-adopts what a stopped one left, destroys every sandbox."""

    def __init__(self, tmp: Path) -> None:
        from rollbox.events.store import EventLog

        self.settings = node_settings(tmp)
        self.events = EventLog(tmp / "events.db")
        self.edge = None

    async def start(self):  # noqa: ANN201 - an Edge
        from rollbox.edge.edge import Edge
        from rollbox.jobs import SqliteLeaseStore

        self.edge = Edge(self.settings, self.events,
                         leases=SqliteLeaseStore(self.settings.data_dir / "leases.db"))
        await self.edge.start()
        return self.edge

    async def stop(self) -> None:
        edge, self.edge = self.edge, None
        assert edge is not None
        try:
            await edge.close(destroy=False)
        finally:
            _close_leases(edge)

    async def close(self) -> None:
        try:
            if self.edge is None:
                await self.start()
            try:
                await self.edge.close(destroy=True)
            finally:
                _close_leases(self.edge)
        finally:
            self.events.close()


def _close_leases(edge) -> None:  # noqa: ANN001 - an Edge
    """The lease store the edge was given (a test may set ``restarts.edge`` to one without)."""
    if edge.leases is not None:
        edge.leases.close()


@pytest.fixture
async def restarts(tmp_node_dir: Path) -> AsyncIterator[NodeRestarts]:
    r = NodeRestarts(tmp_node_dir)
    try:
        yield r
    finally:
        await r.close()


RUNS_DIR = Path("/run/rollbox-test-runs")  # <run> -> pid of the process that owns it
# A run parent with no owner record (left by a process that never made one) is swept once it
# is this old. A run with a record is swept only when its owner process is gone, however long
# it has been running (a microVM browser episode takes longer than this).
STALE_UNOWNED_S = 600.0


def register_run_owner() -> None:
    """Record this process as the owner of this run's sandboxes (pytest, or a script that made
    a test node with :func:`node_settings`): another run's sweep leaves them alone while this
    process lives. Root only (only root has sandboxes to sweep). The record is the bare pid,
    the form every run's sweep reads: a reused pid can only keep a dead run unswept longer."""
    if os.geteuid() != 0:
        return
    path = RUNS_DIR / TEST_RUN
    with contextlib.suppress(OSError):
        if path.read_text() == str(os.getpid()):
            return
    RUNS_DIR.mkdir(exist_ok=True)
    path.write_text(str(os.getpid()))


# A test run's clusters (cluster.local.up): <run>-<port base> -> the cluster dir. A dead run's
# are taken down by the sweep (replicas, edges and their sandboxes, Ray, PostgreSQL).
CLUSTERS_DIR = Path("/run/rollbox-test-clusters")


def register_run_cluster(s: Settings) -> None:
    """Record a cluster this run is about to start (settings ``s``: its dir and port base),
    so that a sweep takes it down if this run is killed."""
    if os.geteuid() != 0:
        return
    CLUSTERS_DIR.mkdir(exist_ok=True)
    (CLUSTERS_DIR / f"{TEST_RUN}-{s.cluster_port_base}").write_text(str(s.cluster_dir))


def forget_run_cluster(s: Settings) -> None:
    (CLUSTERS_DIR / f"{TEST_RUN}-{s.cluster_port_base}").unlink(missing_ok=True)


def run_clusters(run: str) -> list[Settings]:
    """The clusters ``run`` recorded (settings with their dir and port base)."""
    out = []
    for f in sorted(CLUSTERS_DIR.glob(f"{run}-*")) if CLUSTERS_DIR.exists() else []:
        try:
            s = Settings()
            s.cluster_dir = Path(f.read_text().strip())
            s.cluster_port_base = int(f.name.split("-", 1)[1])
        except (OSError, ValueError):
            continue
        out.append(s)
    return out


def sweep_run_clusters(run: str) -> None:
    """Take down the clusters a dead run left (``cluster.local.down``: replicas, edges with
    their sandboxes, every Ray process of the range, PostgreSQL), then forget them."""
    from rollbox.cluster import local, ray_nodes

    for s in run_clusters(run):
        try:
            local.down(s)
        except Exception:  # noqa: BLE001 - its Ray processes go below either way
            pass
        ports = ray_nodes.ClusterPorts(s.cluster_port_base)
        ray_nodes.stop_all(ports)
        local.stop_postgres(s.cluster_dir / "pg")
        shutil.rmtree(f"/run/rollbox-cluster-{ports.base}", ignore_errors=True)
        (CLUSTERS_DIR / f"{run}-{s.cluster_port_base}").unlink(missing_ok=True)


def run_owner_alive(record: str) -> bool:
    """Whether the owner a run record names still runs; a garbled record counts as dead."""
    pid = record.strip()
    return pid.isdigit() and int(pid) > 0 and os.path.exists(f"/proc/{int(pid)}")


# A test sandbox's id is "<node id>-<12 hex>": a test edge's node id "t<run><6 hex>"
# (node_settings), a test cluster's node "t<run>c<i>", "t<run>xc0" or "t<run>xb<k>"; its mounts
# sit under ".../sandboxes/<id>" or ".../roots/<id>", wherever the test put its dirs.
TEST_SANDBOX_MOUNT = re.compile(
    r"/(?:roots|sandboxes)/t([0-9a-f]{4})(?:[0-9a-f]{6}|x?[cb][0-9]+)-[0-9a-f]{12}(/|$)")
# A test cluster node's run dir (cluster.local.node_settings: /run/rollbox-cluster-<base>/<id>).
TEST_CLUSTER_RUN_DIR = re.compile(r"^/run/rollbox-cluster-[0-9]+/t([0-9a-f]{4})x?[cb][0-9]+(/|$)")


def run_mounts(run: str) -> list[str]:
    """Mount points of a test run: below its temp dirs, one of its sandboxes' dirs or one of
    its cluster nodes' run dirs."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            m = TEST_SANDBOX_MOUNT.search(mp) or TEST_CLUSTER_RUN_DIR.match(mp)
            if f"/rollbox-test-{run}-" in mp or (m and m.group(1) == run):
                out.append(mp)
    return out


RUN_NAME = re.compile(r"rollbox-(?:test-|t)([0-9a-f]{4})")  # cgroup parent, dir, netns, node id
# A run's cgroup parents: its edges' (``rollbox-test-<run>-<node>``), its own, and its clusters'
# nodes' (``rollbox-<node id>``): the session cluster's ``t<run>c<index>`` (tests/cluster), the
# burst drill's own node ``t<run>xc0`` and burst nodes ``t<run>xb<slot>``
# (tests/integration/test_burst_ray.py).
RUN_CGROUP = re.compile(
    r"rollbox-(?:test-([0-9a-f]{4})(?:-[A-Za-z0-9_.-]+)?|t([0-9a-f]{4})x?[cb][0-9]+)")


def cgroup_run(name: str) -> str | None:
    """The test run a cgroup parent named ``name`` belongs to (None: no test run's)."""
    m = RUN_CGROUP.fullmatch(name)
    return None if m is None else m.group(1) or m.group(2)


def run_cgroup_parents(run: str) -> list[str]:
    """The cgroup parents of ``run`` in any hierarchy."""
    names = set()
    for h in cgroups.hierarchies():
        for p in h.glob("rollbox-t*"):
            if p.is_dir() and cgroup_run(p.name) == run:
                names.add(p.name)
    return sorted(names)


def _note(found: dict[str, float], run: str, path: str | Path) -> None:
    """``run`` has a resource at ``path``: remember its newest change time (0: unknown)."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = 0.0
    found[run] = max(found.get(run, 0.0), mtime)


def run_resources() -> dict[str, float]:
    """Every test run something of which is on this host, by each kind of resource a run
    makes (a killed run leaves any subset of them): cgroup parents, sandbox mounts, network
    namespaces (sandboxes' and tests' own, e.g. ``rollbox-t<run>vn<hex>``), QEMU processes (by
    their cgroup), loop devices and temp dirs (disk pools, disk files, jail dirs). run -> the
    newest change time among them (the age of a run that has no owner record)."""
    found: dict[str, float] = {}
    for h in cgroups.hierarchies():
        for p in h.glob("rollbox-t*"):
            if p.is_dir() and (run := cgroup_run(p.name)) is not None:
                _note(found, run, p)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if m := TEST_SANDBOX_MOUNT.search(mp) or TEST_CLUSTER_RUN_DIR.match(mp):
                _note(found, m.group(1), mp)
    for name in netns.list_rollbox():
        if m := RUN_NAME.match(name):
            _note(found, m.group(1), netns.netns_path(name))
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and "qemu" in Path(f"/proc/{pid}/comm").read_text():
                for m in RUN_NAME.finditer(Path(f"/proc/{pid}/cgroup").read_text()):
                    _note(found, m.group(1), f"/proc/{pid}")
        except OSError:
            continue
    for block in Path("/sys/block").glob("loop*"):
        try:
            backing = (block / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if m := re.search(r"/rollbox-test-([0-9a-f]{4})-", backing):
            _note(found, m.group(1), backing)
    for d in Path(tempfile.gettempdir()).glob("rollbox-test-*-*"):
        if m := RUN_NAME.match(d.name):
            _note(found, m.group(1), d)
    return found


def sweep_dead_runs() -> list[str]:
    """Remove what test runs killed mid-way (timeout, Ctrl-C twice) left on this host: their
    clusters (:func:`register_run_cluster`), sandboxes' processes, cgroups, network namespaces
    and mounts. A run is dead when its pytest
    process (pytest or a script's, see :func:`register_run_owner`) is gone; a run parent with no
    owner record counts as dead once it is STALE_UNOWNED_S old.
    Returns the runs swept."""
    import time

    from rollbox.isolation import syscalls

    owners: dict[str, str] = {}
    if RUNS_DIR.exists():
        for f in RUNS_DIR.iterdir():
            try:
                owners[f.name] = f.read_text()
            except OSError:
                owners[f.name] = ""
    resources = run_resources()
    runs: set[str] = set(owners) | set(resources)
    if CLUSTERS_DIR.exists():  # a run with a cluster record and no owner record is dead
        runs |= {f.name.split("-", 1)[0] for f in CLUSTERS_DIR.iterdir()}
    dead = []
    for run in sorted(runs):
        if run == TEST_RUN:
            continue
        owner = owners.get(run)
        if owner is None:
            if not run_clusters(run) and time.time() - resources.get(run, 0.0) < STALE_UNOWNED_S:
                continue
        elif run_owner_alive(owner):
            continue
        dead.append(run)
        sweep_run_clusters(run)  # first: its edges destroy their sandboxes, Ray stops
        for parent in run_cgroup_parents(run):
            v2_parent = cgroups.v2_root() / parent
            if v2_parent.exists():
                cgroups.kill(v2_parent)
                asyncio.run(cgroups.wait_empty(v2_parent, 5.0))
            for path in cgroups.leftover(parent):
                try:
                    cgroups.remove_tree(path)
                except OSError:
                    pass
            cgroups.remove_parent_if_empty(parent)
        for name in netns.list_rollbox():
            if name.startswith(f"rollbox-t{run}"):
                try:
                    netns.delete(name)
                except OSError:
                    pass  # e.g. hidden under a later bind of /run/netns (see netns.py)
        for mp in sorted(run_mounts(run), key=len, reverse=True):
            try:
                syscalls.umount(mp, syscalls.MNT_DETACH)
            except OSError:
                pass
        for d in Path(tempfile.gettempdir()).glob(f"rollbox-test-{run}-*"):
            shutil.rmtree(d, ignore_errors=True)
        for d in Path("/run").glob(f"rollbox-cluster-*/t{run}*"):  # its nodes' run dirs
            if TEST_CLUSTER_RUN_DIR.match(str(d)) and not any(
                    mp == str(d) or mp.startswith(f"{d}/") for mp in run_mounts(run)):
                shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(OSError):
                    d.parent.rmdir()  # only if empty: another run's cluster may share it
        (RUNS_DIR / run).unlink(missing_ok=True)
    if dead:  # the node's shared layer mounts those sandboxes pinned (used ones stay)
        from rollbox.images.mounts import LayerMounts
        from rollbox.images.store import ImageStore

        LayerMounts(ImageStore(Settings().images_dir)).unmount_all()
    return dead


@pytest.fixture(scope="session", autouse=True)
def no_leaks_after_suite() -> Iterator[None]:
    if os.geteuid() == 0:
        sweep_dead_runs()
        register_run_owner()
    yield
    (RUNS_DIR / TEST_RUN).unlink(missing_ok=True)
    parents = run_cgroup_parents(TEST_RUN) if os.geteuid() == 0 else []
    left_cg = [p for parent in parents for p in cgroups.leftover(parent)]
    left_ns = [n for n in netns.list_rollbox() if n.startswith(f"rollbox-{TEST_NODE}")]
    mounts = run_mounts(TEST_RUN)
    if os.geteuid() == 0 and not left_cg:
        for parent in parents:
            cgroups.remove_parent_if_empty(parent)
    loops = run_loop_devices(TEST_RUN)
    qemus = run_qemu_processes()
    assert not (left_cg or left_ns or mounts or loops or qemus), (
        f"leaked after the test suite: cgroups={left_cg} netns={left_ns} mounts={mounts} "
        f"loop devices={loops} QEMU processes={qemus}")


def run_qemu_processes() -> list[int]:
    """QEMU processes of this run's microVM sandboxes left behind: a uid of the run's bands
    (from BASE_UID up: each edge takes a free one) and a cgroup under one of the run's
    parents."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            if uid < BASE_UID or "qemu" not in Path(f"/proc/{entry}/comm").read_text():
                continue
            if re.search(rf"/{TEST_CGROUP}(-[A-Za-z0-9_.]+)?/",
                         Path(f"/proc/{entry}/cgroup").read_text()):
                found.append(int(entry))
        except OSError:
            continue
    return found


def run_loop_devices(run: str, settle_s: float = 10.0) -> list[str]:
    """Loop devices still attached to a file below the run's temp dirs (disk pools). An
    unmounted pool's device detaches itself (autoclear) once no mount namespace holds a copy
    of its mount: wait for that. A copy held in another process's mount namespace (one that
    unshared its namespace while the pool was mounted, e.g. `ip netns exec` of another run:
    this host's mounts are private, so our unmount does not reach it) is not a leak of this
    run; the device goes when that process ends."""
    import time

    deadline = time.monotonic() + settle_s
    while True:
        found = {}
        for block in Path("/sys/block").glob("loop*"):
            try:
                backing = (block / "loop" / "backing_file").read_text()
            except OSError:
                continue
            if f"/rollbox-test-{run}-" in backing:
                found[f"/dev/{block.name}"] = backing.strip()
        held = held_elsewhere(found)
        unheld = {dev: b for dev, b in found.items() if dev not in held}
        if not unheld or time.monotonic() > deadline:
            return [f"{dev} ({backing})" for dev, backing in unheld.items()]
        time.sleep(0.1)


def held_elsewhere(devices: dict[str, str]) -> set[str]:
    """Which of ``devices`` are the source of a mount in another mount namespace."""
    held: set[str] = set()
    seen = {os.readlink("/proc/self/ns/mnt")}  # ours: its mounts are run_mounts' business
    for proc in Path("/proc").iterdir() if devices else ():
        try:
            ns = os.readlink(proc / "ns" / "mnt") if proc.name.isdigit() else None
            if ns is None or ns in seen:
                continue
            seen.add(ns)
            mounts = (proc / "mountinfo").read_text()
        except OSError:
            continue
        held |= {dev for dev in devices if f" {dev} " in mounts}
    return held
