"""Warm pools of container sandboxes on one edge (``Settings.pool``; issue 17 item 2).

A pool holds sandboxes made ahead of demand, keyed by everything that changes a sandbox's
set-up (:class:`PoolKey`: backend, runtime, image, layer digests, resources, network policy,
hidden paths, disk tier, qos class and whether the node enforces it). A create whose key has a
pooled sandbox gets that one (the edge hands it out: identity, env, labels, owner, TTL, job,
quota and the event log start then); every other create is made cold as before. A pooled
sandbox is made by the same backend call as a cold one for the same key, so what its key
covers (masks, hidden paths, Landlock, seccomp, network, cgroup limits) is as strong as at a
cold create; what the key does not cover is edge-side and applied at hand-out.

Sizing: per key, an exponentially weighted count of its creates (hits and misses) with time
constant ``pool_window_s`` (about the creates of the last window); the key's target is that
count rounded up, at least ``pool_min_per_key`` while the count is above 1/2, 0 below (a key
no longer asked for decays to nothing and its sandboxes are destroyed), at most
``pool_max_per_key``, and all keys together at most ``pool_max_total``.

Refill is best effort: one sandbox at a time, only while the edge has no real create in flight
and had no create or exec start for :data:`POOL_QUIET_S` (a real create never waits behind a
refill, and a refill yields between each sandbox), its runtime process (runc, the native
launcher) spawned at SCHED_IDLE (``qos.BEST_EFFORT_SETUP``; the sandbox then gets its own
class as at any create), and a
pooled sandbox holds its admission like any other, under :data:`POOL_OWNER`, no project's:
a real create that the node refuses for want of room (:data:`ROOM_REASONS`) first evicts
pooled sandboxes (the edge's ``_admit_evicting``), so the pool never costs a real create its
room, and the node's reports count that room as free. A draining or fenced node makes none
and destroys what it holds.

Owns the pooled sandboxes between their make and their hand-out (or eviction), the demand
figures and the refill task. Must not touch: admission's budgets (the edge's callbacks admit
and release), the journal, the event log, the backends (the edge makes and destroys through
the callbacks it gives).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollbox.config import Settings
from rollbox.errors import BadRequest, CapacityExceeded, RollboxError
from rollbox.isolation.qos import BEST_EFFORT_SETUP
from rollbox.models import Resources, SandboxSpec

log = logging.getLogger(__name__)

POOL_OWNER = "rollbox.pool"  # the admission owner of pooled sandboxes (no project's)
DECAY_FLOOR = 0.5  # a key's demand below this: its target is 0
IDLE_TICK_S = 1.0  # the refill task looks at demand at least this often
# The refill starts a sandbox only after the edge had no create or exec start for this long:
# its launcher and bundle work run at normal priority and would delay a hand-out's first
# command or an episode's next step (RL steps come in bursts with think time between).
POOL_QUIET_S = 0.2
# The node's refusals an eviction of pooled sandboxes can cure: room they hold (count, requested
# memory and CPUs, live memory, the edge's descriptors). Others (grades waiting, memory
# pressure, a project's grades) are not theirs: a create refused for them keeps the pool.
ROOM_REASONS = frozenset({"sandboxes", "memory", "cpus", "memory_available", "fds"})


@dataclass(frozen=True)
class PoolKey:
    """Everything that changes how a sandbox is set up: two creates with equal keys get equal
    sandboxes from the backend; a pooled sandbox goes only to a create of its own key."""

    backend: str
    runtime: str
    image: str
    layers: tuple[str, ...]
    resources: tuple[tuple[str, Any], ...]
    network: tuple[str, ...] | None  # the allow rules (None: no network at all)
    hidden_paths: tuple[str, ...]
    disk_tier: str
    qos: str
    cpu_qos: bool

    def resolved(self) -> Resources:
        return Resources(**dict(self.resources))


def key_of(spec: SandboxSpec, layers: list[str], image_config: dict, settings: Settings
           ) -> PoolKey | None:
    """The pool key of a create (None: not poolable: another backend than the container one,
    a machine snapshot or a VM disk image, a screen console)."""
    if (spec.backend != "container" or spec.vm_console != "none"
            or image_config.get("machine_snapshot") is not None
            or image_config.get("disk_image")):
        return None
    return PoolKey(
        backend=spec.backend, runtime=settings.runtime, image=spec.image, layers=tuple(layers),
        resources=tuple(sorted(spec.resources.model_dump().items())),
        network=tuple(spec.network.allow) if spec.network is not None else None,
        hidden_paths=tuple(spec.hidden_paths), disk_tier=spec.disk_tier, qos=spec.qos,
        cpu_qos=settings.cpu_qos)


def check_capacity(settings: Settings, max_sandboxes: int, reserved_share: float,
                   memory_budget_mib: float, live_mib: int) -> None:
    """BadRequest (the edge does not start) for a pool configuration above the node's
    capacity: more pooled sandboxes than the node may hold for new creates, their default
    resources' memory above the node's memory budget for new creates, or their least start-up
    headroom (32 MiB each) above the memory sandboxes may use live (``live_mib``)."""
    from rollbox.edge.admission import MIN_HEADROOM_MIB

    s = settings
    if not (s.pool_max_total >= 0 and 0 <= s.pool_min_per_key <= s.pool_max_per_key
            and s.pool_window_s > 0):
        raise BadRequest("pool settings out of range: 0 <= pool_min_per_key <= "
                         "pool_max_per_key, pool_max_total >= 0, pool_window_s > 0",
                         reason="pool_config")
    if not s.pool:
        return
    room = max_sandboxes - int(max_sandboxes * reserved_share)
    mem = s.pool_max_total * Resources().memory_mib
    for what, asked, most in (
            ("sandboxes", s.pool_max_total, room),
            ("pool_max_per_key", s.pool_max_per_key, max(s.pool_max_total, 0)),
            ("memory_mib", mem, memory_budget_mib * (1 - reserved_share)),
            ("live_memory_mib", s.pool_max_total * MIN_HEADROOM_MIB, live_mib)):
        if asked > most:
            raise BadRequest(f"warm pool configuration above node {s.node_id}'s capacity: "
                             f"{what} {asked:g} > {most:g} (ROLLBOX_POOL_MAX_TOTAL "
                             f"{s.pool_max_total}, ROLLBOX_POOL_MAX_PER_KEY "
                             f"{s.pool_max_per_key})", reason="pool_capacity", field=what,
                             requested=asked, limit=most)


@dataclass
class Pooled:
    """One sandbox made ahead: the backend's handle and the admission it holds."""

    key: PoolKey
    sandbox_id: str
    box: Any  # rollbox.backends.base.SandboxHandle
    backend: Any  # rollbox.backends.base.Backend
    ticket: Any  # rollbox.edge.admission.Ticket, owner POOL_OWNER until hand-out
    made_at: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        closed = self.box.channel.closed
        return not closed.done()


