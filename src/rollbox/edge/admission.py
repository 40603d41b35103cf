"""Admission: whether this node takes one more sandbox now.

Requests set a sandbox's limits, not reservations. A sandbox is admitted when
- the node's budgets allow it: sandbox count, and the sums of requested memory and CPUs under a
  configurable overcommit of the host (``Settings.memory_overcommit``, ``cpu_overcommit``);
- live use allows it: host ``MemAvailable`` minus the headroom promised to sandboxes that have
  not faulted their memory in yet (in-flight creates and ones started within ``SETTLE_S``)
  stays above the node reserve; and memory PSI (``/proc/pressure/memory``, where the kernel has
  it) is below ``Settings.memory_psi_max``;
- its project's quota (``rollbox.models.Quota``) allows it. Reserved admissions of a project
  (its grades) are counted apart and bounded by the same quota again: a project at its quota can
  still grade every one of its sandboxes at once, but grades are no way around the quota.
A share of every budget (``Settings.reserved_share``) is kept for grades and fncall workers
("reserved" admissions): new creates are refused once only that share is left, or while a
reserved admission waits; reserved admissions wait (up to the create queue timeout) for room,
so a node full of episodes waiting to grade always drains.

Owns the budgets, the per-project usage of this node, and the cached reading of host memory.
Refuses with ``CapacityExceeded`` (retryable) or ``QuotaExceeded``. Does not create sandboxes,
limit cgroups (``isolation.cgroups.set_memory_limit``) or store quotas: the edge is given them
as :class:`ProjectQuotas` (``iam.quotas`` implements it, above the edge).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rollbox.config import Settings
from rollbox.edge.interface import Share
from rollbox.errors import CapacityExceeded, QuotaExceeded
from rollbox.isolation import cgroups
from rollbox.models import Quota, Resources

# Host memory is read at most this often (a create costs a dict lookup, not a file read).
SAMPLE_INTERVAL_S = 0.1
# A started sandbox's memory shows in MemAvailable within about this time; until then the
# headroom promised to it is counted as used.
SETTLE_S = 3.0
# Least headroom promised to a starting sandbox (agent, shell, page tables, first pages).
MIN_HEADROOM_MIB = 32
# Descriptors the edge process holds per live idle sandbox at the least (a container without
# network: its agent channel's socket and its root's O_PATH fd; a slot's user namespace fd only
# for the last isolation.userns.USERNS_CACHED slots); each kind says its own per spec
# (Backend.edge_fds: a networked container holds 6), and admission counts them against the
# table (RLIMIT_NOFILE - FD_RESERVE; the rest is kept for everything else: HTTP connections,
# exec streams, journals, the cached user namespaces), so a full fd table is a refused create
# (reason "fds"), not EMFILE half-way. The sandbox count is capped at the table //
# FDS_PER_SANDBOX as well (no sandbox holds fewer).
FDS_PER_SANDBOX = 2
FD_RESERVE = 1024


class ProjectQuotas(Protocol):
    """The project quotas the edge enforces (admission; ``layer_mib`` for a project's
    layers). Read on every create: answer quickly (cache)."""

    def get(self, project: str) -> Quota: ...


@dataclass
class Limits:
    """The node's budgets (from Settings; tests may change them on a live edge)."""

    max_sandboxes: int = 4096
    max_parallel_creates: int = 16
    create_queue_timeout_s: float = 30.0
    memory_overcommit: float = 160.0
    cpu_overcommit: float = 2000.0
    reserve_mib: int = 2048
    reserved_share: float = 0.10
    memory_psi_max: float = 20.0
    max_fds: int | None = None  # the edge's descriptors for sandboxes (None: not counted)

    @classmethod
    def from_settings(cls, s: Settings, host_mem_mib: int, nofile: int | None = None) -> Limits:
        """The node's budgets; ValueError for settings that make no sense (the edge does not
        start on them). ``nofile``: the edge's RLIMIT_NOFILE, which bounds the sandboxes'
        descriptors (``max_fds``, :func:`fd_budget`) and lowers ``max_sandboxes`` to
        :func:`fd_sandboxes` of it where that is fewer."""
        if not (s.max_sandboxes > 0 and s.memory_overcommit > 0 and s.cpu_overcommit > 0
                and 0 <= s.reserved_share < 1 and s.memory_psi_max >= 0
                and (s.memory_reserve_mib is None or 0 <= s.memory_reserve_mib < host_mem_mib)):
            raise ValueError(
                "admission settings out of range: max_sandboxes, memory_overcommit and "
                "cpu_overcommit > 0, 0 <= reserved_share < 1, memory_psi_max >= 0, "
                f"0 <= memory_reserve_mib < host RAM ({host_mem_mib} MiB)")
        max_sandboxes = s.max_sandboxes if nofile is None else min(s.max_sandboxes,
                                                                    fd_sandboxes(nofile))
        return cls(max_sandboxes=max_sandboxes, memory_overcommit=s.memory_overcommit,
                   cpu_overcommit=s.cpu_overcommit,
                   reserve_mib=node_reserve_mib(s, host_mem_mib),
                   reserved_share=s.reserved_share, memory_psi_max=s.memory_psi_max,
                   max_fds=None if nofile is None else fd_budget(nofile))


