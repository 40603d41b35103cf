"""Warm pool logic (rollbox.edge.pool) without sandboxes: the key covers every set-up field,
a pooled sandbox goes only to its own key, demand sizes the pool and decays to nothing, the
refill waits while real creates run, and the configuration is checked against capacity."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from rollbox.backends.base import ResolvedSpec
from rollbox.config import Settings
from rollbox.edge.pool import Pooled, PoolKey, WarmPool, check_capacity, key_of
from rollbox.errors import BadRequest, CapacityExceeded
from rollbox.models import NetworkPolicy, Resources, SandboxSpec


def settings(**kw: object) -> Settings:
    s = Settings()
    s.pool = True
    s.runtime = "native"
    s.cpu_qos = True
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_every_setup_field_changes_the_key() -> None:
    s = settings()
    base = key_of(SandboxSpec(image="busybox:test"), ["sha256-a"], {}, s)
    assert base is not None
    variants = {
        "image": key_of(SandboxSpec(image="debian:bookworm"), ["sha256-a"], {}, s),
        "layers": key_of(SandboxSpec(image="busybox:test"), ["sha256-a", "sha256-b"], {}, s),
        "resources": key_of(SandboxSpec(image="busybox:test", resources=Resources(pids=99)),
                            ["sha256-a"], {}, s),
        "network": key_of(SandboxSpec(image="busybox:test", network=NetworkPolicy()),
                          ["sha256-a"], {}, s),
        "hidden_paths": key_of(SandboxSpec(image="busybox:test", hidden_paths=["/x"]),
                               ["sha256-a"], {}, s),
        "disk_tier": key_of(SandboxSpec(image="busybox:test", disk_tier="memory"),
                            ["sha256-a"], {}, s),
        "qos": key_of(SandboxSpec(image="busybox:test", qos="latency"), ["sha256-a"], {}, s),
        "runtime": key_of(SandboxSpec(image="busybox:test"), ["sha256-a"], {},
                          settings(runtime="runc")),
        "cpu_qos": key_of(SandboxSpec(image="busybox:test"), ["sha256-a"], {},
                          settings(cpu_qos=False)),
    }
    # every field of the key is covered by one variant, and each variant differs only there
    assert set(variants) == {f.name for f in dataclasses.fields(PoolKey)} - {"backend"}
    # every field of the backend's spec (what a sandbox is made from) is in the key, applied
    # at hand-out, or not poolable: a new set-up field must be put in one of them
    assert {f.name for f in dataclasses.fields(ResolvedSpec)} == (
        set(SPEC_IN_KEY) | SPEC_AT_HANDOUT | SPEC_NOT_POOLABLE)
    assert set(SPEC_IN_KEY.values()) <= set(variants)
    for name, key in variants.items():
        assert key is not None and key != base, name
        diff = [f.name for f in dataclasses.fields(PoolKey)
                if getattr(key, f.name) != getattr(base, f.name)]
        assert diff == [name], (name, diff)
    # what is applied at hand-out is not in the key
    same = key_of(SandboxSpec(image="busybox:test", env={"A": "1"}, labels={"l": "v"},
                              ttl_s=5, job="j"), ["sha256-a"], {}, s)
    assert same == base
    # not poolable: other backends, machine snapshots, VM disks
    assert key_of(SandboxSpec(image="x", backend="microvm"), [], {}, s) is None
    assert key_of(SandboxSpec(image="x"), [], {"machine_snapshot": {"id": "m"}}, s) is None
    assert key_of(SandboxSpec(image="x"), [], {"disk_image": "d"}, s) is None
    assert key_of(SandboxSpec(image="x", vm_console="shell"), [], {}, s) is None


# ResolvedSpec's fields by how a pool treats them: in the key (ResolvedSpec name -> PoolKey
# name), applied to a pooled sandbox at hand-out, or never pooled (key_of gives None).
SPEC_IN_KEY = {"image": "image", "layers": "layers", "resources": "resources",
               "hidden_paths": "hidden_paths", "network_rules": "network",
               "disk_tier": "disk_tier", "qos": "qos"}
SPEC_AT_HANDOUT = {"env"}
SPEC_NOT_POOLABLE = {"machine_snapshot", "disk_image", "vm_console"}


def fake_pooled(key: PoolKey, n: int) -> Pooled:
    loop = asyncio.get_running_loop()
    box = SimpleNamespace(channel=SimpleNamespace(closed=loop.create_future()))
    return Pooled(key, f"sb{n}", box, None, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(s: Settings, busy: list[bool] | None = None, clock: Clock | None = None):  # noqa: ANN201
    made: list[Pooled] = []
    destroyed: list[str] = []
    busy = busy if busy is not None else [False]

    async def make(key: PoolKey, env: dict) -> Pooled:
        p = fake_pooled(key, len(made))
        made.append(p)
        return p

    async def destroy(p: Pooled) -> None:
        destroyed.append(p.sandbox_id)

    pool = WarmPool(s, make, destroy, lambda: 0.01 if busy[0] else 0.0, clock=clock or Clock())
    return pool, made, destroyed


async def test_take_gives_only_the_same_key_and_skips_dead_ones() -> None:
    s = settings()
    pool, made, destroyed = make_pool(s)
    a = key_of(SandboxSpec(image="a"), [], {}, s)
    b = key_of(SandboxSpec(image="b"), [], {}, s)
    assert await pool.fill(a, 2, {}) == ["sb0", "sb1"]
    assert pool.take(b) is None and pool.misses == 1
    made[0].box.channel.closed.set_result(None)  # died while pooled
    got = pool.take(a)
    assert got is made[1] and pool.hits == 1
    await asyncio.sleep(0)
    assert destroyed == ["sb0"] and pool.evicted["dead"] == 1
    assert pool.take(a) is None


async def test_demand_sizes_the_pool_and_decays_to_nothing() -> None:
    clock = Clock()
    s = settings(pool_window_s=10.0, pool_max_per_key=4, pool_min_per_key=1)
    pool, made, destroyed = make_pool(s, clock=clock)
    a = key_of(SandboxSpec(image="a"), [], {}, s)
    assert pool.target(a) == 0
    pool.note(a, {})
    assert pool.target(a) == 1
    for _ in range(9):
        pool.note(a, {})
    assert pool.target(a) == 4  # at most max_per_key
    assert await pool.refill() == 4 and pool.size() == 4
    clock.now += 10 * 3  # score 10 * e^-3 ~ 0.5: just under
    clock.now += 1
    assert pool.target(a) == 0
    assert await pool.refill() == 0
    assert pool.size() == 0 and len(destroyed) == 4 and pool.evicted["demand"] == 4


async def test_total_bound_and_refill_waits_for_real_creates() -> None:
    s = settings(pool_max_total=3, pool_max_per_key=8)
    busy = [True]
    pool, made, _ = make_pool(s, busy=busy)
    a = key_of(SandboxSpec(image="a"), [], {}, s)
    pool.note(a, {}, weight=8)
    task = asyncio.create_task(pool.refill())
    await asyncio.sleep(0.05)
    assert not made  # a real create is under way: nothing made meanwhile
    busy[0] = False
    assert await task == 3 and pool.size() == 3  # pool_max_total


async def test_refill_sleeps_until_quiet_instead_of_polling() -> None:
    """``busy`` says how long to wait: the refill sleeps that long, it does not poll."""
    s = settings()
    loop = asyncio.get_running_loop()
    quiet_at = loop.time() + 0.3
    calls = [0]

    def busy() -> float:
        calls[0] += 1
        return max(0.0, quiet_at - loop.time())

    pool, made, _ = make_pool(s)
    pool._busy = busy
    pool.note(key_of(SandboxSpec(image="a"), [], {}, s), {})
    assert await pool.refill() == 1
    assert loop.time() >= quiet_at
    assert calls[0] <= 6, calls  # polling every 2 ms would ask ~150 times


async def test_evict_all_destroys_every_pooled_sandbox() -> None:
    s = settings()
    pool, made, destroyed = make_pool(s)
    a = key_of(SandboxSpec(image="a"), [], {}, s)
    b = key_of(SandboxSpec(image="b"), [], {}, s)
    await pool.fill(a, 2, {})
    await pool.fill(b, 1, {})
    assert pool.evict_all("drain") == 3 and pool.size() == 0 and not pool.ready
    await pool.close()
    assert sorted(destroyed) == ["sb0", "sb1", "sb2"] and pool.evicted["drain"] == 3


async def test_admission_refusal_stops_a_fill_quietly() -> None:
    s = settings()

    async def make(key: PoolKey, env: dict) -> Pooled:
        raise CapacityExceeded("full", reason="sandboxes")

    async def destroy(p: Pooled) -> None:
        raise AssertionError

    pool = WarmPool(s, make, destroy, lambda: False)
    assert await pool.fill(key_of(SandboxSpec(image="a"), [], {}, s), 3, {}) == []


def test_capacity_check() -> None:
    budget = 160.0 * 8192
    check_capacity(settings(), 4096, 0.1, budget, 6000)
    check_capacity(settings(pool=False, pool_max_total=10 ** 6), 4096, 0.1, budget, 6000)
    for kw, field in (({"pool_max_total": 4000}, "sandboxes"),
                      ({"pool_max_per_key": 33}, "pool_max_per_key"),
                      ({"pool_max_total": 200}, "live_memory_mib")):
        with pytest.raises(BadRequest) as exc:
            check_capacity(settings(**kw), 4096, 0.1, budget, 6000)
        assert exc.value.details["field"] == field
    with pytest.raises(BadRequest) as exc:
        check_capacity(settings(), 4096, 0.1, 1000.0, 6000)
    assert exc.value.details["field"] == "memory_mib"
    with pytest.raises(BadRequest) as exc:
        check_capacity(settings(pool_min_per_key=9), 4096, 0.1, budget, 6000)
    assert exc.value.details["reason"] == "pool_config"


def test_best_effort_setup_spawns_the_runtime_at_sched_idle(tmp_path) -> None:  # noqa: ANN001
    import os

    from rollbox.backends.container.runtime import spawn_init_runner
    from rollbox.isolation.qos import BEST_EFFORT_SETUP

    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    for best, want in ((False, os.SCHED_OTHER), (True, os.SCHED_IDLE)):
        token = BEST_EFFORT_SETUP.set(best)
        try:
            pid = spawn_init_runner("/bin/sleep", ["sleep", "30"], {}, tmp_path / "log", [])
        finally:
            BEST_EFFORT_SETUP.reset(token)
        try:
            assert os.sched_getscheduler(pid) == want, best
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