@dataclass
class _Demand:
    score: float = 0.0
    at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)  # the image's base env (refills)


Make = Callable[[PoolKey, dict[str, str]], Awaitable[Pooled]]
Destroy = Callable[[Pooled], Awaitable[None]]


class WarmPool:
    """The pools of one edge. ``make(key, base_env)``: admit (as POOL_OWNER) and create one
    sandbox of ``key`` (CapacityExceeded: no room now); ``destroy(pooled)``: destroy it and
    release its admission; ``busy()``: how long the refill should still wait (seconds; 0: it
    may go now), while the edge has real creates in flight or was asked something lately."""

    def __init__(self, settings: Settings, make: Make, destroy: Destroy,
                 busy: Callable[[], float], clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._make = make
        self._destroy = destroy
        self._busy = busy
        self.clock = clock
        self.ready: dict[PoolKey, list[Pooled]] = {}
        self.demand: dict[PoolKey, _Demand] = {}
        self._making: dict[PoolKey, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ops: set[asyncio.Task] = set()
        self.closed = False
        # counters (metrics): hand-outs, creates of poolable keys made cold, sandboxes made
        # ahead, refills that failed, pooled sandboxes destroyed unused (by why)
        self.hits = 0
        self.misses = 0
        self.made = 0
        self.refill_failures = 0
        self.evicted: dict[str, int] = {"room": 0, "demand": 0, "dead": 0, "stop": 0,
                                        "drain": 0, "fence": 0}

    # ---- demand ---------------------------------------------------------------------------
    def _score(self, key: PoolKey, now: float) -> float:
        d = self.demand.get(key)
        if d is None:
            return 0.0
        return d.score * math.exp(-(now - d.at) / self.settings.pool_window_s)

    def note(self, key: PoolKey, base_env: dict[str, str], weight: float = 1.0) -> None:
        """A create of ``key`` (hit or miss): its demand grows by ``weight`` (one create; a
        pre-warming asks for as many as it makes); the refill wakes."""
        now = self.clock()
        score = self._score(key, now) + weight
        self.demand[key] = _Demand(score, now, dict(base_env))
        self._wake.set()

    def target(self, key: PoolKey) -> int:
        s = self.settings
        score = self._score(key, self.clock())
        if score < DECAY_FLOOR:
            return 0
        return max(s.pool_min_per_key, min(s.pool_max_per_key, math.ceil(score)))

    def size(self) -> int:
        return sum(len(v) for v in self.ready.values())

    def sandboxes(self) -> list[Pooled]:
        """Every pooled sandbox now (all keys)."""
        return [p for v in self.ready.values() for p in v]

    # ---- hand-out -------------------------------------------------------------------------
    def take(self, key: PoolKey) -> Pooled | None:
        """A pooled sandbox of exactly ``key`` (the oldest), or None. A dead one found on the
        way is destroyed."""
        boxes = self.ready.get(key)
        while boxes:
            p = self._pop(key)
            if p.key != key:  # never: the dict is keyed by it; checked all the same
                raise AssertionError("pooled sandbox under another key")
            if p.alive():
                self.hits += 1
                self._wake.set()
                return p
            self.evicted["dead"] += 1
            self._spawn(self._destroy(p))
        self.ready.pop(key, None)
        self.misses += 1
        self._wake.set()
        return None

    def put_back(self, p: Pooled) -> None:
        """A hand-out that did not happen (e.g. the project's quota): the sandbox, unchanged,
        goes back to its key's pool."""
        self.hits -= 1
        self.ready.setdefault(p.key, []).insert(0, p)

    def _pop(self, key: PoolKey) -> Pooled:
        """The oldest pooled sandbox of ``key`` (there is one), out of the pool; an emptied
        key leaves ``ready``."""
        boxes = self.ready[key]
        p = boxes.pop(0)
        if not boxes:
            del self.ready[key]
        return p

    # ---- room -----------------------------------------------------------------------------
    def _victim(self) -> Pooled | None:
        """The pooled sandbox to give room back first: of the key least in demand, oldest."""
        keys = [k for k, v in self.ready.items() if v]
        if not keys:
            return None
        now = self.clock()
        return self._pop(min(keys, key=lambda k: self._score(k, now)))

    async def evict_one(self, why: str = "room") -> bool:
        """Destroy one pooled sandbox (releasing its admission); False: the pool is empty."""
        p = self._victim()
        if p is None:
            return False
        self.evicted[why] += 1
        await self._destroy_to_the_end(p)
        return True

    async def discard(self, p: Pooled) -> None:
        """Destroy a taken sandbox whose hand-out failed (releasing its admission), to the
        end even if the caller is cancelled."""
        await self._destroy_to_the_end(p)

    def evict_all(self, why: str) -> int:
        """Destroy every pooled sandbox in the background (their admissions released as each
        ends; ``close`` waits for them); returns how many."""
        n = 0
        while self.ready:
            p = self._pop(next(iter(self.ready)))
            self.evicted[why] += 1
            self._spawn(self._destroy(p))
            n += 1
        return n

    # ---- refill ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.settings.pool and self._task is None:
            self._task = asyncio.create_task(self._refill_loop())

    async def stop_refill(self) -> None:
        """No background refill or trim from now on: only what ``fill`` makes is pooled
        (benchmarks and tests that need to know which sandbox a create gets)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
            self._task = None

    async def _refill_loop(self) -> None:
        while not self.closed:
            try:
                async with asyncio.timeout(IDLE_TICK_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.refill()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop goes on; the next tick tries again
                log.exception("warm pool refill")

    def _deficits(self) -> list[tuple[int, PoolKey]]:
        out = []
        room = self.settings.pool_max_total - self.size() - sum(self._making.values())
        for key in list(self.demand):
            want = self.target(key)
            have = len(self.ready.get(key, ())) + self._making.get(key, 0)
            if want == 0 and have == 0 and self._score(key, self.clock()) < 0.01:
                del self.demand[key]  # forgotten
            elif want > have and room > 0:
                out.append((want - have, key))
        out.sort(key=lambda x: -x[0])
        return out

    async def trim(self) -> int:
        """Destroy pooled sandboxes above their key's target (keys no longer asked for
        first); returns how many."""
        n = 0
        for key in list(self.ready):
            extra = len(self.ready.get(key, ())) - self.target(key)
            while extra > 0 and self.ready.get(key):
                p = self._pop(key)
                self.evicted["demand"] += 1
                await self._destroy_to_the_end(p)
                extra -= 1
                n += 1
        return n

    async def refill(self, until_idle: bool = True) -> int:
        """Make sandboxes for the keys below their target, one at a time, yielding to real
        creates; returns how many were made."""
        await self.trim()
        made = 0
        while not self.closed:
            while (wait := self._busy()) > 0 and not self.closed:  # a real create goes first
                await asyncio.sleep(wait)
            if self.closed:
                return made
            deficits = self._deficits()
            if not deficits:
                return made
            key = deficits[0][1]
            token = BEST_EFFORT_SETUP.set(True)  # its runc / launcher at SCHED_IDLE
            try:
                if not await self.fill(key, 1):
                    return made
            finally:
                BEST_EFFORT_SETUP.reset(token)
            made += 1
            await asyncio.sleep(0)  # a waiting create or exec runs before the next one
            if not until_idle:
                return made
        return made

    async def fill(self, key: PoolKey, n: int, base_env: dict[str, str] | None = None
                   ) -> list[str]:
        """Make ``n`` sandboxes of ``key`` now (bounded by pool_max_total); returns their ids.
        A refusal of the node's admission stops it quietly (no room: nothing to pool)."""
        env = base_env if base_env is not None else (
            self.demand[key].env if key in self.demand else {})
        made: list[str] = []
        for _ in range(n):
            if self.closed or self.size() + sum(self._making.values()) \
                    >= self.settings.pool_max_total:
                break
            self._making[key] = self._making.get(key, 0) + 1
            try:
                p = await self._make_to_the_end(key, env)
            except CapacityExceeded:
                break
            except RollboxError as exc:
                self.refill_failures += 1
                log.warning("warm pool: a sandbox of %s could not be made: %s", key.image, exc)
                break
            finally:
                self._making[key] -= 1
                if not self._making[key]:
                    del self._making[key]
            if self.closed:
                await self._destroy_to_the_end(p)
                break
            self.ready.setdefault(key, []).append(p)
            self.made += 1
            made.append(p.sandbox_id)
        return made

    async def _make_to_the_end(self, key: PoolKey, env: dict[str, str]) -> Pooled:
        """``make``, never cut off halfway: cancelled (the refill stopped, the edge closing),
        the sandbox under way is finished, destroyed, and the cancellation goes on."""
        made = asyncio.ensure_future(self._make(key, env))  # not in _ops: awaited here
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            try:
                p = await made
            except Exception:  # noqa: BLE001 - it failed on its own: nothing to destroy
                raise asyncio.CancelledError from None
            await self._destroy_to_the_end(p)
            raise

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._ops.add(task)
        task.add_done_callback(self._ops.discard)
        return task

    async def _destroy_to_the_end(self, p: Pooled) -> None:
        """``destroy``, never cut off halfway (a cancelled caller leaves it running; ``close``
        waits for it): a half-destroyed sandbox would be in no list, and leak."""
        await asyncio.shield(self._spawn(self._destroy(p)))

    async def close(self) -> None:
        """Stop the refill and destroy every pooled sandbox (they are not journaled: nothing of
        them may outlive the edge)."""
        self.closed = True
        await self.stop_refill()
        while await self.evict_one("stop"):
            pass
        if self._ops:
            await asyncio.gather(*self._ops, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        return {"size": self.size(), "keys": len(self.ready), "hits": self.hits,
                "misses": self.misses, "made": self.made,
                "refill_failures": self.refill_failures, "evicted": dict(self.evicted)}