def fd_budget(nofile: int) -> int:
    """Descriptors an edge with ``nofile`` of them gives its live sandboxes (at least one
    sandbox's least)."""
    return max(FDS_PER_SANDBOX, nofile - FD_RESERVE)


def fd_sandboxes(nofile: int) -> int:
    """Live sandboxes an edge with ``nofile`` descriptors holds at most (each holds at least
    FDS_PER_SANDBOX; at least 1)."""
    return max(1, fd_budget(nofile) // FDS_PER_SANDBOX)


def host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


def host_share(s: Settings) -> float:
    """This node's share of the host (1.0: it has the host to itself)."""
    if s.node_memory_mib is not None:
        return min(1.0, s.node_memory_mib / host_memory_mib())
    return s.node_share


def node_memory_mib(s: Settings) -> int:
    """The memory this node's admission counts: ``node_memory_mib``, else its
    ``node_share`` of the host's (several edges on one host each count their own share)."""
    if s.node_memory_mib is not None:
        return s.node_memory_mib
    return max(1, int(host_memory_mib() * s.node_share))


def node_cpus(s: Settings) -> float:
    """The CPUs this node's admission counts: ``node_cpus``, else its ``node_share`` of the
    host's."""
    if s.node_cpus is not None:
        return s.node_cpus
    return (os.cpu_count() or 1) * s.node_share


def node_reserve_mib(s: Settings, host_mem_mib: int) -> int:
    """Memory (of ``host_mem_mib``, the node's) sandboxes never get: max(2 GiB, 10%) unless
    configured; a node with a share of the host keeps that share of the 2 GiB floor."""
    if s.memory_reserve_mib is not None:
        return s.memory_reserve_mib
    floor = 2048 if s.node_memory_mib is None and s.node_share == 1.0 else int(2048 * host_share(s))
    return max(floor, host_mem_mib // 10)


def sandboxes_memory_max_mib(s: Settings, host_mem_mib: int) -> int:
    """The limit of the parent memory cgroup of all sandboxes: RAM minus the reserve."""
    if s.sandboxes_memory_max_mib is not None:
        return s.sandboxes_memory_max_mib
    return max(256, host_mem_mib - node_reserve_mib(s, host_mem_mib))


@dataclass(frozen=True)
class MemorySample:
    available_mib: int
    psi_some_avg10: float | None  # None: the kernel has no PSI
    sandboxes_mib: int  # charged to the sandboxes' parent cgroup
    at: float


def _meminfo_available_mib(path: Path) -> int:
    with open(path, "rb") as f:
        data = f.read()
    i = data.index(b"MemAvailable:")
    return int(data[i + 13:data.index(b"kB", i)]) >> 10


def _psi_some_avg10(path: Path) -> float | None:
    try:
        with open(path, "rb") as f:
            line = f.readline()  # "some avg10=0.00 avg60=0.00 avg300=0.00 total=736"
    except (FileNotFoundError, OSError):
        return None
    i = line.find(b"avg10=")
    return float(line[i + 6:line.index(b" ", i)]) if i >= 0 else None


class HostMemory:
    """Live host memory, read at most every ``interval_s`` (cached in between)."""

    def __init__(self, cgroup_parent: str, interval_s: float = SAMPLE_INTERVAL_S,
                 meminfo: Path = Path("/proc/meminfo"),
                 psi: Path = Path("/proc/pressure/memory"),
                 clock: Callable[[], float] = time.monotonic,
                 node_mib: int | None = None) -> None:
        """``node_mib``: the node's share of the host's memory (several edges on one host):
        what is available to it is at most that minus what its sandboxes use."""
        self.cgroup_parent = cgroup_parent
        self.node_mib = node_mib
        self.interval_s = interval_s
        self.meminfo = meminfo
        self.psi = psi
        self.clock = clock
        self._sample: MemorySample | None = None
        self.reads = 0  # file reads done (measured: at most one per interval)

    def sample(self) -> MemorySample:
        now = self.clock()
        s = self._sample
        if s is not None and now - s.at < self.interval_s:
            return s
        self.reads += 1
        usage = cgroups.memory_usage(self.cgroup_parent) or 0
        available = _meminfo_available_mib(self.meminfo)
        if self.node_mib is not None:
            available = min(available, max(0, self.node_mib - (usage >> 20)))
        s = MemorySample(available, _psi_some_avg10(self.psi), usage >> 20, now)
        self._sample = s
        return s

    def forget(self) -> None:
        self._sample = None


@dataclass
class Ticket:
    """One admitted sandbox: what it holds of the budgets until released."""

    resources: Resources
    owner: str
    share: Share
    headroom_mib: int
    fds: int = 0  # the edge's descriptors it holds (Backend.edge_fds)
    started_at: float | None = None
    released: bool = False
    settling: bool = False  # its headroom is in Admission._settling_mib


@dataclass
class _Usage:
    sandboxes: int = 0
    cpus: float = 0.0
    memory_mib: int = 0

    def add(self, r: Resources, sign: int) -> None:
        self.sandboxes += sign
        self.cpus += sign * r.cpus
        self.memory_mib += sign * r.memory_mib


@dataclass
class Admission:
    limits: Limits
    host_mem_mib: int
    host_cpus: float
    memory: HostMemory
    node_id: str = ""
    clock: Callable[[], float] = time.monotonic
    total: _Usage = field(default_factory=_Usage)
    by_owner: dict[str, _Usage] = field(default_factory=dict)  # "new" admissions only
    reserved_by_owner: dict[str, _Usage] = field(default_factory=dict)  # grades, fncall
    _starting_mib: int = 0  # headroom of tickets not started yet
    _settling: deque[tuple[float, Ticket]] = field(default_factory=deque)
    _settling_mib: int = 0
    _reserved_waiting: int = 0
    _freed: asyncio.Event | None = None
    fds: int = 0  # the edge's descriptors admitted sandboxes hold (Ticket.fds)
    # The edge's descriptors its backends hold for no sandbox (Backend.node_fds: a microVM
    # template's spare QEMUs), read at each check: they take room from the sandboxes' table.
    node_fds: Callable[[], int] = lambda: 0

    # ---- budgets ------------------------------------------------------------------------
    def budgets(self) -> dict[str, float]:
        """The node's full budgets (what reserved admissions may use; quotas are bounded by
        them)."""
        lim = self.limits
        return {"sandboxes": lim.max_sandboxes,
                "cpus": lim.cpu_overcommit * self.host_cpus,
                "memory_mib": lim.memory_overcommit * self.host_mem_mib}

    def _share_factor(self, share: Share) -> float:
        return 1.0 if share == "reserved" else 1.0 - self.limits.reserved_share

    def _reserved_sandboxes(self) -> int:
        return int(self.limits.max_sandboxes * self.limits.reserved_share)

    def pending_mib(self) -> int:
        """Headroom promised to sandboxes whose memory may not show in MemAvailable yet."""
        now = self.clock()
        while self._settling and now - self._settling[0][0] >= SETTLE_S:
            _, t = self._settling.popleft()
            if t.settling:
                t.settling = False
                self._settling_mib -= t.headroom_mib
        return self._starting_mib + self._settling_mib

    def headroom_mib(self, resources: Resources, sample: MemorySample) -> int:
        """What a new sandbox is expected to fault in soon: the mean use of the node's
        sandboxes so far, at least MIN_HEADROOM_MIB, at most its memory limit."""
        mean = sample.sandboxes_mib // self.total.sandboxes if self.total.sandboxes else 0
        return min(resources.memory_mib, max(MIN_HEADROOM_MIB, mean))

    def _check_node(self, r: Resources, share: Share, fds: int = 0) -> int:
        """Raise CapacityExceeded if the node can not take ``r`` (holding ``fds`` of the
        edge's descriptors) now; returns the headroom."""
        lim = self.limits
        where = f"node {self.node_id}" if self.node_id else "node"
        if share == "new" and self._reserved_waiting:
            raise CapacityExceeded(f"{where} is draining: grades are waiting for room",
                                   reason="reserved")
        max_sb = lim.max_sandboxes - (self._reserved_sandboxes() if share == "new" else 0)
        if self.total.sandboxes >= max_sb:
            raise CapacityExceeded(f"{where} is full ({self.total.sandboxes} sandboxes of "
                                   f"{lim.max_sandboxes})", reason="sandboxes")
        self._check_fds(fds, share)
        f = self._share_factor(share)
        b = self.budgets()
        if self.total.memory_mib + r.memory_mib > b["memory_mib"] * f:
            raise CapacityExceeded(f"{where} has no memory to promise for {r.memory_mib} MiB "
                                   f"(requests {self.total.memory_mib} MiB, "
                                   f"{lim.memory_overcommit:g}x overcommit)", reason="memory")
        if self.total.cpus + r.cpus > b["cpus"] * f:
            raise CapacityExceeded(f"{where} has no CPUs to promise for {r.cpus:g} "
                                   f"({lim.cpu_overcommit:g}x overcommit)", reason="cpus")
        sample = self.memory.sample()
        headroom = self.headroom_mib(r, sample)
        left = sample.available_mib - self.pending_mib() - headroom
        floor = lim.reserve_mib
        if share == "new":  # the reserved share of the sandboxes' memory is left to grades
            floor += int(lim.reserved_share * max(0, self.host_mem_mib - lim.reserve_mib))
        if left < floor:
            raise CapacityExceeded(
                f"{where} is short of memory ({sample.available_mib} MiB available, "
                f"{self.pending_mib()} MiB promised to starting sandboxes, reserve "
                f"{lim.reserve_mib} MiB)", reason="memory_available",
                available_mib=sample.available_mib)
        if (share == "new" and sample.psi_some_avg10 is not None
                and sample.psi_some_avg10 > lim.memory_psi_max):
            raise CapacityExceeded(f"{where} is under memory pressure (PSI some "
                                   f"{sample.psi_some_avg10:.1f}%)", reason="memory_pressure")
        return headroom

    def _fd_room(self, share: Share) -> int | None:
        """Descriptors left for sandboxes of ``share`` (None: not counted)."""
        lim = self.limits
        if lim.max_fds is None:
            return None
        most = lim.max_fds - (int(lim.max_fds * lim.reserved_share) if share == "new" else 0)
        return most - self.fds - self.node_fds()

    def _check_fds(self, fds: int, share: Share) -> None:
        room = self._fd_room(share)
        if room is not None and fds > room:
            where = f"node {self.node_id}" if self.node_id else "node"
            raise CapacityExceeded(
                f"{where}'s edge has no descriptors left for this sandbox ({fds} needed, "
                f"{max(0, room)} free of {self.limits.max_fds} for sandboxes: RLIMIT_NOFILE)",
                reason="fds", requested=fds, free=max(0, room))

    @staticmethod
    def _check_quota(usage: _Usage | None, r: Resources, quota: Quota, owner: str,
                     share: Share = "new") -> None:
        u = usage or _Usage()
        for name, have, add, cap in (("sandboxes", u.sandboxes, 1, quota.sandboxes),
                                     ("cpus", u.cpus, r.cpus, quota.cpus),
                                     ("memory_mib", u.memory_mib, r.memory_mib,
                                      quota.memory_mib)):
            if cap is None or have + add <= cap + 1e-9:
                continue
            if share == "reserved" and add <= cap + 1e-9:
                # The project's other grades hold the rest: it comes back when they end.
                raise CapacityExceeded(f"project {owner!r}: its grades running now hold its "
                                       f"quota of {name} ({have:g} of {cap:g}); retry",
                                       reason="project_grades", project=owner, field=name,
                                       limit=cap)
            raise QuotaExceeded(f"project {owner!r} quota: {name} {have:g} + {add:g} > "
                                f"{cap:g}", project=owner, field=name, limit=cap)

    # ---- admit / start / release ------------------------------------------------------
    def try_admit(self, r: Resources, owner: str, share: Share = "new",
                  quota: Quota | None = None, fds: int = FDS_PER_SANDBOX) -> Ticket:
        """Admit now or raise (QuotaExceeded first: retrying elsewhere will not help).
        ``fds``: the edge's descriptors the sandbox will hold (Backend.edge_fds)."""
        if quota is not None:
            self._check_quota(self._owners(share).get(owner), r, quota, owner, share)
        headroom = self._check_node(r, share, fds)
        return self._take(r, owner, share, headroom, fds)

    def try_admit_many(self, r: Resources, owner: str, n: int,
                       quota: Quota | None = None, fds: int = FDS_PER_SANDBOX
                       ) -> list[Ticket]:
        """``n`` new admissions of ``r`` at once (a fork's children, ``fds`` descriptors
        each), or none: the quota and the node's budgets are checked for all ``n`` together,
        then all are taken."""
        if n < 1:
            return []
        group = r.model_copy(update={"cpus": r.cpus * n, "memory_mib": r.memory_mib * n})
        if quota is not None:
            u = self.by_owner.get(owner) or _Usage()
            for name, have, add, cap in (("sandboxes", u.sandboxes, n, quota.sandboxes),
                                         ("cpus", u.cpus, group.cpus, quota.cpus),
                                         ("memory_mib", u.memory_mib, group.memory_mib,
                                          quota.memory_mib)):
                if cap is not None and have + add > cap + 1e-9:
                    raise QuotaExceeded(f"project {owner!r} quota: {name} {have:g} + {add:g} "
                                        f"> {cap:g}", project=owner, field=name, limit=cap,
                                        requested=n)
        lim = self.limits
        max_sb = lim.max_sandboxes - self._reserved_sandboxes()
        if self.total.sandboxes + n > max_sb:
            where = f"node {self.node_id}" if self.node_id else "node"
            raise CapacityExceeded(f"{where} has room for {max(0, max_sb - self.total.sandboxes)}"
                                   f" more sandboxes, not {n}", reason="sandboxes",
                                   requested=n)
        self._check_node(group, "new", n * fds)  # the budgets' sums, pressure, one headroom
        sample = self.memory.sample()
        each = self.headroom_mib(r, sample)
        floor = lim.reserve_mib + int(lim.reserved_share
                                      * max(0, self.host_mem_mib - lim.reserve_mib))
        if sample.available_mib - self.pending_mib() - n * each < floor:
            raise CapacityExceeded(
                f"node is short of memory for {n} more sandboxes ({sample.available_mib} MiB "
                f"available, {self.pending_mib()} MiB promised to starting sandboxes, "
                f"{each} MiB each)", reason="memory_available", requested=n,
                available_mib=sample.available_mib)
        return [self._take(r, owner, "new", each, fds) for _ in range(n)]

    async def admit(self, r: Resources, owner: str, share: Share = "new",
                    quota: Quota | None = None, fds: int = FDS_PER_SANDBOX) -> Ticket:
        """``try_admit``; a reserved admission that does not fit waits for room (ahead of
        every new create) up to the create queue timeout."""
        if share == "new":
            return self.try_admit(r, owner, share, quota, fds)
        deadline = self.clock() + self.limits.create_queue_timeout_s
        try:
            return self.try_admit(r, owner, share, quota, fds)
        except CapacityExceeded as exc:
            # A project's own grades holding its quota are no reason to hold the node's creates.
            if self.clock() >= deadline or exc.details.get("reason") == "project_grades":
                raise
        self._reserved_waiting += 1  # new creates are refused meanwhile
        try:
            while True:
                freed = self._freed_event()
                freed.clear()
                try:  # a release wakes it at once; live memory is polled
                    async with asyncio.timeout(SAMPLE_INTERVAL_S):
                        await freed.wait()
                except TimeoutError:
                    pass
                try:
                    return self.try_admit(r, owner, share, quota, fds)
                except CapacityExceeded as exc:
                    if self.clock() >= deadline or exc.details.get("reason") == "project_grades":
                        raise
        finally:
            self._reserved_waiting -= 1

    def _freed_event(self) -> asyncio.Event:
        if self._freed is None:
            self._freed = asyncio.Event()
        return self._freed

    def _owners(self, share: Share) -> dict[str, _Usage]:
        return self.by_owner if share == "new" else self.reserved_by_owner

    def _take(self, r: Resources, owner: str, share: Share, headroom: int,
              fds: int = FDS_PER_SANDBOX) -> Ticket:
        t = Ticket(r, owner, share, headroom, fds)
        self.fds += fds
        self.total.add(r, 1)
        self._owners(share).setdefault(owner, _Usage()).add(r, 1)
        self._starting_mib += headroom
        return t

    def transfer(self, t: Ticket, owner: str, quota: Quota | None = None) -> None:
        """A warm pool's sandbox handed out (rollbox.edge.pool): the admission it holds moves
        from the pool's owner to ``owner``, whose quota is checked now (QuotaExceeded: nothing
        moved). The node's totals do not change."""
        if quota is not None:
            self._check_quota(self.by_owner.get(owner), t.resources, quota, owner)
        old = self.by_owner.get(t.owner)
        if old is not None:
            old.add(t.resources, -1)
            if old.sandboxes <= 0:
                del self.by_owner[t.owner]
        self.by_owner.setdefault(owner, _Usage()).add(t.resources, 1)
        t.owner = owner

    def adopt(self, r: Resources, owner: str, share: Share,
              fds: int = FDS_PER_SANDBOX) -> Ticket:
        """A sandbox re-adopted after an edge restart (or paused to disk): counted, no
        headroom (it runs), never refused (it is there already)."""
        t = self._take(r, owner, share, 0, fds)
        t.started_at = self.clock()
        return t

    def resize_fds(self, t: Ticket, fds: int) -> None:
        """The sandbox of ``t`` holds ``fds`` descriptors from now on (a network attached or
        gone); CapacityExceeded (reason fds, nothing changed) for more than the table has."""
        if t.released or fds == t.fds:
            return
        if fds > t.fds:
            self._check_fds(fds - t.fds, t.share)
        self.fds += fds - t.fds
        t.fds = fds

    def started(self, t: Ticket) -> None:
        """The sandbox runs: its headroom counts for SETTLE_S more, then MemAvailable shows
        its use."""
        if t.released or t.started_at is not None:
            return
        t.started_at = self.clock()
        self._starting_mib -= t.headroom_mib
        self._settling.append((t.started_at, t))
        t.settling = True
        self._settling_mib += t.headroom_mib

    def release(self, t: Ticket) -> None:
        if t.released:
            return
        t.released = True
        self.fds -= t.fds
        self.total.add(t.resources, -1)
        owners = self._owners(t.share)
        u = owners.get(t.owner)
        if u is not None:
            u.add(t.resources, -1)
            if u.sandboxes <= 0:
                del owners[t.owner]
        if t.started_at is None:
            self._starting_mib -= t.headroom_mib
        elif t.settling:
            # Gone before MemAvailable showed its use: nothing of its promise is left.
            t.settling = False
            self._settling_mib -= t.headroom_mib
        if self._freed is not None:
            self._freed.set()

    # ---- reporting ----------------------------------------------------------------------
    def free(self, evictable: str | None = None) -> dict[str, float]:
        """Room left for new creates per budget after overcommit (the share reserved for
        grades and fncall workers kept out); all 0 while the node refuses new creates
        (grades waiting for room, memory pressure). ``evictable``: an owner whose
        admissions give their room back to any create (the warm pool's): counted as free."""
        lim = self.limits
        f = self._share_factor("new")
        b = self.budgets()
        spare = self.by_owner.get(evictable) if evictable is not None else None
        spare = spare or _Usage()
        out = {"sandboxes": float(max(0, lim.max_sandboxes - self._reserved_sandboxes()
                                      - self.total.sandboxes + spare.sandboxes)),
               "cpus": max(0.0, round(b["cpus"] * f - self.total.cpus + spare.cpus, 3)),
               "memory_mib": max(0.0, b["memory_mib"] * f - self.total.memory_mib
                                 + spare.memory_mib)}
        psi = self.memory.sample().psi_some_avg10
        if self._reserved_waiting or (psi is not None and psi > lim.memory_psi_max):
            out = {k: 0.0 for k in out}
        return out

    def live_memory_free_mib(self, reclaimable_mib: int = 0) -> int:
        """Host memory new creates may still fault in now: MemAvailable minus what starting
        sandboxes were promised, minus the node reserve and the reserved share, plus
        ``reclaimable_mib`` (memory a create gets back by evicting what holds it: the warm
        pool's, :meth:`promised_mib` of its tickets included)."""
        lim = self.limits
        sample = self.memory.sample()
        floor = lim.reserve_mib + int(lim.reserved_share
                                      * max(0, self.host_mem_mib - lim.reserve_mib))
        return max(0, sample.available_mib + reclaimable_mib - self.pending_mib() - floor)

    def promised_mib(self, tickets: Iterable[Ticket]) -> int:
        """Of the headroom counted as pending (:meth:`pending_mib`), what ``tickets`` hold:
        given back when they are released."""
        self.pending_mib()  # settled promises end first
        return sum(t.headroom_mib for t in tickets
                   if not t.released and (t.started_at is None or t.settling))

    def capacity(self) -> dict[str, object]:
        lim = self.limits
        sample = self.memory.sample()
        free_new = lim.max_sandboxes - self._reserved_sandboxes() - self.total.sandboxes
        return {
            "sandboxes": self.total.sandboxes,
            "max_sandboxes": lim.max_sandboxes,
            "free": max(0, free_new),
            "reserved_free": max(0, lim.max_sandboxes - self.total.sandboxes),
            "requested_memory_mib": self.total.memory_mib,
            "requested_cpus": round(self.total.cpus, 3),
            "memory_available_mib": sample.available_mib,
            "memory_pending_mib": self.pending_mib(),
            "memory_reserve_mib": lim.reserve_mib,
            "memory_psi_some_avg10": sample.psi_some_avg10,
            "fds": self.fds,  # the edge's descriptors its sandboxes hold
            "max_fds": lim.max_fds,
            "limits": self.budgets(),
        }
