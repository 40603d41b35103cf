"""Edge implementation for one node: the core (admission, journal, sessions, TTL, files, grading,
snapshots) over one backend per kind, spoken to only through ``rollbox.backends.base`` (see
``edge/__init__``)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import hashlib
import json
import itertools
import logging
import os
import resource
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollbox.agent.channel import SpawnError
from rollbox.agent.protocol import RETAIN_LIMIT, ExecRequest, shell_argv
from rollbox.backends.base import (
    Backend, CaptureOptions, Display, PortStream, ResolvedSpec, SandboxHandle,
)
from rollbox.backends import platform_work
from rollbox.backends.registry import make_backends
from rollbox.config import Settings
from rollbox.edge.admission import (
    Admission, HostMemory, Limits, ProjectQuotas, Share, Ticket, host_memory_mib, node_cpus,
    node_memory_mib, sandboxes_memory_max_mib,
)
from rollbox.edge import takeover
from rollbox.edge.fence import Fence
from rollbox.edge.interface import ExecOutput, PlatformProcess
from rollbox.edge.journal import Journal
from rollbox.edge.leases import JobLeases, LeaseReaper
from rollbox.edge.pool import (
    POOL_OWNER, POOL_QUIET_S, ROOM_REASONS, Pooled, PoolKey, WarmPool, check_capacity, key_of,
)
from rollbox.edge.sessions import ExecSession
from rollbox.edge.storage import LayerStorage, project_image_name
from rollbox.errors import (
    BadRequest, CapacityExceeded, DiskFull, ExecIndeterminate, IdempotencyConflict, InfraError, NotFound,
    NotSupported, PayloadTooLarge, QuotaExceeded, RollboxError, SandboxDead, SandboxPaused,
    error_from_payload, without_paths,
)
from rollbox.events.store import EventLog
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.lazy.paths import FETCH_BUCKETS, FETCH_KINDS
from rollbox.images.store import Image, ImageStore, sudo_uids
from rollbox.images.vmdisk import find_vm_disk
from rollbox.isolation import cgroups, hostclaims
from rollbox.isolation.userns import UidSlots
from rollbox.metrics import counter, gauge, histogram, process_metrics
from rollbox.models import (
    FORK_OF_LABEL, MAX_FORK_CHILDREN, NODE_LOST, PTY_MAX_SIZE, Event, ExecInfo, ExecResult,
    ExecSpec, FileStat, ForkResult, ForkSpec, GradeResult, GradeSpec,
    ImageInfo, LayerUsage, NetAudit, NetworkPolicy, NodeReport, NodeSandbox, Quota, Resources,
    SandboxInfo,
    SandboxSpec, SandboxUsage, SnapshotResult, SnapshotSpec, UsageSample,
    ComputerAction, ComputerActionResult, DisplayInfo,
)

if TYPE_CHECKING:
    from rollbox.images.lazy.loader import LazyLoader

log = logging.getLogger(__name__)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Grace past a command's own deadline before the edge kills it from the host side.
HOST_KILL_GRACE_S = 2.0
# A guest's agent (microVM) is the guest root's to stop: the host can not kill its commands.
# Bounds on waiting for it: to start a command, and to end one past its deadline + the grace.
GUEST_START_TIMEOUT_S = 30.0
GUEST_END_GRACE_S = 15.0
PTY_TERM = "xterm-256color"  # TERM of a pty command whose env names none
POOLED_MEMORY_S = 1.0  # the warm pool's live memory (report) is read at most this often
PAUSED_FS_FDS = 1  # edge descriptors of a sandbox paused filesystem-only (measured: 0-1)
AUDIT_EVERY_S = 5  # net.denied events: at most one per sandbox per this many seconds


@dataclass
class LiveSandbox:
    info: SandboxInfo
    box: SandboxHandle  # of the backend of info.backend
    backend: Backend
    sessions: dict[str, ExecSession] = field(default_factory=dict)
    users: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    watcher: asyncio.Task | None = None
    # pause/resume: one freeze change at a time; host-side kills that came due while paused.
    freeze_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one wake at a time
    deferred_kills: list[ExecSession] = field(default_factory=list)
    ticket: Ticket | None = None  # what it holds of the node's admission budgets
    oom_kills_claimed: int = 0  # OOM kills of its memory cgroup already reported on a command
    first_exec_seen: bool = False  # its first command's start is in the metrics
    usage: collections.deque[UsageSample] = field(default_factory=collections.deque)
    # exec idempotency keys -> exec id (recorded), and starts with a key still under way
    keys: dict[str, str] = field(default_factory=dict)
    key_starts: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    # carries a rollbox.* label (NodeSandbox.platform), found once: not per probe
    platform: bool = False
    # connections of the port proxy (port_open) still open: closed when it goes
    ports: set[PortStream] = field(default_factory=set)


def raise_nofile_limit(target: int = 1 << 20) -> None:
    """Each sandbox holds a few fds in the edge (Backend.edge_fds; admission counts them);
    1,000s of them need more than the usual 1,024. Without CAP_SYS_RESOURCE only up to the
    hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (target, 1 << 16, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
            return
        except (ValueError, OSError):
            continue


class Edge:
    def __init__(self, settings: Settings, events: EventLog, store: ImageStore | None = None,
                 limits: Limits | None = None, leases: JobLeases | None = None,
                 quotas: ProjectQuotas | None = None) -> None:
        """``leases``: the job leases the api writes (``rollbox.jobs``), whose dead jobs'
        sandboxes this edge deletes (None: no jobs on this node); ``quotas``: the project
        quotas admission enforces (``iam.quotas``; None: none). The caller owns both."""
        self.settings = settings
        self.node_id = settings.node_id
        self.metrics = process_metrics()
        self.metrics.configure(settings.metrics_projects)
        self._metrics_handle: int | None = None
        self.event_log = events
        self.store = store or ImageStore(settings.images_dir)
        # This node's share of the host (several edges on one host: Settings.for_node).
        self._host_mem_mib = node_memory_mib(settings)
        # The fd table first: admission holds no more sandboxes than it has room for.
        raise_nofile_limit()
        self.limits = limits or Limits.from_settings(
            settings, self._host_mem_mib, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.quotas = quotas
        self.admission = Admission(
            self.limits, self._host_mem_mib, node_cpus(settings),
            HostMemory(settings.cgroup_parent,
                       node_mib=self._host_mem_mib if self._host_mem_mib < host_memory_mib()
                       else None), self.node_id)
        # A pool configuration above the node's capacity: BadRequest before anything is made.
        check_capacity(settings, self.limits.max_sandboxes, self.limits.reserved_share,
                       self.admission.budgets()["memory_mib"],
                       max(0, self._host_mem_mib - self.limits.reserve_mib))
        self._last_request = 0.0  # monotonic: the last create or exec start (pool refill)
        # (when, which pooled sandboxes, their live MiB): report()'s reading of the pool's use
        self._pooled_mem: tuple[float, frozenset[str], int] | None = None
        self.pool = WarmPool(settings, self._pool_make, self._pool_destroy, self._pool_busy)
        self.layer_mounts = LayerMounts(self.store, settings)
        self.storage = LayerStorage(self.store, settings, self._layer_quota_mib)
        self.slots = UidSlots(settings.uid_base, settings.uid_slots)
        # One backend per kind (rollbox.backends.base); SandboxSpec.backend picks one. The
        # edge core speaks to them only through that contract (edge.backends builds them).
        self.backends: dict[str, Backend] = make_backends(settings, self.layer_mounts,
                                                          self.slots, self.store)
        # The container backend, for the platform's tools and tests that work on it directly.
        self.backend = self.backends["container"]
        # Descriptors the backends hold for no sandbox (spare QEMUs) take room from sandboxes.
        self.admission.node_fds = self._node_fds
        self.journal = Journal(settings.data_dir / f"edge-{self.node_id}.db")
        # Armed by the watcher's probes (report(fence_s=)): see rollbox.edge.fence.
        self.fence = Fence(settings.data_dir / f"edge-{self.node_id}.probed")
        self.draining = False  # drain(): no new create (a burst node being released)
        # Random per edge process: the watcher tells a restart from a quick answer by it.
        self.incarnation = secrets.token_hex(8)
        self.started_at = time.time()
        self._starting = 0  # creates admitted and not ended yet (report().starting)
        self._admitting = 0  # creates and forks in admission (maybe evicting): the refill waits
        self._fenced_gap: float | None = None  # at start: unprobed past the fence (seconds)
        self._layer_cache: tuple[tuple[float, float], list[str]] | None = None
        self.live: dict[str, LiveSandbox] = {}
        self._create_sem = asyncio.Semaphore(self.limits.max_parallel_creates)
        self._create_sem_size = self.limits.max_parallel_creates
        # One fork at a time takes its permits (one per child, at most the whole cap): two
        # forks each holding part of the cap would otherwise wait for each other.
        self._fork_permits = asyncio.Lock()
        self._ttl_task: asyncio.Task | None = None
        self.leases = leases
        self._reaper = LeaseReaper(
            leases, lambda: [x.info for k, x in self.live.items() if k not in self._deleting],
            self._destroy_soon) if leases is not None else None
        self._reaper_task: asyncio.Task | None = None
        self._deleting: dict[str, asyncio.Task] = {}
        self._pausing: set[asyncio.Task] = set()  # TTL-end pauses (on_expiry "pause")
        self._snapshotting: set[str] = set()
        self._lazy: LazyLoader | None = None  # while the node has lazy layers
        # create idempotency keys: (owner, key) -> the live sandbox made under it (rebuilt
        # from the journaled infos on restart), its spec as asked (None after a restart), and
        # keyed creates still under way (a retry joins one instead of making a second box).
        self._create_keys: dict[tuple[str, str], str] = {}
        self._create_specs: dict[tuple[str, str], dict[str, Any]] = {}
        self._create_starts: dict[tuple[str, str], asyncio.Future[SandboxInfo]] = {}
        # fork idempotency keys, the same way: (owner, key) -> the live children made under
        # it (in the order made; rebuilt from their journaled fork_key), the fork as asked
        # (source, spec, frozen_s, duration_s; None after a restart), keyed forks under way.
        self._fork_keys: dict[tuple[str, str], list[str]] = {}
        self._fork_specs: dict[tuple[str, str], tuple[str, dict[str, Any], float, float]] = {}
        self._fork_starts: dict[tuple[str, str], asyncio.Future[ForkResult]] = {}
        self.host_claim: hostclaims.HostClaim | None = None  # held from start to close

    # ---- lifecycle of the edge itself -------------------------------------------------
    async def start(self) -> None:
        """Claim the node's host resources (HostResourceConflict: another live edge of this
        host holds one; nothing was touched: no backend mounts or makes anything of the host
        before its start), then start the backends and re-adopt or clean what an earlier edge
        of this node left (only this node's: its sandbox ids, run dir, cgroup parent). A start
        that fails releases what it acquired, in reverse (tasks, backends and their node
        resources such as the run dir's tmpfs, the claim) and raises; ``close()`` after it is
        a no-op but for the journal."""
        self.host_claim = await asyncio.to_thread(hostclaims.claim, self.settings)
        self._metrics_handle = self.metrics.add_collector(self._collect_metrics)
        self.slots.base = self.settings.uid_base  # host_auto: the band the claim chose
        try:
            await self._start()
        except BaseException:
            try:
                await self._stop_running()
            except Exception:  # noqa: BLE001 - the start's own error is the one to raise
                log.exception("releasing what a failed start of node %s acquired",
                              self.node_id)
            finally:
                self.host_claim.release()
                self.host_claim = None
            raise

    async def _start(self) -> None:
        # The gap since the last probe is read first: a backend's slow start must not make a
        # quick restart look like a long absence.
        self._fenced_gap = self.fence.load()
        for kind, backend in self.backends.items():
            try:
                await backend.start()
            except RollboxError as exc:  # the other kinds' sandboxes still come back
                log.error("backend %s did not start: %s", kind, exc)
        # One parent memory cgroup for all sandboxes, limited to RAM minus the reserve: an
        # overload OOM-kills inside a sandbox, never a platform process.
        try:
            cgroups.set_memory_limit(self.settings.cgroup_parent, sandboxes_memory_max_mib(
                self.settings, self._host_mem_mib) << 20)
        except InfraError as exc:  # e.g. lowered below what running sandboxes use now
            log.error("%s; the sandboxes' memory cgroup keeps its old limit", exc)
        await self._recover()
        self._ttl_task = asyncio.create_task(self._ttl_loop())
        if self._reaper is not None:
            self._reaper_task = asyncio.create_task(self._reaper.run())
        await self._start_lazy_watch()
        self.pool.start()

    async def _start_lazy_watch(self) -> None:
        """If the node has lazy layers: start (or adopt) the lazy-loading daemon and its watch
        task, which restarts a crashed daemon (the daemon itself outlives the edge)."""
        from rollbox.images.lazy.paths import LazyPaths

        if not any(LazyPaths(self.store.root).layers.glob("sha256-*.json")):
            return
        from rollbox.images.lazy.loader import loader_for

        self._lazy = loader_for(self.store, self.settings)
        try:
            await self._lazy.start()
        except RollboxError as exc:  # sandboxes on lazy layers report it; the edge still runs
            log.error("lazy-loading daemon did not start: %s", exc)

    async def _recover(self) -> None:
        """Re-adopt journaled sandboxes that still run; report the rest dead; clean orphans.
        After a gap without probes longer than the fence (rollbox.edge.fence) nothing is
        re-adopted: the watcher declared them lost, so they are cleaned up as node_lost."""
        fenced = self._fenced_gap
        if fenced is not None:
            log.warning("no watcher probed node %s for %.1f s (fence %.1f s): its sandboxes "
                        "were declared lost and are not re-adopted", self.node_id, fenced,
                        self.fence.fence_s)
        journaled = set()
        ending: list[asyncio.Task] = []
        host_ids = {kind: b.host_sandbox_ids(self.settings.sandbox_id_prefix)
                    for kind, b in self.backends.items()}
        for info, state, extra in self.journal.live():
            journaled.add(info.id)
            backend = self.backends.get(info.backend)
            if backend is None:  # a kind this node no longer has: nothing can reach it
                self._mark_dead(info, f"backend {info.backend!r} is not available on this node")
                continue
            if fenced is not None:
                if state is not None or info.id in host_ids[info.backend]:
                    await self._quiet_cleanup(backend, info.id, state)
                self._mark_dead(info, NODE_LOST)
                continue
            box = None
            if info.state in ("running", "paused") and state is not None:
                box = await backend.adopt(info.id, self._spec_of(info, extra), state,
                                          paused=info.state == "paused")
            if box is None:
                if info.state not in ("running", "paused") and (
                        state is not None or info.id in host_ids[info.backend]):
                    await self._quiet_cleanup(backend, info.id, state)
                self._mark_dead(info, "lost while the edge was down")
                continue
            if info.state == "paused" and info.memory_kept:
                try:  # frozen by adopt already; an error: it could not freeze it again
                    await backend.pause(box)
                except InfraError as exc:
                    log.error("sandbox %s: can not freeze it again (%s); it runs", info.id, exc)
                    info.state = "running"
                    self.journal.put(info)
            self._register(info, box, backend, self.admission.adopt(
                _held(info), info.owner, _share_of(info), self._held_fds(info)))
            ending += self._rebuild_sessions(self.live[info.id])
            log.info("re-adopted sandbox %s", info.id)
        if ending:  # exits that happened while no edge was up: settled before we serve
            await asyncio.wait(ending, timeout=5.0)
        for kind, backend in self.backends.items():
            for orphan in host_ids[kind] - journaled - set(self.live):
                log.warning("cleaning orphan sandbox resources %s", orphan)
                await self._quiet_cleanup(backend, orphan, None)
        await asyncio.to_thread(self._drop_unreferenced_machines)

    @staticmethod
    def _spec_of(info: SandboxInfo, extra: dict) -> ResolvedSpec:
        """A journaled sandbox's spec as its backend got it (env: as journaled since)."""
        return ResolvedSpec(
            image=info.image, layers=tuple(info.layers), resources=info.resources,
            env=dict(extra.get("env", {})), hidden_paths=tuple(info.hidden_paths),
            network_rules=tuple(info.network.allow) if info.network is not None else None,
            disk_tier=info.disk_tier, machine_snapshot=extra.get("machine_snapshot"),
            qos=info.qos, disk_image=str(extra.get("disk_image") or ""),
            vm_console=info.vm_console)

    def _rebuild_sessions(self, live: LiveSandbox) -> list[asyncio.Task]:
        """Commands of a re-adopted sandbox, from the journal and the agent: recorded ends as
        recorded; running or uncollected ones re-attached (output replayed from the agent's
        retained last bytes, exit logged once, when it comes); the rest lost (indeterminate:
        never started, or dropped by the agent's retention bound)."""
        sid = live.info.id
        channel = live.box.channel
        agent = channel.agent_sessions
        ending = []
        for rec in self.journal.execs(sid):
            try:
                spec = ExecSpec.model_validate_json(rec.spec)
                result = ExecResult.model_validate_json(rec.result) if rec.result else None
                error = error_from_payload(json.loads(rec.error)) if rec.error else None
            except ValueError as exc:  # a record this version can't read: not worth a node
                log.error("sandbox %s: exec %s record unreadable (%s); dropped", sid,
                          rec.exec_id, exc)
                self.journal.exec_forget(sid, [rec.exec_id])
                continue
            session = ExecSession(rec.exec_id, spec, live.box.guest_reported)
            session.started_at = rec.started_at
            session._t0 -= max(0.0, time.time() - rec.started_at)  # durations span the restart
            session.cgroup_name = rec.cgroup
            live.sessions[rec.exec_id] = session
            if spec.idempotency_key:
                live.keys[spec.idempotency_key] = rec.exec_id
            if rec.exec_id[1:].isdigit():
                live.box.next_session = max(live.box.next_session, int(rec.exec_id[1:]))
            if result is not None or error is not None:
                session.restore(result, error)
                if rec.agent_session in agent:  # crashed between journaling and COLLECT
                    channel.collect(rec.agent_session)
            elif rec.agent_session in agent:
                agent_session = channel.adopt(rec.agent_session, collect=False)
                session.agent_session = agent_session
                asyncio.create_task(self._pump(live, session, agent_session))
                if agent[rec.agent_session].exited and live.info.state != "paused":
                    ending.append(asyncio.create_task(session.done.wait()))  # (frozen: later)
            else:
                err = ExecIndeterminate(
                    f"exec {rec.exec_id} was lost across a server restart: the agent has no "
                    "record of it (never started, or its exit was dropped)", exec_id=rec.exec_id)
                session.fail(err)
                self.journal.exec_done(sid, rec.exec_id, None, json.dumps(err.to_payload()))
                self.event_log.append(sid, "exec.error", rec.exec_id, err.message)
        return ending

    async def _quiet_cleanup(self, backend: Backend, sandbox_id: str,
                             state: dict | None) -> None:
        try:
            await backend.cleanup(sandbox_id, state)
        except RollboxError as exc:
            log.error("clean-up of %s failed: %s", sandbox_id, exc)

    async def close(self, destroy: bool = False) -> None:
        """Stop the edge. Sandboxes keep running (re-adopted next start) unless destroy."""
        if self._metrics_handle is not None:
            self.metrics.remove_collector(self._metrics_handle)
            self._metrics_handle = None
        self._stop_tasks()
        await self.pool.close()  # pooled sandboxes are not journaled: none outlives the edge
        if destroy:
            await asyncio.gather(*(self.delete(sid) for sid in list(self.live)),
                                 return_exceptions=True)
        await self._stop_running()
        self.journal.close()
        if self.host_claim is not None:
            self.host_claim.release()
            self.host_claim = None

    def _stop_tasks(self) -> None:
        for task in (self._ttl_task, self._reaper_task):
            if task is not None:
                task.cancel()
        self._ttl_task = self._reaper_task = None

    async def _stop_running(self) -> None:
        """What start acquired, in reverse: the background tasks, the lazy-loading watch, the
        backends (last started first), the sandboxes' watchers (they keep running), and the
        node resources (shared layer mounts, parent cgroups, the run dir's tmpfs) when no
        sandbox is left here or in the journal. The host claim and journal are the caller's."""
        self._stop_tasks()
        await self.pool.close()
        if self._lazy is not None:
            await self._lazy.stop(daemon=False)  # the watch task only: mounts need the daemon
            self._lazy = None
        for kind, backend in reversed(self.backends.items()):
            try:
                await backend.stop()
            except RollboxError as exc:
                log.error("backend %s did not stop cleanly: %s", kind, exc)
        for live in self.live.values():
            if live.watcher:
                live.watcher.cancel()
            live.backend.detach(live.box)
        if not self.live and not self.journal.live():
            for backend in reversed(self.backends.values()):
                await asyncio.to_thread(backend.release_node_resources)
        self.live.clear()

    # ---- admission ----------------------------------------------------------------------
    async def capacity(self) -> dict[str, object]:
        """Counts, live memory and budgets (``limits``: the most one project's quota may ask,
        with ``layer_mib`` the size of the image store's filesystem; ``backends``: each kind
        this node has, offered or not, with its facts); see edge.admission."""
        cap = self.admission.capacity()
        pooled = self.pool.sandboxes()
        # Counted in sandboxes and requested_*: room a create gets back by evicting them.
        cap["pooled"] = len(pooled)
        cap["pooled_memory_mib"] = self._pooled_memory_mib(pooled)
        cap["pooled_requested_memory_mib"] = sum(p.ticket.resources.memory_mib for p in pooled)
        st = os.statvfs(self.store.root)
        cap["limits"] = {**cap["limits"],  # type: ignore[dict-item]
                         "layer_mib": st.f_blocks * st.f_frsize >> 20}
        cap["backends"] = {k: dataclasses.asdict(b.capacity()) for k, b in self.backends.items()}
        return cap

    async def report(self, max_sandboxes: int = 10000,
                     fence_s: float | None = None) -> NodeReport:
        """One probe of the watcher (EdgeAPI.report): capacity, live sandboxes (at most
        ``max_sandboxes`` listed, without their labels: NodeSandbox), cached layers and
        counts, from memory. ``fence_s`` arms the
        fence (None disarms it); a probe after a gap longer than the fence tears the live
        sandboxes down first (rollbox.edge.fence)."""
        if not 0 <= max_sandboxes <= 1_000_000 or (fence_s is not None and not fence_s > 0):
            raise BadRequest("report: max_sandboxes in [0, 1000000], fence_s > 0 or None")
        gap = self.fence.probed(fence_s)
        if gap is not None:
            self._fence_now(gap)
        adm = self.admission
        listed: list[NodeSandbox] = []
        by_backend: dict[str, int] = {}
        by_project: dict[str, int] = {}
        total = 0
        for sid, live in self.live.items():
            if sid in self._deleting:
                continue
            info = live.info
            total += 1
            by_backend[info.backend] = by_backend.get(info.backend, 0) + 1
            by_project[info.owner] = by_project.get(info.owner, 0) + 1
            if len(listed) < max_sandboxes:
                listed.append(NodeSandbox.model_construct(  # from a validated SandboxInfo
                    id=sid, owner=info.owner, backend=info.backend, state=info.state,
                    # filesystem-paused: it holds disk, no CPU or memory of the node
                    cpus=info.resources.cpus if info.memory_kept else 0.0,
                    memory_mib=info.resources.memory_mib if info.memory_kept else 0,
                    created_at=info.created_at, expires_at=info.expires_at, image=info.image,
                    platform=live.platform, job=info.job))
        fenced = self.fence.expired() is not None
        free = adm.free(evictable=POOL_OWNER)  # pooled sandboxes give their room to a create
        pooled = self.pool.sandboxes()
        pooled_mib = self._pooled_memory_mib(pooled)
        if fenced or self.draining:
            free = {k: 0.0 for k in free}
        return NodeReport(
            node_id=self.node_id, incarnation=self.incarnation, started_at=self.started_at,
            at=time.time(),
            backends=sorted(k for k, b in self.backends.items() if b.capacity().offered),
            free=free, limits=adm.budgets(),
            memory_available_mib=adm.live_memory_free_mib(reclaimable_mib=pooled_mib),
            pooled_memory_mib=pooled_mib, pooled=len(pooled), starting=self._starting,
            sandboxes=listed, sandboxes_total=total, truncated=len(listed) < total,
            layers=self._layer_digests(), by_backend=by_backend, by_project=by_project,
            fence_s=self.fence.fence_s, burst=self.settings.node_burst, draining=self.draining)

    def _pooled_memory_mib(self, pooled: list[Pooled]) -> int:
        """What evicting ``pooled`` gives back to creates: their live use (their cgroups'
        charge, read at most every POOLED_MEMORY_S) and the start-up headroom admission still
        counts as promised to them."""
        now = time.monotonic()
        cached = self._pooled_mem
        ids = frozenset(p.sandbox_id for p in pooled)
        if cached is None or cached[1] != ids or now - cached[0] >= POOLED_MEMORY_S:
            used = sum(p.backend.usage(p.box).memory_bytes or 0 for p in pooled) >> 20
            self._pooled_mem = cached = (now, ids, used)
        return cached[2] + self.admission.promised_mib(p.ticket for p in pooled)

    def _edge_fds(self, info: SandboxInfo) -> int:
        """The edge's descriptors a sandbox like ``info`` holds when it runs (its backend's
        count); paused filesystem-only it holds at most :data:`PAUSED_FS_FDS` (its channel,
        network and process are gone) and is counted so (:meth:`_held_fds`)."""
        return self.backends[info.backend].edge_fds(info.network is not None)

    def _node_fds(self) -> int:
        """The edge's descriptors its backends hold for their own node work (Backend.node_fds:
        a microVM template's spare QEMUs), which admission counts besides the sandboxes'."""
        return sum(b.node_fds() for b in self.backends.values())

    def _held_fds(self, info: SandboxInfo) -> int:
        """What a live sandbox holds of the edge's descriptor budget now (cf. :func:`_held`)."""
        if info.state == "paused" and not info.memory_kept:
            return PAUSED_FS_FDS
        return self._edge_fds(info)

    def drain(self, on: bool = True) -> int:
        """Refuse every new create (CapacityExceeded, reason draining; reports show no room
        and ``draining``) while ``on``; the sandboxes already here run on. What releasing a
        burst node does first (rollbox.cluster.burst). Returns the live sandboxes plus the
        creates under way now (0: nothing can land here any more while draining). Pooled
        sandboxes are destroyed (in the background) and no more are made while draining."""
        self.draining = on
        if on:
            self.pool.evict_all("drain")
        return len(self.live) + self._starting

    def _layer_digests(self) -> list[str]:
        """Digests of the layers in the node's store (whole or lazy), re-listed only when one
        of the two layer directories changed."""
        from rollbox.images.lazy.paths import LazyPaths

        lazy = LazyPaths(self.store.root).layers

        def mtime(p: os.PathLike[str]) -> float:
            try:
                return os.stat(p).st_mtime
            except FileNotFoundError:
                return 0.0

        key = (mtime(self.store.layers_dir), mtime(lazy))
        if self._layer_cache is None or self._layer_cache[0] != key:
            digests = set(self.store.list_layers())
            if key[1]:
                digests.update(p.name[:-len(".json")] for p in lazy.glob("sha256-*.json"))
            self._layer_cache = (key, sorted(digests))
        return self._layer_cache[1]

    def _fence_now(self, gap: float) -> None:
        """No watcher probed this node for ``gap`` s (past the fence): it was declared lost,
        so its live sandboxes go (dead, node_lost), and its pooled ones (none is made while
        fenced: a pool would hold room for creates the node refuses)."""
        self.pool.evict_all("fence")
        doomed = [sid for sid in self.live if sid not in self._deleting]
        if doomed:
            log.warning("node %s: no probe for %.1f s (fence %s s): tearing down its %d "
                        "sandboxes as %s", self.node_id, gap, self.fence.fence_s,
                        len(doomed), NODE_LOST)
        for sid in doomed:
            self._destroy_soon(sid, NODE_LOST, state="dead")

    async def declare_lost(self, sandbox_ids: list[str]) -> list[str]:
        """The watcher declared these sandboxes lost (dead, node_lost) while it could not
        reach this node: the live ones among them are torn down now (their commands fail);
        returns those. Unknown or already ended ids are skipped."""
        if len(sandbox_ids) > 1_000_000:
            raise BadRequest("declare_lost: at most 1000000 ids")
        doomed = [sid for sid in dict.fromkeys(sandbox_ids)
                  if sid in self.live and sid not in self._deleting]
        for sid in doomed:
            log.warning("sandbox %s was declared lost by the watcher: tearing it down", sid)
            self._destroy_soon(sid, NODE_LOST, state="dead")
        tasks = [self._deleting[sid] for sid in doomed if sid in self._deleting]
        if tasks:
            await asyncio.wait([asyncio.shield(t) for t in tasks])
        return doomed

    # ---- sandboxes ----------------------------------------------------------------------
    def _image_for(self, name: str, owner: str) -> Image:
        """Resolve an image for ``owner``: images made by a project's sandbox (snapshots carry
        their project in ``config["owner"]``) exist only for that project; the node's own
        images are everyone's. Another project's image looks absent (NotFound)."""
        try:
            image = self.store.resolve(name)  # NotFound / BadRequest for bad names
        except NotFound:
            image = None
        if image is None or image.config.get("owner") not in (None, owner):
            visible = [i.name for i in self.store.list() if i.config.get("owner") in (None, owner)]
            raise NotFound(f"no image {name!r} (known: {', '.join(visible[:20]) or 'none'})",
                           image=name)
        return image

    def _image_config(self, info: SandboxInfo) -> dict:
        """The config of the image a sandbox was made from ({} if the name is gone since)."""
        try:
            return self.store.resolve(info.image).config
        except RollboxError:
            return {}

    async def create(self, spec: SandboxSpec, owner: str, share: Share = "new",
                     requested: str | None = None) -> SandboxInfo:
        """``share="reserved"``: the platform's own sandboxes that must not starve behind new
        creates (fncall workers; graders go through ``grade``). ``requested``: the api's
        sandbox.requested event, logged after the sandbox's sandbox.created."""
        info = await self._create_or_join(spec, owner, share)
        if requested is not None:
            self.event_log.append(info.id, "sandbox.requested", data=requested)
        return info

    async def _create_or_join(self, spec: SandboxSpec, owner: str,
                              share: Share) -> SandboxInfo:
        if share == "new" and any(k.startswith(PLATFORM_LABEL_PREFIX) for k in spec.labels):
            # They mark the platform's own sandboxes (graders, fncall workers), whose share a
            # restart reads back from them (_share_of): a project's sandbox must not pass as one.
            raise BadRequest(f"labels starting with {PLATFORM_LABEL_PREFIX!r} are the "
                             "platform's", labels=sorted(spec.labels))
        key = spec.idempotency_key
        if key is None:
            return await self._new_sandbox(spec, owner, share)
        made = await self._keyed_create(spec, owner, key)
        if made is not None:
            return made
        info = await _joinable(self._create_starts, (owner, key),
                               self._new_sandbox(spec, owner, share))
        self._create_specs[(owner, key)] = spec.model_dump(exclude={"idempotency_key"})
        return info

    async def _keyed_create(self, spec: SandboxSpec, owner: str,
                            key: str) -> SandboxInfo | None:
        """The live sandbox ``owner`` created under ``key`` (None: none, or its create failed),
        after checking it was asked for with the same spec; waits for one under way."""
        sandbox_id = self._create_keys.get((owner, key))
        if sandbox_id is None and (owner, key) in self._create_starts:
            try:
                sandbox_id = (await asyncio.shield(self._create_starts[(owner, key)])).id
            except Exception:  # noqa: BLE001 - that create failed: this one tries again
                return None
        live = self.live.get(sandbox_id) if sandbox_id is not None else None
        if live is None or sandbox_id in self._deleting:
            return None
        recorded = self._create_specs.get((owner, key))
        if recorded is not None and recorded != spec.model_dump(exclude={"idempotency_key"}):
            raise IdempotencyConflict(
                f"idempotency key {key!r} was used for another sandbox spec ({sandbox_id})",
                sandbox_id=sandbox_id, idempotency_key=key)
        return live.info.model_copy()

    async def _new_sandbox(self, spec: SandboxSpec, owner: str, share: Share) -> SandboxInfo:
        self._backend_for(spec)
        disk = find_vm_disk(self.settings.vm_disks_dir, spec.image)
        if disk is not None:  # a VM disk image: its name is looked up before the image store
            if spec.backend != "vm":
                raise BadRequest(f"{disk.name!r} is a VM disk image: only backend 'vm' boots "
                                 f"it, not {spec.backend!r}", image=disk.name,
                                 backend=spec.backend)
            if spec.layers:
                raise BadRequest(f"{disk.name!r} is a VM disk image: extra layers do not "
                                 "apply to it", image=disk.name)
            spec = spec.model_copy(update={"image": disk.name})
            return await self._admitted_create(spec, owner, {"disk_image": disk.name}, [],
                                               share)
        image = self._image_for(spec.image, owner)
        snap = image.config.get("machine_snapshot")
        if snap is not None:
            self._check_machine_restore(spec, snap)
        layers = list(image.layers)
        for extra in spec.layers:
            layers.extend(self._image_for(extra, owner).layers)
        return await self._admitted_create(spec, owner, image.config, layers, share)

    @staticmethod
    def _check_machine_restore(spec: SandboxSpec, snap: Any) -> None:
        """A create from a machine snapshot's image: BadRequest (naming why) for another
        backend than the snapshot's or extra layers; the backend checks the machine."""
        kind = snap.get("backend") if isinstance(snap, dict) else None
        if spec.backend != kind:
            raise BadRequest(
                f"image {spec.image!r} is a machine snapshot (disk + memory) of a {kind!r} "
                f"sandbox: it restores as a {kind!r} sandbox only (backend={kind!r}); a "
                f"{spec.backend} sandbox starts from image layers, and the saved memory runs "
                "only on the machine it was saved from", image=spec.image,
                backend=spec.backend, snapshot_backend=kind, reason="machine_snapshot")
        if spec.layers:
            raise BadRequest(f"image {spec.image!r} is a machine snapshot: its disks are "
                             "as saved, no extra layers go on it", image=spec.image,
                             reason="machine_snapshot")

    def _backend_for(self, spec: SandboxSpec) -> Backend:
        """The backend of ``spec.backend``: BadRequest if this node does not offer it, or if
        the spec asks more than it can give one sandbox here."""
        backend = self.backends.get(spec.backend)
        cap = backend.capacity() if backend is not None else None
        if backend is None or cap is None or not cap.offered:
            offered = sorted(k for k, b in self.backends.items() if b.capacity().offered)
            why = f" ({cap.reason})" if cap is not None and cap.reason else ""
            raise BadRequest(f"backend {spec.backend!r} is not offered by node {self.node_id}"
                             f"{why}; offered: {', '.join(offered) or 'none'}",
                             backend=spec.backend, offered=offered)
        if spec.vm_console != "none" and not cap.facts.get("computer_use"):
            raise BadRequest(f"vm_console {spec.vm_console!r} is for sandboxes with a screen "
                             f"(backend \"vm\"), not {spec.backend}", reason="vm_console",
                             backend=spec.backend)
        r = spec.resources
        # A backend's bound is the host's; a node with a share of the host (co-hosted
        # edges) gives one sandbox at most its share.
        share = {"cpus": self.admission.host_cpus, "memory_mib": self._host_mem_mib}
        for name, asked, most in (("cpus", r.cpus, cap.max_cpus),
                                  ("memory_mib", r.memory_mib, cap.max_memory_mib),
                                  ("disk_mib", r.disk_mib, cap.max_disk_mib)):
            if most is not None and name in share:
                most = min(most, share[name])
            if most is not None and asked > most:
                raise BadRequest(f"resources.{name} {asked:g} is above what node {self.node_id}"
                                 f" gives one {spec.backend} sandbox ({most:g})",
                                 resource=name, requested=asked, limit=most,
                                 backend=spec.backend)
        return backend

    def _collect_metrics(self) -> list:  # noqa: ANN201 - prometheus families
        """This edge's state at a scrape: live sandboxes by state, backend and project; its
        admission figures against its limits; the sandboxes' memory against the node's and
        their writable layers against their caps (the usage sampler's last figures)."""
        m = self.metrics
        counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for live in list(self.live.values()):
            i = live.info
            counts[(i.state, i.backend, m.project(i.owner))] += 1
        node = self.node_id
        cap = self.admission.capacity()
        budgets = self.admission.budgets()
        disk_used = disk_limit = 0
        for live in list(self.live.values()):  # writable layers: the usage sampler's last
            last = live.usage[-1] if live.usage else None
            if last is not None and last.disk_bytes is not None:
                disk_used += last.disk_bytes
                disk_limit += live.info.resources.disk_mib << 20
        use = [("sandboxes", cap["sandboxes"], cap["max_sandboxes"]),
               ("memory_mib_requested", cap["requested_memory_mib"], budgets["memory_mib"]),
               ("cpus_requested", cap["requested_cpus"], budgets["cpus"]),
               ("memory_mib_used", self.admission.memory.sample().sandboxes_mib,
                self.admission.host_mem_mib),
               ("disk_mib_used", disk_used / (1 << 20), disk_limit / (1 << 20)),
               ("memory_mib_available", cap["memory_available_mib"], None),
               ("memory_mib_pooled", self._pooled_memory_mib(self.pool.sandboxes()), None)]
        lazy = self._lazy_metrics()
        pool = self.pool.stats()
        return [
            *lazy,
            gauge("rollbox_pool_sandboxes", "Warm pool: sandboxes made ahead and not handed "
                  "out yet (all keys)", ["node"], [([node], pool["size"])]),
            gauge("rollbox_pool_keys", "Warm pool: set-up keys with pooled sandboxes",
                  ["node"], [([node], pool["keys"])]),
            counter("rollbox_pool_creates", "Warm pool: creates of a poolable key, handed a "
                    "pooled sandbox (hit) or made cold (miss)", ["node", "result"],
                    [([node, "hit"], pool["hits"]), ([node, "miss"], pool["misses"])]),
            counter("rollbox_pool_made", "Warm pool: sandboxes made ahead by the refill",
                    ["node"], [([node], pool["made"])]),
            counter("rollbox_pool_evictions", "Warm pool: pooled sandboxes destroyed unused, "
                    "by why (room: a real create needed it; demand: its key is asked less; "
                    "dead; stop: the edge stopped)", ["node", "reason"],
                    [([node, k], v) for k, v in pool["evicted"].items()]),
            gauge("rollbox_sandboxes", "Live sandboxes on this node", ["node", "state",
                  "backend", "project"], (([node, *k], v) for k, v in counts.items())),
            gauge("rollbox_node_use", "A node's admission figures (what is used or left)",
                  ["node", "what"], (([node, w], float(v)) for w, v, _ in use)),
            gauge("rollbox_node_capacity", "A node's admission limits", ["node", "what"],
                  (([node, w], float(c)) for w, _, c in use if c is not None)),
        ]

    def _lazy_metrics(self) -> list:  # noqa: ANN201 - prometheus families
        """The lazy loader's totals (its daemon keeps them, per layer): cache reads by
        result, bytes fetched from the chunk store and the fetches' latency histogram, the
        cache's use against its limit. The daemon's stats files are root's, in the store's
        0700 ``lazy/`` (no sandbox writes them); a node whose first lazy layer came after the
        edge started has them through the loader its first lazy mount made."""
        from rollbox.images.lazy.loader import existing_loader

        lazy = self._lazy or existing_loader(self.store)
        if lazy is None:
            return []
        try:
            st = lazy.stats()
        except OSError:
            return []
        sums = collections.Counter[str]()
        fetches = {k: [0] * (len(FETCH_BUCKETS) + 1) for k in FETCH_KINDS}
        fetch_sum = dict.fromkeys(FETCH_KINDS, 0.0)
        for layer in st["layers"].values():
            for k in ("cache_hits", "cache_misses", "bytes_fetched"):
                sums[k] += int(layer.get(k) or 0)
            hist = layer.get("fetch_seconds") or {}
            if hist.get("le") != list(FETCH_BUCKETS):
                continue  # a daemon of other bounds (none now): not summable
            for k in FETCH_KINDS:
                counts = (hist.get(k) or {}).get("counts") or []
                if len(counts) == len(fetches[k]):
                    fetches[k] = [a + int(b) for a, b in zip(fetches[k], counts, strict=True)]
                    fetch_sum[k] += float(hist[k].get("sum") or 0.0)
        node = self.node_id
        return [
            histogram("rollbox_lazy_fetch_seconds", "Lazy image loader: a chunk fetch from the "
                      "chunk store, started (its wait for a fetch slot included) to verified "
                      "in the node cache; kind demand (a read waits) or prefetch",
                      ["node", "kind"], [([node, k], FETCH_BUCKETS, fetches[k], fetch_sum[k])
                                         for k in FETCH_KINDS]),
            counter("rollbox_lazy_cache_reads", "Lazy image loader: chunk reads from the node's "
                    "cache (hit) or the chunk store (miss)", ["node", "result"],
                    [([node, "hit"], sums["cache_hits"]), ([node, "miss"], sums["cache_misses"])]),
            counter("rollbox_lazy_fetch_bytes", "Lazy image loader: bytes fetched from the "
                    "chunk store", ["node"], [([node], sums["bytes_fetched"])]),
            gauge("rollbox_lazy_cache_bytes", "Lazy image loader: cache use and limit",
                  ["node", "what"], [([node, "used"], st["cache"]["used"]),
                                     ([node, "limit"], st["cache"]["limit"])]),
        ]

    async def _admitted_create(self, spec: SandboxSpec, owner: str, image_config: dict,
                               layers: list[str], share: Share = "new") -> SandboxInfo:
        gap = self.fence.expired()
        if gap is not None:
            self.metrics.refusals.labels("fenced").inc()
            raise CapacityExceeded(f"node {self.node_id} is fenced: no watcher probed it for "
                                   f"{gap:.0f} s", reason="fenced")
        if self.draining:
            self.metrics.refusals.labels("draining").inc()
            raise CapacityExceeded(f"node {self.node_id} is draining (a burst node being "
                                   "released): no new sandbox", reason="draining")
        self._last_request = time.monotonic()
        quota = self.quotas.get(owner) if self.quotas is not None else None
        key = (key_of(spec, layers, image_config or {}, self.settings)
               if self.settings.pool and share == "new" else None)
        if key is not None:
            self.pool.note(key, self._base_env(image_config, {}))
            pooled = self.pool.take(key)
            if pooled is not None:
                return await self._hand_out(pooled, spec, owner, image_config, layers, quota)
        try:
            fds = self.backends[spec.backend].edge_fds(spec.network is not None)
            ticket = await self._admit_evicting(
                lambda: self.admission.try_admit(spec.resources, owner, share, quota, fds),
                None if share == "new" else
                lambda: self.admission.admit(spec.resources, owner, share, quota, fds))
        except (CapacityExceeded, QuotaExceeded) as exc:
            self.metrics.refusals.labels(self.metrics.refusal_reason(exc.details)).inc()
            raise
        self._starting += 1
        t0 = time.monotonic()
        project = self.metrics.project(owner)
        try:
            try:
                async with asyncio.timeout(self.limits.create_queue_timeout_s):
                    await self._create_sem.acquire()
            except TimeoutError:
                self.metrics.refusals.labels("queue").inc()
                raise CapacityExceeded("node busy: creation queue timed out",
                                       reason="queue") from None
            try:
                info = await self._create(spec, owner, image_config, layers, ticket)
            finally:
                self._create_sem.release()
        except BaseException:
            self.admission.release(ticket)
            self.metrics.creates.labels(spec.backend, project, "failed").inc()
            raise
        finally:
            self._starting -= 1
        self.metrics.creates.labels(spec.backend, project, "created").inc()
        self.metrics.create_seconds.labels(spec.backend).observe(time.monotonic() - t0)
        return info

    async def _admit_evicting(self, attempt: Callable[[], _T],
                              wait: Callable[[], Awaitable[_T]] | None = None) -> _T:
        """Admission of a real create or fork: ``attempt`` (a ``try_admit``) now; a refusal
        for want of room (pool.ROOM_REASONS) first gives back the room of pooled sandboxes
        (least-wanted key first), one at a time; then ``wait`` (a reserved admission waits
        for room) or the refusal is final. Other refusals (grades waiting, memory pressure, a
        project's grades) evict nothing. Counted in ``_admitting``: the refill does not take
        the room an eviction just gave back."""
        self._admitting += 1
        try:
            while True:
                try:
                    return attempt()
                except CapacityExceeded as exc:
                    if (exc.details.get("reason") not in ROOM_REASONS
                            or not await self.pool.evict_one("room")):
                        if wait is None:
                            raise
                        break
                    self.admission.memory.forget()  # what the evicted one held shows now
            return await wait()
        finally:
            self._admitting -= 1

    @staticmethod
    def _base_env(image_config: dict | None, spec_env: dict[str, str]) -> dict[str, str]:
        """The commands' base env: the platform's defaults, the image's, the spec's."""
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        env.update((image_config or {}).get("env", {}))
        env.update(spec_env)
        return env

    def _info_of(self, sandbox_id: str, spec: SandboxSpec, owner: str, layers: list[str],
                 state: str = "creating") -> SandboxInfo:
        now = time.time()
        return SandboxInfo(
            id=sandbox_id, node=self.node_id, image=spec.image, layers=layers, state=state,
            created_at=now, expires_at=now + spec.ttl_s, labels=spec.labels,
            resources=spec.resources, owner=owner, hidden_paths=spec.hidden_paths,
            network=spec.network, job=spec.job, disk_tier=spec.disk_tier,
            backend=spec.backend, qos=spec.qos, idempotency_key=spec.idempotency_key,
            on_expiry=spec.on_expiry, resume_on_traffic=spec.resume_on_traffic,
            pause_keep_memory=spec.pause_keep_memory, ttl_s=spec.ttl_s,
            vm_console=spec.vm_console,
        )

    # ---- warm pools (rollbox.edge.pool) -------------------------------------------------
    def _pool_busy(self) -> float:
        """How long the refill still waits (0: it may go): while a real create or fork is
        in admission or in flight, and until POOL_QUIET_S after the last create, fork or exec
        start (its first command, the next step of an episode)."""
        if self._starting > 0 or self._admitting > 0:
            return POOL_QUIET_S
        return max(0.0, self._last_request + POOL_QUIET_S - time.monotonic())

    async def _pool_make(self, key: PoolKey, base_env: dict[str, str]) -> Pooled:
        """One sandbox of ``key`` made ahead: admitted as the pool's (no project's, no quota),
        created by the same backend call as a cold create of that key, not journaled (an
        edge that stops destroys it; one that crashes cleans it up as an orphan)."""
        if self.draining or self.fence.expired() is not None:
            why = "draining" if self.draining else "fenced"
            raise CapacityExceeded(f"node {self.node_id} is {why}: nothing is pooled",
                                   reason=why)
        r = key.resolved()
        backend = self.backends[key.backend]
        ticket = self.admission.try_admit(r, POOL_OWNER, "new",
                                          fds=backend.edge_fds(key.network is not None))
        sandbox_id = f"{self.node_id}-{secrets.token_hex(6)}"
        spec = ResolvedSpec(image=key.image, layers=key.layers, resources=r,
                            env=dict(base_env), hidden_paths=key.hidden_paths,
                            network_rules=key.network, disk_tier=key.disk_tier,  # type: ignore[arg-type]
                            qos=key.qos)  # type: ignore[arg-type]
        try:
            box = await backend.create(sandbox_id, spec)
        except BaseException:
            self.admission.release(ticket)
            raise
        self.admission.started(ticket)
        return Pooled(key, sandbox_id, box, backend, ticket)

    async def pool_fill(self, spec: SandboxSpec, n: int, owner: str = "") -> list[str]:
        """Make up to ``n`` pooled sandboxes of ``spec``'s key now (pre-warming: benchmarks,
        tests, an operator), counted as ``n`` creates of demand; returns their ids. BadRequest
        with pools off or for a spec no pool takes (``owner``: whose images it may name)."""
        if not self.settings.pool:
            raise BadRequest("warm pools are off on this node (ROLLBOX_POOL)", reason="pool_off")
        self._backend_for(spec)
        image = self._image_for(spec.image, owner)
        layers = list(image.layers)
        for extra in spec.layers:
            layers.extend(self._image_for(extra, owner).layers)
        key = key_of(spec, layers, image.config, self.settings)
        if key is None:
            raise BadRequest(f"no warm pool for {spec.backend!r} sandboxes of {spec.image!r}",
                             reason="not_poolable")
        env = self._base_env(image.config, {})
        self.pool.note(key, env, weight=n)
        return await self.pool.fill(key, n, env)

    async def _pool_destroy(self, p: Pooled) -> None:
        try:
            await p.backend.destroy(p.box)
        except RollboxError as exc:
            log.error("warm pool: destroying %s failed: %s", p.sandbox_id, exc)
        finally:
            self.admission.release(p.ticket)

    async def _hand_out(self, p: Pooled, spec: SandboxSpec, owner: str, image_config: dict,
                        layers: list[str], quota: Quota | None) -> SandboxInfo:
        """A pooled sandbox becomes ``owner``'s: its quota is checked (QuotaExceeded: the
        sandbox goes back to the pool untouched), then what is not in the pool key is applied
        as at a cold create (labels, owner, job, TTL, env, sudo) and it is journaled,
        registered and logged as created now."""
        t0 = time.monotonic()
        try:
            sudo = sudo_uids(image_config or {})
            self.admission.transfer(p.ticket, owner, quota)
        except (QuotaExceeded, BadRequest) as exc:
            self.pool.put_back(p)
            if isinstance(exc, QuotaExceeded):
                self.metrics.refusals.labels(self.metrics.refusal_reason(exc.details)).inc()
            raise
        info = self._info_of(p.sandbox_id, spec, owner, layers, state="running")
        box = p.box
        info.guest_reported = box.guest_reported
        box.image_env.clear()
        box.image_env.update(self._base_env(image_config, spec.env))
        if box.network is not None:
            box.image_env.update(box.network.env)
        try:
            self.journal.put(info, backend_state=box.state(), extra={"env": box.image_env})
            self._register(info, box, p.backend, p.ticket)
        except BaseException as exc:
            # Neither pooled nor live: destroyed (its admission released), nothing left of it.
            live = self.live.pop(info.id, None)
            if live is not None and live.watcher is not None:
                live.watcher.cancel()
            if self._create_keys.get((owner, info.idempotency_key)) == info.id:
                del self._create_keys[(owner, info.idempotency_key)]
            await self.pool.discard(p)
            try:
                self._mark_dead(info, f"creation failed: {exc}", state="deleted")
            except Exception:  # noqa: BLE001 - the journal failing is what raised: say that
                log.exception("sandbox %s: its failed hand-out not journaled", info.id)
            raise
        self.event_log.append(info.id, "sandbox.created", data=json.dumps(
            {"image": spec.image, "layers": layers, "owner": owner, "job": spec.job,
             "pooled": True}))
        project = self.metrics.project(owner)
        self.metrics.creates.labels(spec.backend, project, "created").inc()
        self.metrics.create_seconds.labels(spec.backend).observe(time.monotonic() - t0)
        await self._enable_sudo(info.id, box, sudo)
        return info

    async def _create(self, spec: SandboxSpec, owner: str, image_config: dict,
                      layers: list[str], ticket: Ticket) -> SandboxInfo:
        backend = self._backend_for(spec)
        sandbox_id = f"{self.node_id}-{secrets.token_hex(6)}"
        info = self._info_of(sandbox_id, spec, owner, layers)
        env = self._base_env(image_config, spec.env)
        sudo = sudo_uids(image_config or {})  # a bad label is refused before anything starts
        self.journal.put(info, extra={"env": env})
        snap = (image_config or {}).get("machine_snapshot")
        restore = {"machine_snapshot": str(snap["id"])} if isinstance(snap, dict) else {}
        if (image_config or {}).get("disk_image"):  # a VM disk image (_new_sandbox)
            restore["disk_image"] = str(image_config["disk_image"])
        try:
            box = await backend.create(sandbox_id, self._spec_of(info, {"env": env, **restore}))
        except BaseException as exc:
            self._mark_dead(info, f"creation failed: {exc}", state="deleted")
            raise
        info.state = "running"
        info.guest_reported = box.guest_reported
        extra = None
        if box.network is not None:  # the package tools' mirror settings join the env
            box.image_env.update(box.network.env)
            extra = {"env": box.image_env}
        self.journal.put(info, backend_state=box.state(), extra=extra)
        self._register(info, box, backend, ticket)
        self.admission.started(ticket)
        self.event_log.append(sandbox_id, "sandbox.created", data=json.dumps(
            {"image": spec.image, "layers": layers, "owner": owner, "job": spec.job}))
        await self._enable_sudo(info.id, box, sudo)
        return info

    async def _enable_sudo(self, sandbox_id: str, box: SandboxHandle, uids: list[int]) -> None:
        """An image labelled ``rollbox.sudo``: its sandbox's agent serves the sudo socket
        (docs/security.md); a sandbox whose agent can not is deleted, not left half-made."""
        if not uids:
            return
        try:
            await box.channel.enable_sudo(uids)
        except BaseException:
            await self.delete(sandbox_id)
            raise

    def _register(self, info: SandboxInfo, box: SandboxHandle, backend: Backend,
                  ticket: Ticket) -> None:
        live = LiveSandbox(info, box, backend, ticket=ticket, platform=any(
            k.startswith(PLATFORM_LABEL_PREFIX) for k in info.labels))
        self.live[info.id] = live
        if info.idempotency_key is not None:
            self._create_keys[(info.owner, info.idempotency_key)] = info.id
        if info.fork_key is not None:
            self._fork_keys.setdefault((info.owner, info.fork_key), []).append(info.id)
        live.watcher = asyncio.create_task(self._watch(live))

    async def _watch(self, live: LiveSandbox) -> None:
        """The agent's channel closing means the sandbox died (OOM, killed, node trouble)."""
        try:
            await asyncio.shield(live.box.channel.closed)
        except asyncio.CancelledError:
            return
        if not live.info.memory_kept:  # paused filesystem-only: no agent, nothing to watch
            return
        if live.info.id in self.live and live.info.id not in self._deleting:
            log.warning("sandbox %s died", live.info.id)
            self._deleting[live.info.id] = asyncio.current_task()  # type: ignore[assignment]
            # Kills no command result reported: the agent itself (or what it ran) was the
            # OOM killer's victim. Read before teardown removes the memory cgroup.
            oom = self._oom_kills(live) > live.oom_kills_claimed
            try:
                await self._destroy(live, reason="oom" if oom else "sandbox died (agent exited)",
                                    state="dead")
            finally:
                self._deleting.pop(live.info.id, None)

    def _mark_dead(self, info: SandboxInfo, reason: str, state: str = "dead") -> None:
        info.state = state  # type: ignore[assignment]
        info.dead_reason = reason
        self.journal.put(info)
        self.journal.exec_forget(info.id)
        self.event_log.append(info.id, f"sandbox.{state}", data=reason)

    def _live(self, sandbox_id: str) -> LiveSandbox:
        live = self.live.get(sandbox_id)
        if live is not None and sandbox_id not in self._deleting:
            return live
        rec = self.journal.get(sandbox_id)
        if rec is None:
            raise NotFound(f"sandbox {sandbox_id} not found")
        info = rec[0]
        raise SandboxDead(f"sandbox {sandbox_id} is {info.state}"
                          + (f": {info.dead_reason}" if info.dead_reason else ""),
                          state=info.state, reason=info.dead_reason)

    def _running(self, sandbox_id: str) -> LiveSandbox:
        """A live sandbox that is not paused: what needs its agent (exec, stdin, signals)."""
        live = self._live(sandbox_id)
        if live.info.state == "paused":
            raise SandboxPaused(f"sandbox {sandbox_id} is paused; resume it first",
                                state="paused")
        return live

    def _sample(self, live: LiveSandbox) -> UsageSample:
        u = live.backend.usage(live.box)
        return UsageSample(at=time.time(), memory_bytes=u.memory_bytes,
                           cpu_usage_us=u.cpu_usage_us, disk_bytes=u.disk_bytes,
                           oom_kills=u.oom_kills)

    def _record_usage(self) -> None:
        keep = max(1, self.settings.usage_samples)
        for live in list(self.live.values()):
            try:
                live.usage.append(self._sample(live))
            except (OSError, InfraError):  # going away under the sampler: no sample
                continue
            while len(live.usage) > keep:
                live.usage.popleft()

    async def usage_history(self, sandbox_id: str) -> list[UsageSample]:
        live = self._live(sandbox_id)
        return [*live.usage, self._sample(live)]

    async def get(self, sandbox_id: str) -> SandboxInfo:
        live = self.live.get(sandbox_id)
        if live:
            net = live.box.network
            usage = SandboxUsage(**dataclasses.asdict(live.backend.usage(live.box)))
            audit = NetAudit(**net.audit()) if net is not None else None
            return live.info.model_copy(update={"audit": audit, "usage": usage})
        rec = self.journal.get(sandbox_id)
        if rec is None:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return rec[0]

    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        out = []
        for live in self.live.values():
            info = live.info
            if owner is not None and info.owner != owner:
                continue
            if all(info.labels.get(k) == v for k, v in labels.items()):
                out.append(info)
        return out

    async def delete(self, sandbox_id: str, requested: str | None = None) -> None:
        """``requested``: the api's sandbox.requested event (who asked), logged first if the
        sandbox is live (before sandbox.deleted, which ends its trail and followers)."""
        if requested is not None and sandbox_id in self.live:
            self.event_log.append(sandbox_id, "sandbox.requested", data=requested)
        if sandbox_id in self._deleting:
            await asyncio.shield(self._deleting[sandbox_id])
            return
        live = self.live.get(sandbox_id)
        if live is None:
            rec = self.journal.get(sandbox_id)
            if rec is None:
                raise NotFound(f"sandbox {sandbox_id} not found")
            return  # already dead or deleted: deleting again is a no-op
        task = asyncio.create_task(self._destroy(live, reason=None, state="deleted"))
        self._deleting[sandbox_id] = task
        try:
            await asyncio.shield(task)
        finally:
            self._deleting.pop(sandbox_id, None)

    async def _destroy(self, live: LiveSandbox, reason: str | None, state: str) -> None:
        info = live.info
        why = self.metrics.delete_reason(reason)
        self.metrics.deletes.labels(info.backend, self.metrics.project(info.owner), why).inc()
        if why == "oom":
            self.metrics.oom_kills.labels(info.backend, "sandbox").inc()
        elif why == "expired":
            self.metrics.timeouts.labels("ttl").inc()
        info.state = "stopping"
        self.journal.put(info)
        if live.watcher and live.watcher is not asyncio.current_task():
            live.watcher.cancel()
        ended = f"sandbox {info.id} was {state}" + (f": {reason}" if reason else "")
        for sess in live.sessions.values():
            if not sess.done.is_set():
                sess.fail(SandboxDead(ended))
        # The platform's processes on its channel (platform_exec, run_shell) end with the same
        # typed error, not the backend's close of the channel ("agent channel closed", an
        # infrastructure fault: a delete in the middle of a platform_exec read as one).
        live.box.channel.close(SandboxDead(ended))
        self._log_net_denied(live)  # the counters go with the sandbox's cgroup
        for port in list(live.ports):  # the proxy's connections end with the sandbox
            await port.close()
        live.ports.clear()
        try:
            await live.backend.destroy(live.box)  # also a paused one
        finally:
            self.live.pop(info.id, None)
            if info.idempotency_key is not None:
                ident = (info.owner, info.idempotency_key)
                if self._create_keys.get(ident) == info.id:
                    del self._create_keys[ident]
                    self._create_specs.pop(ident, None)
            if info.fork_key is not None:
                ident = (info.owner, info.fork_key)
                kids = self._fork_keys.get(ident, [])
                if info.id in kids:
                    kids.remove(info.id)
                if not kids:
                    self._fork_keys.pop(ident, None)
                    self._fork_specs.pop(ident, None)
            if live.ticket is not None:
                self.admission.release(live.ticket)
            info.state = state  # type: ignore[assignment]
            info.dead_reason = reason
            self.journal.put(info)
            self.journal.exec_forget(info.id)
            self.event_log.append(info.id, f"sandbox.{'dead' if state == 'dead' else 'deleted'}",
                               data=reason or "")
            if state == "dead":
                self.event_log.append(info.id, "sandbox.deleted", data=reason or "")

    async def set_ttl(self, sandbox_id: str, ttl_s: float) -> SandboxInfo:
        if not 0 < ttl_s <= 7 * 24 * 3600:
            raise BadRequest("ttl_s must be in (0, 604800]")
        live = self._live(sandbox_id)
        live.info.expires_at = time.time() + ttl_s
        self.journal.put(live.info)
        return live.info

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy | None) -> SandboxInfo:
        """Change a live sandbox's network policy; existing connections are cut at once where
        the new policy no longer allows them. None = deny everything (the link stays)."""
        live = self._live(sandbox_id)
        rules = list(policy.allow) if policy is not None else []
        box = live.box
        old_env = box.network.env if box.network is not None else {}
        if box.network is None and policy is None:
            return live.info
        ticket = live.ticket
        if ticket is not None:  # its descriptors with a network (CapacityExceeded: unchanged)
            before = ticket.fds
            self.admission.resize_fds(ticket, live.backend.edge_fds(True))
        try:
            await live.backend.set_network(box, rules)  # BadRequest: nothing changed
        except BaseException:
            if ticket is not None and box.network is None:
                self.admission.resize_fds(ticket, before)
            raise
        assert box.network is not None
        for k in old_env:
            box.image_env.pop(k, None)
        box.image_env.update(box.network.env)
        live.info.network = policy if policy is not None else NetworkPolicy(allow=[])
        self.journal.put(live.info, extra={"env": box.image_env})
        self.event_log.append(sandbox_id, "sandbox.network", data=json.dumps({"allow": rules}))
        return live.info

    # ---- pause / resume -------------------------------------------------------------------
    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> SandboxInfo:
        """Freeze the whole sandbox (agent and every command) in its cgroup: no CPU, memory and
        disk kept. Exec/stdin/signals answer SandboxPaused until resume; host-side operations
        (files, TTL, network, snapshot, grade, delete) still work. The TTL keeps counting.
        Pausing a paused sandbox is a no-op (but keep_memory=False of a frozen one stops it).

        ``keep_memory=False``: filesystem-only (:meth:`_pause_fs`): every process stopped,
        memory and CPU released, files, identity and TTL kept (``memory_kept`` False)."""
        live = self._live(sandbox_id)
        async with live.freeze_lock:
            if live.info.state == "paused" and (keep_memory or not live.info.memory_kept):
                return live.info
            self._check_freezable(live)
            if keep_memory:
                await self._freeze_change(live, live.backend.pause)
            else:
                await self._pause_fs(live)
            live.info.state = "paused"
            self.journal.put(live.info, backend_state=live.box.state())
        self.event_log.append(sandbox_id, "sandbox.paused",
                              data="" if keep_memory else "filesystem only")
        return live.info

    async def _pause_fs(self, live: LiveSandbox) -> None:
        """Stop the sandbox, keep its filesystem (Backend.pause_fs). Its commands end (failed
        with SandboxPaused, recorded), its port connections close; the node's admission counts
        it as one sandbox with no CPU and memory from then on (it holds disk only; the
        project's quota, the api's, keeps counting it whole so a resume is never refused by
        the quota). A backend that can not: NotSupported; a platform sandbox (a grader, a
        fncall worker): BadRequest. A stop that fails half-way tears the sandbox down."""
        info = live.info
        if not live.backend.capacity().fs_pause:
            raise NotSupported(f"backend {info.backend!r} has no filesystem-only pause "
                               "(pause keeps memory there)", feature="pause keep_memory=false",
                               backend=info.backend)
        if live.platform:
            raise BadRequest(f"sandbox {info.id} is the platform's (a grader or fncall worker):"
                             " it can not be paused filesystem-only", sandbox_id=info.id)
        if info.disk_tier == "memory":
            raise BadRequest(f"sandbox {info.id} keeps its writable layer in memory (disk_tier "
                             "memory): a filesystem-only pause would release nothing of it",
                             sandbox_id=info.id, disk_tier="memory")
        if live.watcher is not None:
            live.watcher.cancel()
            live.watcher = None
        info.memory_kept = False  # from here on its channel closing is no death
        for session in list(live.sessions.values()):
            if not session.done.is_set():
                err = SandboxPaused(f"exec {session.exec_id} ended: sandbox {info.id} was "
                                    "paused filesystem-only (its processes were stopped)",
                                    state="paused", exec_id=session.exec_id)
                session.fail(err)
                self.journal.exec_done(info.id, session.exec_id, None,
                                       json.dumps(err.to_payload()))
        # The platform's processes on its channel (platform_exec, run_shell) end the same way,
        # not with the channel's close ("agent channel closed", an infrastructure fault).
        live.box.channel.fail_sessions(SandboxPaused(
            f"sandbox {info.id} was paused filesystem-only (its processes were stopped)",
            state="paused"))
        live.deferred_kills.clear()
        for port in list(live.ports):
            await port.close()
        live.ports.clear()
        try:
            await live.backend.pause_fs(live.box)
        except BaseException as exc:
            log.error("sandbox %s: filesystem pause failed (%s); deleting it", info.id, exc)
            self._destroy_soon(info.id, f"filesystem pause failed: {exc}", state="dead")
            if isinstance(exc, RollboxError):
                raise
            raise InfraError(f"filesystem pause of {info.id} failed: {exc}") from exc
        if live.ticket is not None:  # disk only from now on
            self.admission.release(live.ticket)
        live.ticket = self.admission.adopt(_held(info), info.owner, _share_of(info),
                                           PAUSED_FS_FDS)

    async def _resume_fs(self, live: LiveSandbox) -> None:
        """Boot a filesystem-paused sandbox again (Backend.resume_fs) once the node has room
        for its CPU and memory again (CapacityExceeded: it stays paused), with its network
        policy and sudo; a new watcher follows its agent."""
        info = live.info
        ticket = self.admission.try_admit(info.resources, info.owner, _share_of(info),
                                          fds=self._edge_fds(info))
        try:
            rules = list(info.network.allow) if info.network is not None else None
            await live.backend.resume_fs(live.box, rules)
        except BaseException:
            self.admission.release(ticket)
            raise
        if live.ticket is not None:
            self.admission.release(live.ticket)
        live.ticket = ticket
        self.admission.started(ticket)
        info.memory_kept = True
        live.watcher = asyncio.create_task(self._watch(live))
        sudo = sudo_uids(self._image_config(info))
        if sudo:
            await live.box.channel.enable_sudo(sudo)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox; its processes continue where they stopped. A command whose
        deadline passed while paused is killed as timed out at once (deadlines are wall-clock).
        Resuming a running sandbox is a no-op. A filesystem-paused one boots again over its
        files (:meth:`_resume_fs`): a fresh agent, no process of before."""
        live = self._live(sandbox_id)
        async with live.freeze_lock:
            if live.info.state != "paused":
                return live.info
            self._check_freezable(live)
            if live.info.memory_kept:
                await self._freeze_change(live, live.backend.resume)
            else:
                await self._resume_fs(live)
            live.info.state = "running"
            self.journal.put(live.info, backend_state=live.box.state())
            loop = asyncio.get_running_loop()
            for session in live.deferred_kills:  # the agent kills first; this is the backstop
                loop.call_later(HOST_KILL_GRACE_S, self._host_kill, live, session)
            live.deferred_kills.clear()
        self.event_log.append(sandbox_id, "sandbox.resumed")
        return live.info

    async def wake(self, sandbox_id: str) -> SandboxInfo:
        """See EdgeAPI.wake: a paused sandbox with resume_on_traffic resumed (its wake lock
        makes concurrent wakes one resume) and given its ttl_s again; else as it is."""
        live = self._live(sandbox_id)
        if live.info.state != "paused" or not live.info.resume_on_traffic:
            return live.info
        async with live.wake_lock:
            if live.info.state != "paused":
                return live.info  # a concurrent wake did it
            info = await self.resume(sandbox_id)
            if live.info.ttl_s > 0:
                info = await self.set_ttl(sandbox_id, live.info.ttl_s)
        self.event_log.append(sandbox_id, "sandbox.woken")
        return info

    def _check_freezable(self, live: LiveSandbox) -> None:
        if live.info.id in self._snapshotting:
            # The snapshot thaws what it froze when it ends: the two must not interleave.
            raise BadRequest(f"a snapshot of sandbox {live.info.id} is running; "
                             "pause or resume after it")

    async def _freeze_change(self, live: LiveSandbox,
                             change: Callable[[SandboxHandle], Awaitable[None]]) -> None:
        sid = live.info.id
        try:
            await change(live.box)
        except InfraError:
            if sid not in self.live or sid in self._deleting:
                raise SandboxDead(f"sandbox {sid} went away") from None
            raise
        if sid not in self.live or sid in self._deleting:
            raise SandboxDead(f"sandbox {sid} went away")

    async def _ttl_loop(self) -> None:
        next_sample = time.monotonic()
        for tick in itertools.count(1):
            await asyncio.sleep(1.0)
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + max(1.0, self.settings.usage_sample_s)
                self._record_usage()
            gap = self.fence.expired()
            if gap is not None and (self.live or self.pool.size()):
                self._fence_now(gap)
            now = time.time()
            for sid, live in list(self.live.items()):
                if live.info.expires_at <= now:
                    if live.info.on_expiry == "pause" and live.info.state == "running":
                        self._pause_soon(live)
                    else:
                        self._destroy_soon(sid, "ttl expired")
                elif tick % AUDIT_EVERY_S == 0:
                    self._log_net_denied(live)

    def _log_net_denied(self, live: LiveSandbox) -> None:
        """A ``net.denied`` event with the totals and what is new, if the sandbox's network
        policy refused anything since the last one (at most one per AUDIT_EVERY_S)."""
        net = live.box.network
        news = net.audit_news() if net is not None else None
        if news is not None:
            self.event_log.append(live.info.id, "net.denied", data=json.dumps(news))
            new, backend = news["new"], live.info.backend
            assert isinstance(new, dict)
            if new.get("dns_refused"):
                self.metrics.dns_refusals.labels(backend).inc(new["dns_refused"])
            for kind in ("connect", "sendmsg", "packets"):
                n = new.get(f"{kind}_denied" if kind != "packets" else "packets_dropped")
                if n:
                    self.metrics.filter_denials.labels(backend, kind).inc(n)

    def _pause_soon(self, live: LiveSandbox) -> None:
        """A sandbox with on_expiry "pause" at its TTL's end: paused (its new deadline
        paused_ttl_s on, set first so the TTL loop does not start it twice); deleted instead
        if it can not be paused."""
        sid = live.info.id
        live.info.expires_at = time.time() + self.settings.paused_ttl_s
        self.journal.put(live.info)

        async def run() -> None:
            try:  # logs sandbox.paused
                await self.pause(sid, keep_memory=live.info.pause_keep_memory)
            except Exception as exc:  # noqa: BLE001 - not pausable: the TTL's usual end
                log.warning("sandbox %s: pause at ttl failed (%s); deleting it", sid, exc)
                self._destroy_soon(sid, "ttl expired")

        task = asyncio.create_task(run())
        self._pausing.add(task)
        task.add_done_callback(self._pausing.discard)

    def _destroy_soon(self, sandbox_id: str, reason: str, state: str = "deleted") -> None:
        """Start deleting a live sandbox (TTL, job lease; ``state`` dead: node lost) with
        ``reason`` in its event log."""
        live = self.live.get(sandbox_id)
        if live is None or sandbox_id in self._deleting:
            return
        if state == "dead":
            live.info.dead_reason = reason  # what get/exec answer while it goes
        task = asyncio.create_task(self._destroy(live, reason, state))
        self._deleting[sandbox_id] = task
        task.add_done_callback(lambda _t, s=sandbox_id: self._deleting.pop(s, None))

    # ---- exec ---------------------------------------------------------------------------
    async def _resolve_user(self, live: LiveSandbox, user: str) -> tuple[int, int, str]:
        if user in live.users:
            return live.users[user]
        if user == "root":
            return (0, 0, "/root")
        uid_s, _, gid_s = user.partition(":")
        if uid_s.isdigit() and (not gid_s or gid_s.isdigit()):
            uid = int(uid_s)
            gid = int(gid_s) if gid_s else uid
            if uid >= 65536 or gid >= 65536:
                raise BadRequest("uid/gid must be < 65536")
            return (uid, gid, "/")
        # A name: look it up in the sandbox's /etc/passwd, read as data from the host side.
        try:
            text = (await live.box.files.read("/etc/passwd", 1 << 20)).decode(errors="replace")
        except RollboxError:
            text = ""
        for line in text.splitlines():
            parts = line.split(":")
            if len(parts) >= 7 and parts[0] == user and parts[2].isdigit() and parts[3].isdigit():
                uid, gid = int(parts[2]), int(parts[3])
                if uid < 65536 and gid < 65536:
                    live.users[user] = (uid, gid, parts[5] or "/")
                    return live.users[user]
        raise BadRequest(f"unknown user {user!r} in sandbox")

    async def exec_start(self, sandbox_id: str, spec: ExecSpec) -> str:
        self._last_request = time.monotonic()
        live = self._running(sandbox_id)
        key = spec.idempotency_key
        if key is None:
            return await self._exec_start(live, spec)
        recorded = await self._keyed_exec(live, spec, key)
        if recorded is not None:
            return recorded
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        live.key_starts[key] = fut
        try:
            exec_id = await self._exec_start(live, spec)
            fut.set_result(exec_id)
            return exec_id
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else InfraError("cancelled"))
            fut.exception()
            raise
        finally:
            live.key_starts.pop(key, None)

    async def _keyed_exec(self, live: LiveSandbox, spec: ExecSpec, key: str) -> str | None:
        """The exec recorded under ``key`` (None: none), after checking it is the same."""
        exec_id = live.keys.get(key)
        if exec_id is None and key in live.key_starts:
            try:
                exec_id = await asyncio.shield(live.key_starts[key])
            except Exception:  # noqa: BLE001 - that start failed: this one tries again
                return None
        if exec_id is None or exec_id not in live.sessions:
            return None
        recorded = live.sessions[exec_id].spec
        if recorded.model_dump(exclude={"idempotency_key"}) != spec.model_dump(
                exclude={"idempotency_key"}):
            raise IdempotencyConflict(
                f"idempotency key {key!r} was used for another command in this sandbox "
                f"(exec {exec_id})", exec_id=exec_id, idempotency_key=key)
        return exec_id

    async def _exec_start(self, live: LiveSandbox, spec: ExecSpec) -> str:
        sandbox_id = live.info.id
        await live.backend.prepare_exec(live.box)  # e.g. a squeezed VM gets its memory back
        uid, gid, home = await self._resolve_user(live, spec.user)
        shell = isinstance(spec.cmd, str)  # a string: the platform shell, never the sandbox's
        argv = shell_argv(spec.cmd) if isinstance(spec.cmd, str) else list(spec.cmd)
        env = dict(live.box.image_env)
        if spec.user != "root":
            env["HOME"] = home
        if spec.pty is not None:
            env.setdefault("TERM", PTY_TERM)
        env.update(spec.env)
        req = ExecRequest(
            argv=argv, env=[f"{k}={v}" for k, v in env.items()], cwd=spec.cwd, uid=uid, gid=gid,
            timeout_ms=int(spec.timeout_s * 1000) if spec.timeout_s else 0,
            stdin=spec.stdin and spec.pty is None,  # a terminal's stdin is its master
            tail_limit=RETAIN_LIMIT,  # what a restarted edge can replay
            platform_shell=shell,
            pty=(spec.pty.cols, spec.pty.rows) if spec.pty is not None else None,
            pty_stderr=spec.pty_stderr,
        )
        slot = live.box.new_session()
        cg_name, cg_fd = slot.name, slot.cgroup_fd
        exec_id = f"e{live.box.next_session}"
        session = ExecSession(exec_id, spec, live.box.guest_reported)
        session.cgroup_name = cg_name
        channel = live.box.channel
        agent_id = channel.new_session_id()
        # Journaled before the agent hears of it: after a crash the command is found (running,
        # exited, or certainly never started), never silently forgotten.
        self.journal.exec_put(sandbox_id, exec_id, agent_id, spec.model_dump_json(),
                              spec.idempotency_key, cg_name, session.started_at)
        try:
            start = channel.exec(req, cg_fd, session_id=agent_id, collect=False)
            if live.box.guest_reported:
                try:
                    async with asyncio.timeout(GUEST_START_TIMEOUT_S):
                        agent_session = await start
                except TimeoutError:
                    raise InfraError(f"sandbox {sandbox_id}: the guest's agent did not start "
                                     f"the command within {GUEST_START_TIMEOUT_S:.0f} s "
                                     "(unresponsive guest)") from None
            else:
                agent_session = await start
        except SpawnError as exc:
            _close(cg_fd)
            live.box.drop_session(cg_name)
            if shell and str(exc).startswith("platform shell"):  # the node's fault, not the call's
                raise InfraError(f"sandbox {sandbox_id}: {exc}") from None
            if spec.pty is not None and exc.errno == errno.EINVAL and "EXEC flags" in str(exc):
                self.journal.exec_forget(sandbox_id, [exec_id])
                raise BadRequest(f"sandbox {sandbox_id}: its agent predates pty exec (a microVM "
                                 "restored from an older template); create a new sandbox",
                                 errno=exc.errno, reason="pty_unsupported") from None
            if exc.errno in (2, 13) and "exec" in str(exc):  # command not found / not runnable
                self._add_session(live, session)
                self._log_start(sandbox_id, session)
                session.output("stderr", f"{exc}\n".encode())
                result = session.finish(127 if exc.errno == 2 else 126, None, False)
                self.journal.exec_done(sandbox_id, exec_id, result.model_dump_json())
                self._log_exit(sandbox_id, result)
                return exec_id
            self.journal.exec_forget(sandbox_id, [exec_id])
            # the errno says why (EAGAIN: the sandbox is at its process limit; try later)
            raise BadRequest(str(exc), errno=exc.errno) from None
        except RollboxError:
            _close(cg_fd)
            live.box.drop_session(cg_name)
            self.journal.exec_forget(sandbox_id, [exec_id])
            raise
        except (ConnectionError, OSError) as exc:
            _close(cg_fd)
            self.journal.exec_forget(sandbox_id, [exec_id])
            raise SandboxDead(f"sandbox {sandbox_id} agent unreachable: {exc}") from None
        _close(cg_fd)
        session.agent_session = agent_session
        self._add_session(live, session)
        self._log_start(sandbox_id, session)
        asyncio.create_task(self._pump(live, session, agent_session))
        return exec_id

    @staticmethod
    def _add_session(live: LiveSandbox, session: ExecSession) -> None:
        live.sessions[session.exec_id] = session
        if session.spec.idempotency_key:
            live.keys[session.spec.idempotency_key] = session.exec_id

    def _log_start(self, sandbox_id: str, session: ExecSession) -> None:
        live = self.live.get(sandbox_id)
        if live is not None and not live.first_exec_seen:
            live.first_exec_seen = True
            self.metrics.first_exec_seconds.labels(live.info.backend).observe(
                max(0.0, time.time() - live.info.created_at))
        self.event_log.append(sandbox_id, "exec.started", session.exec_id, json.dumps(
            {"cmd": session.spec.cmd, "cwd": session.spec.cwd, "user": session.spec.user,
             "timeout_s": session.spec.timeout_s}))

    def _log_exit(self, sandbox_id: str, result: ExecResult) -> None:
        live = self.live.get(sandbox_id)
        backend = live.info.backend if live is not None else "unknown"
        self.metrics.exec_seconds.labels(backend).observe(result.duration_s)
        if result.timed_out:
            self.metrics.timeouts.labels("exec").inc()
        if result.oom_killed:
            self.metrics.oom_kills.labels(backend, "command").inc()
        self.event_log.append(sandbox_id, "exec.exited", result.exec_id, json.dumps(
            {"exit_code": result.exit_code, "signal": result.signal,
             "timed_out": result.timed_out, "oom_killed": result.oom_killed,
             "duration_s": round(result.duration_s, 6),
             "stdout_bytes": result.stdout_bytes, "stderr_bytes": result.stderr_bytes}))

    async def _pump(self, live: LiveSandbox, session: ExecSession, agent_session) -> None:  # noqa: ANN001
        """Follow one command to its end. A command re-adopted after a restart starts with the
        agent's replay (``replay_*``: already in the audit log of the edge before)."""
        sid = live.info.id
        backstop = abandon = None
        abandoned: list[bool] = []
        if session.spec.timeout_s:
            due = max(0.0, session.spec.timeout_s + HOST_KILL_GRACE_S
                      - (time.time() - session.started_at))
            loop = asyncio.get_running_loop()
            backstop = loop.call_later(due, self._host_kill, live, session)
            if session.guest_reported:  # nothing on the host can end it: stop waiting
                me = asyncio.current_task()
                assert me is not None
                abandon = loop.call_later(due + GUEST_END_GRACE_S,
                                          lambda: (abandoned.append(True), me.cancel()))
        tails: dict[str, bytes] = {}
        starts = agent_session.start_offsets
        try:
            async for kind, payload in agent_session.events():
                if kind in ("stdout", "stderr", "replay_stdout", "replay_stderr"):
                    stream = kind.removeprefix("replay_")
                    i = 0 if stream == "stdout" else 1
                    (session.out, session.err)[i].resume_at(starts[i])
                    session.output(stream, payload)
                    if kind == stream:
                        self.event_log.append(sid, f"exec.{kind}", session.exec_id, payload)
                elif kind in ("tail_stdout", "tail_stderr"):
                    tails[kind[5:]] = payload  # folded in at exit with the dropped counts
                elif kind == "exited":
                    ex = payload
                    session.out.resume_at(starts[0])
                    session.err.resume_at(starts[1])
                    session.out.settle(ex.stdout_total,
                                       tails.get("stdout") if ex.stdout_dropped else None)
                    session.err.settle(ex.stderr_total,
                                       tails.get("stderr") if ex.stderr_dropped else None)
                    result = session.finish(
                        ex.exit_code if ex.exit_code >= 0 else None,
                        ex.signal or None, ex.timed_out,
                        oom_killed=ex.signal == 9 and not ex.timed_out and self._claim_oom(live))
                    # Journaled, then logged, then the agent may forget it: a crash in between
                    # finds the record (no second exec.exited) or the agent's copy (one).
                    self.journal.exec_done(sid, session.exec_id, result.model_dump_json())
                    self._log_exit(sid, result)
                    agent_session.collect()
                    return
            if not session.done.is_set():
                session.fail(SandboxDead(f"sandbox {sid} died during the command"))
        except asyncio.CancelledError:
            if not abandoned:
                raise
            gone = InfraError(
                f"sandbox {sid}: the guest did not end {session.exec_id} within "
                f"{HOST_KILL_GRACE_S + GUEST_END_GRACE_S:.0f} s past its deadline "
                "(unresponsive guest)")
            agent_session.abandon(gone)  # its stdin writes and signals stop waiting too
            if not session.done.is_set():
                session.fail(gone)
        except Exception as exc:  # noqa: BLE001 - the session must end, whatever happened
            if not session.done.is_set():
                session.fail(exc if isinstance(exc, RollboxError)
                             else SandboxDead(f"sandbox {sid}: exec channel failed: {exc}"))
        finally:
            if backstop:
                backstop.cancel()
            if abandon:
                abandon.cancel()
            if session.cgroup_name and sid in self.live:
                live.box.drop_session(session.cgroup_name)
            self._forget_old_sessions(live)

    @staticmethod
    def _oom_kills(live: LiveSandbox) -> int:
        return live.backend.oom_kills(live.box)

    def _claim_oom(self, live: LiveSandbox) -> bool:
        """A SIGKILLed command was the OOM killer's if the sandbox's memory cgroup counts a
        kill no earlier command has claimed (read only on SIGKILL: free on the common path)."""
        if self._oom_kills(live) > live.oom_kills_claimed:
            live.oom_kills_claimed += 1
            return True
        return False

    def _host_kill(self, live: LiveSandbox, session: ExecSession) -> None:
        if live.info.state == "paused":  # the agent can't act while frozen: kill after resume
            live.deferred_kills.append(session)
            return
        if not session.done.is_set() and session.cgroup_name:
            log.warning("host-side kill of %s/%s past its deadline", live.info.id, session.exec_id)
            live.backend.kill_session(live.box, session.cgroup_name)

    def _forget_old_sessions(self, live: LiveSandbox, keep: int = 256) -> None:
        """Old finished commands go (with their journal records and idempotency keys)."""
        if len(live.sessions) <= 2 * keep:
            return
        done = [k for k, s in live.sessions.items() if s.done.is_set()]
        gone = done[: max(0, len(done) - keep)]
        for k in gone:
            sess = live.sessions.pop(k, None)
            if sess is not None and sess.spec.idempotency_key:
                live.keys.pop(sess.spec.idempotency_key, None)
        self.journal.exec_forget(live.info.id, gone)

    def _session(self, sandbox_id: str, exec_id: str) -> ExecSession:
        live = self.live.get(sandbox_id)
        if live is None:
            self._live(sandbox_id)  # raises the right error
            raise NotFound(f"exec {exec_id} not found")
        sess = live.sessions.get(exec_id)
        if sess is None:
            raise NotFound(f"exec {exec_id} not found in sandbox {sandbox_id}")
        return sess

    async def exec_stream(self, sandbox_id: str, exec_id: str,
                          offsets: tuple[int, int] = (0, 0)) -> AsyncIterator[ExecOutput]:
        sess = self._session(sandbox_id, exec_id)
        async for item in sess.stream(offsets):
            yield item

    async def exec_wait(self, sandbox_id: str, exec_id: str) -> ExecResult:
        sess = self._session(sandbox_id, exec_id)
        await sess.done.wait()
        if sess.error is not None:
            raise sess.error
        assert sess.result is not None
        return sess.result

    async def exec_run(self, sandbox_id: str, spec: ExecSpec) -> ExecResult:
        return await self.exec_wait(sandbox_id, await self.exec_start(sandbox_id, spec))

    async def exec_stdin(self, sandbox_id: str, exec_id: str, data: bytes, eof: bool) -> None:
        sess = self._session(sandbox_id, exec_id)
        self._running(sandbox_id)
        if not sess.spec.stdin and sess.spec.pty is None:
            raise BadRequest("exec was started without stdin=true")
        if sess.done.is_set() or sess.agent_session is None:
            raise BadRequest(f"exec {exec_id} has exited")
        if data:
            await sess.agent_session.write_stdin(data)
        if eof and sess.spec.pty is not None:
            # A terminal stays open: end of input is its EOF character (^D), which a program
            # reading it in canonical mode sees as end of file.
            await sess.agent_session.write_stdin(b"\x04")
        elif eof:
            await sess.agent_session.close_stdin()

    async def exec_resize(self, sandbox_id: str, exec_id: str, cols: int, rows: int) -> None:
        sess = self._session(sandbox_id, exec_id)
        if not (1 <= cols <= PTY_MAX_SIZE and 1 <= rows <= PTY_MAX_SIZE):
            raise BadRequest(f"terminal size {cols}x{rows}: cols and rows must be "
                             f"1..{PTY_MAX_SIZE}", cols=cols, rows=rows)
        if sess.spec.pty is None:
            raise BadRequest(f"exec {exec_id} has no terminal (started without pty)")
        if sess.done.is_set() or sess.agent_session is None:
            raise BadRequest(f"exec {exec_id} has exited")
        self._running(sandbox_id)  # the frozen agent could not apply it
        await sess.agent_session.resize(cols, rows)

    async def exec_kill(self, sandbox_id: str, exec_id: str, signal: int) -> None:
        sess = self._session(sandbox_id, exec_id)
        if not 1 <= signal <= 64:
            raise BadRequest("signal must be in 1..64")
        if sess.done.is_set() or sess.agent_session is None:
            return
        self._running(sandbox_id)  # the frozen agent could not deliver it
        if signal == 9:
            await sess.agent_session.kill()
        else:
            await sess.agent_session.signal(signal)

    async def exec_list(self, sandbox_id: str) -> list[ExecInfo]:
        live = self._live(sandbox_id)
        return [s.info() for s in live.sessions.values()]

    # ---- files --------------------------------------------------------------------------
    async def file_read(self, sandbox_id: str, path: str, max_bytes: int) -> bytes:
        return await self._live(sandbox_id).box.files.read(path, max_bytes)

    async def file_write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        await self._live(sandbox_id).box.files.write(path, data, mode)

    async def file_read_stream(self, sandbox_id: str, path: str, max_bytes: int,
                               offset: int = 0) -> AsyncIterator[bytes]:
        if not 0 <= offset <= 1 << 62:
            raise BadRequest(f"file offset out of range: {offset!r}")
        files = self._live(sandbox_id).box.files
        async for chunk in files.read_stream(path, max_bytes, offset):
            yield chunk

    async def file_write_stream(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                                mode: int, max_bytes: int,
                                xattrs: dict[str, str] | None = None) -> int:
        files = self._live(sandbox_id).box.files
        return await files.write_stream(path, chunks, mode, max_bytes=max_bytes, xattrs=xattrs)

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self._live(sandbox_id).box.files.stat(path)

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self._live(sandbox_id).box.files.list(path)

    async def file_mkdir(self, sandbox_id: str, path: str, parents: bool) -> None:
        await self._live(sandbox_id).box.files.mkdir(path, parents)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._live(sandbox_id).box.files.remove(path, recursive)

    async def upload_tar(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes]) -> int:
        return await self._live(sandbox_id).box.files.upload_tar(path, chunks)

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        files = self._live(sandbox_id).box.files
        async for chunk in files.download_tar(path):
            yield chunk

    # ---- grading ------------------------------------------------------------------------
    async def grade(self, sandbox_id: str, spec: GradeSpec, owner: str) -> GradeResult:
        """The grade (:meth:`_grade`), timed for the metrics."""
        t0 = time.monotonic()
        try:
            return await self._grade(sandbox_id, spec, owner)
        finally:
            backend = self.live[sandbox_id].info.backend if sandbox_id in self.live else "unknown"
            self.metrics.grade_seconds.labels(backend).observe(time.monotonic() - t0)

    async def _grade(self, sandbox_id: str, spec: GradeSpec, owner: str) -> GradeResult:
        """Run ``spec.cmd`` in a fresh sandbox made of this sandbox's pristine layers plus
        ``spec.layers``, into which only the declared files are copied (regular files and
        directories; links are not carried over, so nothing copied can redirect a write to the
        grader's own files). The grader is deleted afterwards, also on failure."""
        src = self._live(sandbox_id)
        extra = [d for name in spec.layers for d in self._image_for(name, owner).layers]
        declared: list[tuple[str, FileStat]] = []
        for path in spec.files:  # all declared files must exist before a grader is spent
            st = await self.file_stat(sandbox_id, path)
            if st.type not in ("file", "dir"):
                raise BadRequest(f"declared file {path!r} is a {st.type}; only files and "
                                 "directories are carried over")
            declared.append((path, st))
        config = self._image_config(src.info)
        gspec = SandboxSpec(image=src.info.image, resources=spec.resources or src.info.resources,
                            ttl_s=spec.timeout_s + 300, labels={"rollbox.grader-of": sandbox_id},
                            env=spec.env, disk_tier=src.info.disk_tier,
                            backend=src.info.backend, qos="latency")
        grader = await self._admitted_create(gspec, owner, config,
                                             list(src.info.layers) + extra, share="reserved")
        try:
            copied = 0
            gfs = self._live(grader.id).box.files
            for path, st in declared:
                try:
                    await gfs.remove(path, True)  # the pristine copy goes
                except NotFound:
                    pass
                budget = spec.max_bytes - copied
                try:
                    if st.type == "file":
                        copied += await gfs.write_stream(
                            path, self.file_read_stream(sandbox_id, path, budget),
                            st.mode & 0o7777)
                    else:
                        copied += await gfs.upload_tar(
                            path, _capped(self.download_tar(sandbox_id, path), budget),
                            links=False)
                except DiskFull as exc:
                    disk_mib = gspec.resources.disk_mib
                    raise DiskFull(f"declared files do not fit in the grader's {disk_mib} MiB "
                                   "disk", path=path, disk_mib=disk_mib) from exc
            exec_id = await self.exec_start(grader.id, ExecSpec(
                cmd=spec.cmd, cwd=spec.cwd, env=spec.env, timeout_s=spec.timeout_s))
            result = await self.exec_wait(grader.id, exec_id)
        finally:
            try:
                await self.delete(grader.id)
            except RollboxError:
                log.exception("grader %s of %s: delete failed", grader.id, sandbox_id)
        return GradeResult(sandbox_id=sandbox_id, grader_id=grader.id, files=spec.files,
                           copied_bytes=copied, result=result)

    # ---- fork: n copies of one sandbox ----------------------------------------------------
    async def fork(self, sandbox_id: str, spec: ForkSpec, owner: str) -> ForkResult:
        """``spec.n`` new sandboxes of ``owner`` with the live (or paused) sandbox's filesystem
        state, env, hidden paths, network policy, resources, image and layers; labels
        inherited + ``spec.labels`` + ``fork_of``; its job and its deadline (a child lives no
        longer than its source may). Admitted all at once against the project's quota and
        the node's budgets (nothing made when any one does not fit), then through the node's
        create-concurrency cap (one permit per child, at most the whole cap, within the
        create queue's timeout); made by the backend (``Backend.fork``: all or none).
        Children are on this node (the source's). With ``spec.idempotency_key``: a retry
        returns the children the first attempt made (those still live; one under way is
        joined), never n more; the same key for another source or spec while one lives is
        IdempotencyConflict."""
        key = spec.idempotency_key
        if key is None:
            return await self._fork(sandbox_id, spec, owner)
        made = await self._keyed_fork(sandbox_id, spec, owner, key)
        if made is not None:
            return made
        ident = (owner, key)
        result = await _joinable(self._fork_starts, ident, self._fork(sandbox_id, spec, owner))
        self._fork_specs[ident] = (sandbox_id, spec.model_dump(exclude={"idempotency_key"}),
                                   result.frozen_s, result.duration_s)
        return result

    async def _keyed_fork(self, sandbox_id: str, spec: ForkSpec, owner: str,
                          key: str) -> ForkResult | None:
        """The live children ``owner`` forked under ``key`` (None: none, or that fork
        failed), after checking they were asked for from the same source with the same
        spec; waits for such a fork under way."""
        ident = (owner, key)
        if ident not in self._fork_keys and ident in self._fork_starts:
            try:
                await asyncio.shield(self._fork_starts[ident])
            except Exception:  # noqa: BLE001 - that fork failed: this one tries again
                return None
        ids = [i for i in self._fork_keys.get(ident, [])
               if i in self.live and i not in self._deleting]
        if not ids:
            return None
        recorded = self._fork_specs.get(ident)
        source = self.live[ids[0]].info.labels.get(FORK_OF_LABEL)
        asked = spec.model_dump(exclude={"idempotency_key"})
        if source != sandbox_id or (recorded is not None and recorded[1] != asked):
            raise IdempotencyConflict(
                f"idempotency key {key!r} was used for another fork (of {source}, children "
                f"{', '.join(ids)})", sandbox_id=source, idempotency_key=key)
        frozen_s, duration_s = (recorded[2], recorded[3]) if recorded is not None else (0, 0)
        return ForkResult(source_id=sandbox_id,
                          children=[self.live[i].info.model_copy() for i in ids],
                          frozen_s=frozen_s, duration_s=duration_s)

    async def _fork(self, sandbox_id: str, spec: ForkSpec, owner: str) -> ForkResult:
        t0 = time.monotonic()
        live = self._live(sandbox_id)
        src = live.info
        n = spec.n
        cap = live.backend.capacity()
        if not cap.fork:
            raise BadRequest(f"backend {src.backend!r} can not fork sandboxes on node "
                             f"{self.node_id}", backend=src.backend, sandbox_id=sandbox_id)
        most = min(self.settings.fork_max_children, MAX_FORK_CHILDREN)
        if not 1 <= n <= most:
            raise BadRequest(f"fork n={n}: between 1 and {most} children per fork on node "
                             f"{self.node_id}", n=n, limit=most)
        if live.platform or any(k.startswith(PLATFORM_LABEL_PREFIX) for k in spec.labels):
            raise BadRequest("the platform's own sandboxes and labels starting with "
                             f"{PLATFORM_LABEL_PREFIX!r} can not be forked or given",
                             sandbox_id=sandbox_id)
        labels = {**src.labels, **spec.labels, FORK_OF_LABEL: sandbox_id}
        if len(labels) > 64:
            raise BadRequest(f"a child would have {len(labels)} labels (at most 64)",
                             labels=len(labels))
        gap = self.fence.expired()
        if gap is not None:
            raise CapacityExceeded(f"node {self.node_id} is fenced: no watcher probed it for "
                                   f"{gap:.0f} s", reason="fenced")
        if self.draining:
            raise CapacityExceeded(f"node {self.node_id} is draining: no new sandbox",
                                   reason="draining")
        self._last_request = time.monotonic()  # the refill waits for the children
        quota = self.quotas.get(owner) if self.quotas is not None else None
        tickets = await self._admit_evicting(
            lambda: self.admission.try_admit_many(src.resources, owner, n, quota,
                                                  fds=self._edge_fds(src)))
        self._starting += n
        infos: list[SandboxInfo] = []
        permits = 0
        try:
            try:
                async with self._fork_permits, \
                        asyncio.timeout(self.limits.create_queue_timeout_s):
                    for _ in range(min(n, self._create_sem_size)):
                        await self._create_sem.acquire()
                        permits += 1
            except TimeoutError:
                raise CapacityExceeded("node busy: creation queue timed out",
                                       reason="create_queue", requested=n) from None
            net = live.box.network
            env = {k: v for k, v in live.box.image_env.items()
                   if net is None or k not in net.env}
            now = time.time()
            for _ in range(n):
                info = SandboxInfo(
                    id=f"{self.node_id}-{secrets.token_hex(6)}", node=self.node_id,
                    image=src.image, layers=list(src.layers), state="creating",
                    created_at=now, expires_at=src.expires_at, labels=dict(labels),
                    resources=src.resources, owner=owner, hidden_paths=list(src.hidden_paths),
                    network=src.network, job=src.job, disk_tier=src.disk_tier,
                    backend=src.backend, qos=src.qos, on_expiry=src.on_expiry,
                    resume_on_traffic=src.resume_on_traffic, ttl_s=src.ttl_s,
                    pause_keep_memory=src.pause_keep_memory,
                    fork_key=spec.idempotency_key, vm_console=src.vm_console)
                self.journal.put(info, extra={"env": env})
                infos.append(info)
            async with live.freeze_lock:
                self._check_freezable(live)
                if sandbox_id not in self.live or sandbox_id in self._deleting:
                    raise SandboxDead(f"sandbox {sandbox_id} went away")
                try:
                    made = await live.backend.fork(
                        live.box, [(i.id, self._spec_of(i, {"env": env})) for i in infos],
                        paused=src.state == "paused")
                except (InfraError, OSError):
                    if sandbox_id not in self.live or sandbox_id in self._deleting:
                        raise SandboxDead(f"sandbox {sandbox_id} went away during the "
                                          "fork") from None
                    raise
        except BaseException as exc:
            for info in infos:
                self._mark_dead(info, f"creation failed: {exc}", state="deleted")
            for t in tickets:
                self.admission.release(t)
            raise
        finally:
            self._starting -= n
            for _ in range(permits):
                self._create_sem.release()
        for info, box, ticket in zip(infos, made.children, tickets):
            info.state = "running"
            info.guest_reported = box.guest_reported
            extra = None
            if box.network is not None:
                box.image_env.update(box.network.env)
                extra = {"env": box.image_env}
            self.journal.put(info, backend_state=box.state(), extra=extra)
            self._register(info, box, live.backend, ticket)
            self.admission.started(ticket)
            self.event_log.append(info.id, "sandbox.created", data=json.dumps(
                {"image": info.image, "layers": info.layers, "owner": owner, "job": info.job,
                 "fork_of": sandbox_id}))
        sudo = sudo_uids(self._image_config(src))
        for info, box in zip(infos, made.children):
            await self._enable_sudo(info.id, box, sudo)
        self.event_log.append(sandbox_id, "sandbox.forked", data=json.dumps(
            {"children": [i.id for i in infos], "frozen_s": round(made.frozen_s, 6)}))
        return ForkResult(source_id=sandbox_id, children=[i.model_copy() for i in infos],
                          frozen_s=round(made.frozen_s, 6),
                          duration_s=round(time.monotonic() - t0, 6))

    # ---- snapshots (pack_diff) ----------------------------------------------------------
    async def snapshot(self, sandbox_id: str, spec: SnapshotSpec, owner: str) -> SnapshotResult:
        """The sandbox's writable layer, scrubbed, becomes a new layer; ``spec.name`` is tagged
        as the sandbox's layers + that layer (see rollbox.images.snapshot). With ``pause`` the
        sandbox is frozen during the copy and thawed after, also on failure."""
        from rollbox.images import snapshot as snap
        from rollbox.images.chunks import default_store_url, open_store, push_image

        live = self._live(sandbox_id)
        project_image_name(spec.name)
        # Image names are node-wide: a snapshot never replaces an image (e.g. python:3.11)
        # that other sandboxes are created from.
        if self.store.exists(spec.name):
            raise BadRequest(f"image {spec.name!r} already exists; pick a new name",
                             image=spec.name)
        exclude = snap.validate_patterns(spec.exclude)
        push_url = (snap.allowed_push_url(spec.push, default_store_url(self.settings),
                                          self.settings.snapshot_push_stores)
                    if spec.push else None)
        if sandbox_id in self._snapshotting:
            raise BadRequest(f"a snapshot of sandbox {sandbox_id} is already running")
        if live.backend.capacity().snapshot == "machine":
            if spec.exclude or spec.push:
                raise BadRequest(f"sandbox {sandbox_id} is a {live.info.backend} sandbox: its "
                                 "snapshot is the whole machine (disk + memory), so exclude "
                                 "and push do not apply", backend=live.info.backend)
            return await self._machine_snapshot(live, spec, owner)
        room = self.storage.room(owner)  # the project's layer storage and the store's reserve
        max_bytes = min(spec.max_bytes, room.bytes)
        self._snapshotting.add(sandbox_id)
        t0 = time.monotonic()
        try:
            config = self._image_config(live.info)
            staging = self.store.staging_dir("snapshot")
            root = staging / "rootfs"
            # A paused sandbox is frozen already and stays so after the copy.
            opts = CaptureOptions(
                pause=spec.pause and live.info.state != "paused",
                scrub=snap.DEFAULT_SCRUB if spec.scrub else [], exclude=exclude,
                max_bytes=max_bytes, max_entries=spec.max_entries,
                complete_repos=not spec.keep_git_history)
            try:
                try:
                    captured = await live.backend.capture_writable(live.box, root, opts)
                except PayloadTooLarge as exc:
                    if max_bytes < spec.max_bytes and exc.details.get("limit") == max_bytes:
                        raise room.error from exc
                    raise
                except (OSError, InfraError) as exc:
                    if sandbox_id not in self.live or sandbox_id in self._deleting:
                        raise SandboxDead(f"sandbox {sandbox_id} went away during the "
                                          "snapshot") from None
                    err = (exc if isinstance(exc, InfraError)
                           else InfraError(f"snapshot of {sandbox_id} failed: {exc}"))
                    raise without_paths(err, {root: "/", staging: "<staging>"}) from exc
                stats = captured.stats
                paused = captured.copy_s if spec.pause else 0.0
                if sandbox_id not in self.live or sandbox_id in self._deleting:
                    raise SandboxDead(f"sandbox {sandbox_id} went away during the snapshot")
                try:  # git's and mkfs.erofs's messages name the staging dir
                    digest, repos = await asyncio.to_thread(
                        snap.layer_from_capture, self.store, root,
                        source=f"snapshot:{sandbox_id}", scratch=staging,
                        keep_git_history=spec.keep_git_history)
                except RollboxError as exc:
                    raise without_paths(exc, {root: "/", staging: "<staging>"}) from None
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
            layers = list(live.info.layers) + [digest]
            await self.storage.commit(owner, spec.name, layers, config, digest)
            if push_url is not None:
                await push_image(self.store, spec.name, open_store(push_url))
        finally:
            self._snapshotting.discard(sandbox_id)
        result = SnapshotResult(
            sandbox_id=sandbox_id, image=spec.name, layer=digest, layers=layers,
            size=int(self.store.layer_meta(digest)["size"]), files=stats.entries,
            content_bytes=stats.bytes, whiteouts=stats.whiteouts, scrubbed=stats.scrubbed,
            git_repos_scrubbed=[r.path for r in repos if not r.history_kept],
            git_repos=repos, paused_s=round(paused, 6),
            duration_s=round(time.monotonic() - t0, 6), pushed_to=push_url,
            hidden_paths=list(live.info.hidden_paths))
        self.event_log.append(sandbox_id, "sandbox.snapshot", data=json.dumps(
            {"image": spec.name, "layer": digest, "files": stats.entries, "by": owner}))
        return result

    async def _machine_snapshot(self, live: LiveSandbox, spec: SnapshotSpec,
                                owner: str) -> SnapshotResult:
        """A "vm" sandbox's snapshot: its backend keeps disk + memory (``save_machine``) and
        ``spec.name`` is tagged as the source's layers with the snapshot's id in its config
        (``machine_snapshot``): creating from it restores the machine, on this backend only
        (:meth:`_new_sandbox`); deleting the image removes the snapshot's files."""
        sandbox_id = live.info.id
        snapshot_id = secrets.token_hex(16)
        self._snapshotting.add(sandbox_id)
        t0 = time.monotonic()
        try:
            async with live.freeze_lock:
                try:
                    saved = await live.backend.save_machine(
                        live.box, snapshot_id, self._spec_of(live.info, {"env": {}}),
                        paused=live.info.state == "paused")
                except (OSError, InfraError) as exc:
                    if sandbox_id not in self.live or sandbox_id in self._deleting:
                        raise SandboxDead(f"sandbox {sandbox_id} went away during the "
                                          "snapshot") from None
                    if isinstance(exc, InfraError):
                        raise
                    raise InfraError(f"snapshot of {sandbox_id} failed: {exc}") from exc
            layers = list(live.info.layers)
            config = {**self._image_config(live.info), "machine_snapshot": {
                "id": snapshot_id, "backend": live.info.backend, "source": sandbox_id,
                "resources": live.info.resources.model_dump(),
                "network": live.info.network is not None}}
            try:
                await self.storage.commit(owner, spec.name, layers, config, None)
            except BaseException:
                await asyncio.to_thread(live.backend.drop_machine, snapshot_id)
                raise
        finally:
            self._snapshotting.discard(sandbox_id)
        result = SnapshotResult(
            sandbox_id=sandbox_id, image=spec.name, kind="machine", layer=None, layers=layers,
            size=saved.state_bytes + saved.disk_bytes, memory_bytes=saved.state_bytes,
            files=0, content_bytes=0, whiteouts=0, scrubbed=0,
            paused_s=round(saved.frozen_s, 6), duration_s=round(time.monotonic() - t0, 6),
            hidden_paths=list(live.info.hidden_paths))
        self.event_log.append(sandbox_id, "sandbox.snapshot", data=json.dumps(
            {"image": spec.name, "kind": "machine", "snapshot": snapshot_id, "by": owner}))
        return result

    def _drop_unreferenced_machines(self) -> None:
        """Node start: machine snapshots no image names any more (an image removed by the
        operator's ``rollbox image rm``, a save an earlier edge did not finish) are removed."""
        named = {str(i.config["machine_snapshot"].get("id")) for i in self.store.list()
                 if isinstance(i.config.get("machine_snapshot"), dict)}
        for kind, backend in self.backends.items():
            if backend.capacity().snapshot != "machine":
                continue
            try:
                for snapshot_id in backend.machine_snapshots() - named:
                    log.info("machine snapshot %s of backend %s has no image: removed",
                             snapshot_id, kind)
                    backend.drop_machine(snapshot_id)
            except (OSError, InfraError) as exc:  # the pool: the next start tries again
                log.error("machine snapshots of backend %s not checked: %s", kind, exc)

    # ---- images of a project (uploads, layer storage; rollbox.edge.storage) --------------
    def _layer_quota_mib(self, project: str) -> int | None:
        """The project's ``layer_mib`` quota (None: the node's ``project_layer_mib``)."""
        return self.quotas.get(project).layer_mib if self.quotas is not None else None

    async def image_upload(self, name: str, chunks: AsyncIterator[bytes], owner: str,
                           base: str | None = None) -> ImageInfo:
        """Image ``name`` of project ``owner``: ``base``'s layers (one the project may use) +
        one layer built here from the tar stream ``chunks``."""
        image = self._image_for(base, owner) if base is not None else None
        return await self.storage.upload(owner, name, chunks, image)

    async def image_list(self, owner: str | None) -> list[ImageInfo]:
        return await asyncio.to_thread(self.storage.visible, owner)

    async def image_delete(self, name: str, owner: str | None) -> None:
        image = await asyncio.to_thread(self.storage.delete, name, owner)
        snap = image.config.get("machine_snapshot")
        if isinstance(snap, dict) and snap.get("backend") in self.backends:
            await asyncio.to_thread(self.backends[snap["backend"]].drop_machine,
                                    str(snap.get("id")))

    async def image_usage(self, owner: str) -> LayerUsage:
        return await asyncio.to_thread(self.storage.usage, owner)

    # ---- events -------------------------------------------------------------------------
    async def events(self, sandbox_id: str, after_seq: int,
                     follow: bool) -> AsyncIterator[Event]:
        async for ev in self.event_log.stream(sandbox_id, after_seq, follow):
            yield ev

    async def record_event(self, sandbox_id: str, kind: str, data: str) -> None:
        self.event_log.append(sandbox_id, kind, data=data)

    # ---- computer use (backend "vm": docs/backends/vm.md) -------------------------------
    def _display(self, sandbox_id: str) -> Display:
        """The screen of a running sandbox; BadRequest for a backend without one."""
        live = self._running(sandbox_id)
        screen = live.backend.display(live.box)
        if screen is None:
            raise BadRequest(f"sandbox {sandbox_id} is a {live.info.backend} sandbox: screens, "
                             "mouse and keyboard are the \"vm\" backend's",
                             reason="no_display", backend=live.info.backend)
        return screen

    async def screenshot(self, sandbox_id: str, format: str = "png") -> bytes:
        """The screen as PNG bytes (drawn by the guest: evidence of nothing); recorded in
        the event log with its size and sha256."""
        if format != "png":
            raise BadRequest(f"screenshot format {format!r}: only png", reason="format")
        data = await self._display(sandbox_id).screenshot()
        self.event_log.append(sandbox_id, "computer.screenshot", data=json.dumps(
            {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
        return data

    async def display_info(self, sandbox_id: str) -> DisplayInfo:
        return await self._display(sandbox_id).info()

    async def computer_action(self, sandbox_id: str,
                              action: ComputerAction) -> ComputerActionResult:
        """One mouse or keyboard action, checked by the backend first (BadRequest: nothing
        sent), then recorded in the event log as ``computer.<action>`` (its arguments, the
        display it was checked against, the screen's hash if asked), like a command."""
        screen = self._display(sandbox_id)
        takeover.agent_input(self._live(sandbox_id).info, action.action)
        result = await screen.act(action)
        record = action.model_dump(exclude_none=True, exclude={"screenshot_hash"})
        record.update(display=result.display.model_dump(), events=result.events,
                      ts=result.ts)
        if result.screenshot_sha256 is not None:
            record["screenshot_sha256"] = result.screenshot_sha256
        self.event_log.append(sandbox_id, f"computer.{action.action}",
                              data=json.dumps(record))
        return result

    async def display_open(self, sandbox_id: str, viewer: str) -> PortStream:
        """See EdgeAPI.display_open: the live view's checked RFB stream; its input reaches
        the guest only while ``viewer`` holds the screen (rollbox.edge.takeover). Recorded as
        ``computer.view``; closed with the sandbox at the latest."""
        live = self._running(sandbox_id)
        screen = self._display(sandbox_id)
        stream = await screen.live_view(lambda: takeover.viewer_input(live.info, viewer))
        if self.live.get(sandbox_id) is not live:  # deleted meanwhile
            await stream.close()
            raise SandboxDead(f"sandbox {sandbox_id} is gone", state="deleted")
        self.event_log.append(sandbox_id, "computer.view", data=json.dumps(
            {"viewer": viewer[:200]}))
        return _TrackedPort(stream, live.ports)

    async def display_takeover(self, sandbox_id: str, taken: bool, by: str) -> SandboxInfo:
        """See EdgeAPI.display_takeover: a person takes over (``taken``) or releases the
        screen's mouse and keyboard; recorded as ``computer.takeover`` / ``computer.release``
        and in the sandbox's info (``taken_over``, ``taken_over_by``, ``takeovers``: a grader
        sees them); the rule is rollbox.edge.takeover's."""
        live = self._live(sandbox_id)  # also a paused one (a person may release it then)
        if live.backend.display(live.box) is None:
            raise BadRequest(f"sandbox {sandbox_id} is a {live.info.backend} sandbox: it has "
                             "no screen to take over", reason="no_display")
        # DisplayLocked: another viewer holds it (one holder at a time)
        if not (takeover.take(live.info, by) if taken else takeover.release(live.info)):
            return live.info
        self.journal.put(live.info)
        self.event_log.append(sandbox_id, "computer.takeover" if taken else "computer.release",
                              data=json.dumps({"by": by[:200], "ts": time.time()}))
        return live.info

    # ---- the platform's own work in a sandbox -------------------------------------------
    async def platform_exec(self, sandbox_id: str, req: ExecRequest) -> PlatformProcess:
        """See EdgeAPI.platform_exec. Its session cgroup goes with the sandbox."""
        live = self._running(sandbox_id)
        await live.backend.prepare_exec(live.box)
        slot = live.box.new_session()
        try:
            return await live.box.channel.exec(req, slot.cgroup_fd)
        finally:
            _close(slot.cgroup_fd)

    # ---- exposed ports --------------------------------------------------------------------
    async def port_open(self, sandbox_id: str, port: int) -> PortStream:
        """See EdgeAPI.port_open: the backend's own path (Backend.open_port), always to the
        sandbox's loopback; the connection is closed with the sandbox at the latest."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise BadRequest(f"port must be an integer in 1..65535, not {port!r}", port=port)
        await self.wake(sandbox_id)
        live = self._running(sandbox_id)
        stream = await live.backend.open_port(live.box, port)
        if self.live.get(sandbox_id) is not live:  # deleted meanwhile
            await stream.close()
            raise SandboxDead(f"sandbox {sandbox_id} is gone", state="deleted")
        return _TrackedPort(stream, live.ports)

    async def run_shell(self, sandbox_id: str, cmd: str, env: dict[str, str], timeout_s: float,
                        tail: int = 4000, *,
                        on_output: Callable[[bytes], object] | None = None) -> tuple[int, bytes]:
        live = self._running(sandbox_id)
        await live.backend.prepare_exec(live.box)
        return await platform_work.run_shell(live.box, cmd, env, timeout_s, on_output, tail)

    # ---- images: lazy-loading counters --------------------------------------------------
    async def image_stats(self, project: str | None) -> dict[str, Any]:
        """See EdgeAPI.image_stats; a sandbox's counters say whether it is live."""
        from rollbox.images.lazy.loader import loader_for

        st = await asyncio.to_thread(loader_for(self.store, self.settings).stats,
                                     cgroup_parent=self.settings.cgroup_parent)
        sandboxes = {}
        for sid, counters in st["sandboxes"].items():
            live = self.live.get(sid)
            if project is None or (live is not None and live.info.owner == project):
                sandboxes[sid] = {**counters, "live": live is not None}
        st["sandboxes"] = sandboxes
        return st

    # ---- inspection (tests, leak checks) ------------------------------------------------
    def leftovers(self, sandbox_id: str) -> list[str]:
        # Each backend's view (kinds share the disk pool: a subvolume is named once).
        return list(dict.fromkeys(x for b in self.backends.values()
                                  for x in b.leftovers(sandbox_id)))

    async def wait_deleted(self, sandbox_id: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while sandbox_id in self.live or sandbox_id in self._deleting:
            if time.monotonic() > deadline:
                raise InfraError(f"sandbox {sandbox_id} still present")
            await asyncio.sleep(0.02)


PLATFORM_LABEL_PREFIX = "rollbox."


class _TrackedPort:
    """A backend's PortStream, in its sandbox's ``ports`` until closed."""

    def __init__(self, stream: PortStream, owner: set[PortStream]) -> None:
        self.stream = stream
        self.owner = owner
        owner.add(self)

    async def read(self) -> bytes:
        return await self.stream.read()

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def write_eof(self) -> None:
        await self.stream.write_eof()

    async def close(self) -> None:
        self.owner.discard(self)
        await self.stream.close()


_T = TypeVar("_T")


async def _joinable(starts: dict[tuple[str, str], asyncio.Future[_T]], ident: tuple[str, str],
                    work: Awaitable[_T]) -> _T:
    """Run a keyed create or fork (``work``) as the one under way for ``ident``: a retry
    meanwhile awaits its future in ``starts`` (its result, or its exception: then the retry
    tries again); the entry goes when it ends."""
    fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
    starts[ident] = fut
    try:
        result = await work
        fut.set_result(result)
        return result
    except BaseException as exc:
        fut.set_exception(exc if isinstance(exc, Exception) else InfraError("cancelled"))
        fut.exception()  # retrieved: a failed start nobody joined is not an error
        raise
    finally:
        starts.pop(ident, None)


def _held(info: SandboxInfo) -> Resources:
    """What a live sandbox holds of the node's admission budgets: its resources, or, paused
    filesystem-only, none of its CPU and memory (it still counts as a sandbox)."""
    if info.memory_kept:
        return info.resources
    return info.resources.model_copy(update={"cpus": 0.0, "memory_mib": 0})


def _share_of(info: SandboxInfo) -> Share:
    """The admission share of a journaled sandbox: graders and fncall workers are reserved."""
    if "rollbox.grader-of" in info.labels or info.labels.get("rollbox.backend") == "fncall":
        return "reserved"
    return "new"


async def _capped(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """Pass a byte stream on, failing once it exceeds ``limit`` bytes."""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"declared files exceed the {limit}-byte grading cap",
                                  limit=limit)
        yield chunk


def _close(fd: int | None) -> None:
    """Close a session's cgroup fd once the agent has it (None: the backend passes none)."""
    if fd is not None:
        os.close(fd)
