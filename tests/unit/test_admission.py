"""Admission budgets with a scripted host: overcommit of requests, live MemAvailable with the
headroom of starting sandboxes, PSI, the reserved share, quotas, and the cost of a check."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.config import Settings
from rollbox.edge.admission import (
    FD_RESERVE, FDS_PER_SANDBOX, MIN_HEADROOM_MIB, SETTLE_S, Admission, HostMemory, Limits,
    fd_sandboxes, node_reserve_mib, sandboxes_memory_max_mib,
)
from rollbox.models import Quota, Resources

GIB = 1024


class Host:
    """A /proc/meminfo and /proc/pressure/memory the test writes; a clock it moves."""

    def __init__(self, tmp: Path) -> None:
        self.meminfo = tmp / "meminfo"
        self.psi = tmp / "memory"
        self.now = 1000.0
        self.set(available_mib=20 * GIB, psi=0.0)

    def set(self, available_mib: int, psi: float | None = 0.0) -> None:
        self.meminfo.write_text(f"MemTotal: {24 << 20} kB\nMemFree: 1 kB\n"
                                f"MemAvailable:   {available_mib << 10} kB\nBuffers: 0 kB\n")
        if psi is None:
            self.psi.unlink(missing_ok=True)
        else:
            self.psi.write_text(f"some avg10={psi:.2f} avg60=0.00 avg300=0.00 total=1\n"
                                "full avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")

    def clock(self) -> float:
        return self.now


def make(tmp: Path, **limits: float) -> tuple[Admission, Host]:
    host = Host(tmp)
    mem = HostMemory("rollbox-unit-no-such-cgroup", meminfo=host.meminfo, psi=host.psi,
                     clock=host.clock)
    lim = Limits(**{"reserve_mib": 2 * GIB, **limits})  # type: ignore[arg-type]
    return Admission(lim, 24 * GIB, 2, mem, "u0", clock=host.clock), host


def res(mem: int = 1024, cpus: float = 1.0) -> Resources:
    return Resources(memory_mib=mem, cpus=cpus)


def test_defaults_fit_3200_default_sandboxes_and_keep_the_reserve() -> None:
    s = Settings()
    host = 24 * GIB
    lim = Limits.from_settings(s, host)
    assert lim.reserve_mib == max(2048, host // 10)
    assert sandboxes_memory_max_mib(s, host) == host - lim.reserve_mib
    new_share = 1 - lim.reserved_share
    assert lim.memory_overcommit >= 150
    assert lim.max_sandboxes * new_share >= 3200
    assert lim.memory_overcommit * host * new_share >= 3200 * Resources().memory_mib
    assert lim.cpu_overcommit * 2 * new_share >= 3200 * Resources().cpus
    s.memory_reserve_mib = 5000
    assert node_reserve_mib(s, host) == 5000


def test_the_edge_fd_table_caps_the_sandbox_count(tmp_path: Path) -> None:
    """An edge whose RLIMIT_NOFILE holds fewer sandboxes than max_sandboxes refuses the next
    create as full (reason sandboxes) instead of running out of descriptors half-way."""
    s = Settings()
    host = 24 * GIB
    assert Limits.from_settings(s, host).max_sandboxes == s.max_sandboxes  # no nofile: as set
    assert Limits.from_settings(s, host, nofile=1 << 20).max_sandboxes == s.max_sandboxes
    # this host's hard limit (20,000, not raisable without CAP_SYS_RESOURCE)
    lim = Limits.from_settings(s, host, nofile=20_000)
    assert lim.max_sandboxes == min(s.max_sandboxes, (20_000 - FD_RESERVE) // FDS_PER_SANDBOX)
    assert lim.max_sandboxes * (1 - lim.reserved_share) >= 3200
    assert fd_sandboxes(FD_RESERVE + 10 * FDS_PER_SANDBOX) == 10
    assert fd_sandboxes(10) == 1  # never 0: a tiny table still takes one
    assert lim.max_fds == 20_000 - FD_RESERVE
    small = Limits.from_settings(s, host, nofile=FD_RESERVE + 5 * FDS_PER_SANDBOX)
    small.reserved_share = 0.0
    adm, _ = make(tmp_path, max_sandboxes=small.max_sandboxes, reserved_share=0.0)
    for _ in range(5):
        adm.try_admit(res(16, 0.01), "p")
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(16, 0.01), "p")
    assert exc.value.retryable and exc.value.details["reason"] == "sandboxes"


def test_requests_overcommit_is_a_budget(tmp_path: Path) -> None:
    adm, _ = make(tmp_path, memory_overcommit=1.0, reserved_share=0.0)  # 24 GiB of requests
    tickets = [adm.try_admit(res(8 * GIB, 0.1), "p") for _ in range(3)]
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(16), "p")
    assert exc.value.retryable and exc.value.details["reason"] == "memory"
    adm.release(tickets[0])
    adm.try_admit(res(8 * GIB, 0.1), "p")
    adm2, _ = make(tmp_path / "..", cpu_overcommit=2.0, reserved_share=0.0)  # 4 CPUs
    adm2.try_admit(res(16, 3.0), "p")
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm2.try_admit(res(16, 1.5), "p")
    assert exc.value.details["reason"] == "cpus"


def test_a_burst_can_not_overshoot_memavailable(tmp_path: Path) -> None:
    """MemAvailable does not move while sandboxes start: each admission promises headroom,
    so a burst stops before the promises reach the reserve; once they settle, MemAvailable
    alone counts again."""
    adm, host = make(tmp_path, reserved_share=0.0)
    host.set(available_mib=2 * GIB + 10 * MIN_HEADROOM_MIB + 5)
    burst = []
    with pytest.raises(errors.CapacityExceeded) as exc:
        for _ in range(100):
            burst.append(adm.try_admit(res(), "p"))
    assert len(burst) == 10 and exc.value.details["reason"] == "memory_available"
    for t in burst:
        adm.started(t)
    with pytest.raises(errors.CapacityExceeded):  # started, not settled: still promised
        adm.try_admit(res(), "p")
    host.now += SETTLE_S + 0.01
    assert adm.pending_mib() == 0
    adm.started(adm.try_admit(res(), "p"))
    # A failed create gives its promise back at once.
    host.now += SETTLE_S
    t = adm.try_admit(res(), "p")
    assert adm.pending_mib() == MIN_HEADROOM_MIB
    adm.release(t)
    assert adm.pending_mib() == 0


def test_a_deleted_sandbox_gives_its_settling_promise_back(tmp_path: Path) -> None:
    """A sandbox deleted within SETTLE_S of its start frees its memory with it: a fast
    create -> delete loop must not pile up promises for sandboxes that are gone."""
    adm, host = make(tmp_path, reserved_share=0.0)
    host.set(available_mib=2 * GIB + 3 * MIN_HEADROOM_MIB + 5)
    for _ in range(50):  # far more cycles than the headroom of 3 would allow
        t = adm.try_admit(res(), "p")
        adm.started(t)
        adm.release(t)
    assert adm.pending_mib() == 0
    kept = adm.try_admit(res(), "p")
    adm.started(kept)
    assert adm.pending_mib() == MIN_HEADROOM_MIB
    host.now += SETTLE_S + 0.01
    adm.release(kept)  # settled first: released after, nothing to give back twice
    assert adm.pending_mib() == 0


def test_headroom_follows_the_mean_use_of_sandboxes(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    adm, host = make(tmp_path)
    t = adm.try_admit(res(1024), "p")
    adm.started(t)
    sample = adm.memory.sample()
    assert adm.headroom_mib(res(1024), sample) == MIN_HEADROOM_MIB  # nothing used yet
    from rollbox.edge import admission as mod

    monkeypatch.setattr(mod.cgroups, "memory_usage", lambda parent: 900 << 20)
    host.now += 1
    sample = adm.memory.sample()
    assert sample.sandboxes_mib == 900
    assert adm.headroom_mib(res(1024), sample) == 900
    assert adm.headroom_mib(res(256), sample) == 256  # never above its own limit


def test_memory_pressure_refuses_new_creates_only(tmp_path: Path) -> None:
    adm, host = make(tmp_path, memory_psi_max=20.0)
    host.set(available_mib=20 * GIB, psi=35.0)
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(), "p")
    assert exc.value.details["reason"] == "memory_pressure"
    adm.try_admit(res(), "grader", share="reserved")
    host.now += 1
    host.set(available_mib=20 * GIB, psi=None)  # no PSI on this kernel: MemAvailable only
    adm.try_admit(res(), "p")


def test_reserved_share_is_left_to_grades_and_they_go_first(tmp_path: Path) -> None:
    adm, _ = make(tmp_path, max_sandboxes=10, reserved_share=0.2)
    for _ in range(8):
        adm.try_admit(res(16), "p")
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(16), "p")
    assert exc.value.details["reason"] == "sandboxes"
    g1 = adm.try_admit(res(16), "p", share="reserved")
    adm.try_admit(res(16), "p", share="reserved")
    with pytest.raises(errors.CapacityExceeded):
        adm.try_admit(res(16), "p", share="reserved")
    assert adm.capacity()["free"] == 0 and adm.capacity()["reserved_free"] == 0

    async def scenario() -> None:
        waiting = asyncio.create_task(adm.admit(res(16), "p", share="reserved"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        adm.release(g1)  # room frees: the waiting grade takes it, not a new create
        with pytest.raises(errors.CapacityExceeded) as exc:
            adm.try_admit(res(16), "p")
        assert exc.value.details["reason"] in ("reserved", "sandboxes")
        await asyncio.wait_for(waiting, 1.0)

    asyncio.run(scenario())


def test_reserved_share_of_live_memory(tmp_path: Path) -> None:
    adm, host = make(tmp_path, reserved_share=0.1)
    floor_new = 2 * GIB + int(0.1 * (24 * GIB - 2 * GIB))
    host.set(available_mib=floor_new + MIN_HEADROOM_MIB - 1)
    with pytest.raises(errors.CapacityExceeded):
        adm.try_admit(res(), "p")
    adm.try_admit(res(), "p", share="reserved")


def test_reserved_wait_times_out(tmp_path: Path) -> None:
    adm, _ = make(tmp_path, max_sandboxes=1, create_queue_timeout_s=0.2)
    adm.try_admit(res(16), "p", share="reserved")

    async def scenario() -> None:
        t0 = time.monotonic()
        with pytest.raises(errors.CapacityExceeded):
            await adm.admit(res(16), "p", share="reserved")
        assert time.monotonic() - t0 < 2

    adm.clock = time.monotonic
    asyncio.run(scenario())


def test_project_quota(tmp_path: Path) -> None:
    adm, _ = make(tmp_path)
    q = Quota(sandboxes=2, cpus=3.0, memory_mib=3000)
    a = adm.try_admit(res(1000, 1.0), "team", quota=q)
    adm.try_admit(res(1000, 1.0), "team", quota=q)
    with pytest.raises(errors.QuotaExceeded) as exc:
        adm.try_admit(res(16, 0.1), "team", quota=q)
    assert not exc.value.retryable and exc.value.details["field"] == "sandboxes"
    adm.release(a)
    with pytest.raises(errors.QuotaExceeded) as exc:
        adm.try_admit(res(16, 2.5), "team", quota=q)
    assert exc.value.details["field"] == "cpus"
    with pytest.raises(errors.QuotaExceeded) as exc:
        adm.try_admit(res(2048, 0.5), "team", quota=q)
    assert exc.value.details["field"] == "memory_mib"
    adm.try_admit(res(16, 5.0), "other", quota=Quota())  # another project: its own count
    adm.try_admit(res(16), "team", share="reserved", quota=q)  # graders are not counted
    adm.try_admit(res(1000, 1.0), "team", quota=q)


def test_grades_are_bounded_by_the_quota_on_their_own(tmp_path: Path) -> None:
    """A project at its quota still grades each of its sandboxes (reserved usage is counted
    apart), but grades are no way around the quota: at most the quota's worth at once, and a
    grade asking more than the quota's resources is refused."""
    adm, _ = make(tmp_path)
    q = Quota(sandboxes=2, cpus=2.0, memory_mib=2048)
    for _ in range(2):
        adm.try_admit(res(1000, 1.0), "team", quota=q)
    g = adm.try_admit(res(1000, 1.0), "team", share="reserved", quota=q)
    adm.try_admit(res(1000, 1.0), "team", share="reserved", quota=q)
    # Held by the project's other grades: retryable, and no wait that holds the node's creates.
    with pytest.raises(errors.CapacityExceeded) as busy:
        adm.try_admit(res(16, 0.1), "team", share="reserved", quota=q)
    assert busy.value.retryable and busy.value.details["field"] == "sandboxes"
    with pytest.raises(errors.CapacityExceeded):
        asyncio.run(adm.admit(res(16, 0.1), "team", share="reserved", quota=q))
    assert adm._reserved_waiting == 0
    adm.release(g)
    with pytest.raises(errors.QuotaExceeded) as exc:  # a grade asking more than the quota
        adm.try_admit(res(16, 8.0), "team", share="reserved", quota=q)
    assert exc.value.details["field"] == "cpus" and not exc.value.retryable
    adm.try_admit(res(1000, 1.0), "team", share="reserved", quota=q)  # a release frees it
    adm.try_admit(res(16, 0.1), "other", share="reserved", quota=q)  # per project


def test_checks_read_host_memory_at_most_every_100ms_and_cost_microseconds(
        tmp_path: Path) -> None:
    adm, _ = make(tmp_path, max_sandboxes=100_000, reserved_share=0.0)
    adm.memory.clock = time.monotonic
    n = 5000
    ticks = iter(range(0, 10 * n * int(SETTLE_S) + 10, int(SETTLE_S) + 1))
    adm.clock = lambda: float(next(ticks))  # every promise settles before the next create
    t0, c0 = time.monotonic(), time.process_time()
    for _ in range(n):
        t = adm.try_admit(res(16, 0.01), "p")
        adm.started(t)
        adm.release(t)
    cpu_us = (time.process_time() - c0) / n * 1e6
    took = time.monotonic() - t0
    assert adm.memory.reads <= 2 + took / 0.1
    print(f"admission: {cpu_us:.1f} us CPU per create (admit + started + release), "
          f"{adm.memory.reads} host reads in {took:.3f} s")
    assert cpu_us < 200


def test_settings_out_of_range_stop_the_edge() -> None:
    for name, value in (("reserved_share", 1.0), ("reserved_share", -0.1),
                        ("memory_overcommit", 0.0), ("max_sandboxes", 0),
                        ("memory_reserve_mib", 24 * GIB)):
        s = Settings()
        setattr(s, name, value)
        with pytest.raises(ValueError):
            Limits.from_settings(s, 24 * GIB)


def test_free_counts_an_evictable_owners_room_as_free(tmp_path: Path) -> None:
    """The warm pool's admissions (an owner every create may evict) are room a create gets:
    a report shows them free; another owner's are not; a node refusing shows none."""
    adm, host = make(tmp_path, max_sandboxes=10, reserved_share=0.0)
    empty = adm.free()
    for _ in range(3):
        adm.try_admit(res(), "rollbox.pool")
    adm.try_admit(res(), "proj")
    assert adm.free()["sandboxes"] == empty["sandboxes"] - 4
    spare = adm.free(evictable="rollbox.pool")
    assert spare["sandboxes"] == empty["sandboxes"] - 1
    assert spare["cpus"] == empty["cpus"] - 1 and spare["memory_mib"] == empty["memory_mib"] - 1024
    host.set(available_mib=20 * GIB, psi=99.0)
    adm.memory.forget()
    assert set(adm.free(evictable="rollbox.pool").values()) == {0.0}


def test_reclaimable_memory_and_the_promises_of_given_tickets(tmp_path: Path) -> None:
    """Live memory a create may get counts what an eviction gives back (the warm pool's):
    ``live_memory_free_mib(reclaimable_mib=)`` adds it; ``promised_mib`` is the start-up
    headroom still pending for some tickets (the pool's), 0 once settled or released."""
    adm, host = make(tmp_path, reserved_share=0.0)
    base = adm.live_memory_free_mib()
    pooled = [adm.try_admit(res(), "rollbox.pool") for _ in range(2)]
    other = adm.try_admit(res(), "proj")
    each = pooled[0].headroom_mib
    assert each >= MIN_HEADROOM_MIB
    assert adm.promised_mib(pooled) == 2 * each  # not started yet
    assert adm.live_memory_free_mib() == base - 3 * each
    assert adm.live_memory_free_mib(reclaimable_mib=adm.promised_mib(pooled)) == base - each
    adm.started(pooled[0])
    assert adm.promised_mib(pooled) == 2 * each  # settling: still pending
    host.now += SETTLE_S
    assert adm.promised_mib(pooled) == each  # the started one's use shows in MemAvailable now
    adm.release(pooled[1])
    assert adm.promised_mib(pooled) == 0
    assert adm.promised_mib([other]) == other.headroom_mib


def test_the_fd_budget_counts_each_sandboxs_own_descriptors(tmp_path: Path) -> None:
    """Each admission holds the descriptors its kind says (Backend.edge_fds): a create that
    does not fit is refused (reason fds, retryable) with the rest unchanged; the reserved
    share is kept for grades; release, a fork's all-or-none and a resize count them."""
    adm, _ = make(tmp_path, max_fds=40, reserved_share=0.1)  # 36 for new creates
    nets = [adm.try_admit(res(16, 0.01), "p", fds=6) for _ in range(6)]
    assert adm.fds == 36
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(16, 0.01), "p", fds=2)
    assert exc.value.retryable and exc.value.details["reason"] == "fds"
    assert adm.fds == 36 and adm.total.sandboxes == 6
    grade = adm.try_admit(res(16, 0.01), "p", share="reserved", fds=4)  # the reserved share
    adm.release(nets[0])
    assert adm.fds == 34
    with pytest.raises(errors.CapacityExceeded):  # 2 x 2 > the 2 left: none of them
        adm.try_admit_many(res(16, 0.01), "p", 2, fds=2)
    assert adm.fds == 34 and adm.total.sandboxes == 6
    kids = adm.try_admit_many(res(16, 0.01), "p", 1, fds=2)
    assert adm.fds == 36 and kids[0].fds == 2
    with pytest.raises(errors.CapacityExceeded):  # a network on it: 4 more, no room
        adm.resize_fds(kids[0], 6)
    assert kids[0].fds == 2 and adm.fds == 36
    adm.release(grade)
    adm.resize_fds(kids[0], 6)
    assert adm.fds == 36 and adm.capacity()["fds"] == 36
    for t in [*nets, *kids]:
        adm.release(t)
    assert adm.fds == 0
    unbounded, _ = make(tmp_path)  # no max_fds (no table given): never refused for fds
    unbounded.node_fds = lambda: 10**6
    for _ in range(100):
        unbounded.try_admit(res(16, 0.01), "p", fds=6)


def test_descriptors_the_backends_hold_for_no_sandbox_take_room_from_sandboxes(
        tmp_path: Path) -> None:
    """Backend.node_fds (a microVM template's spare QEMUs: QMP, log, pipe) is read at each
    check: a create that fits the table alone is refused (reason fds) once spares hold part
    of it, and fits again when they are gone."""
    adm, _ = make(tmp_path, max_fds=40, reserved_share=0.1)  # 36 for new creates
    held = [0]
    adm.node_fds = lambda: held[0]
    nets = [adm.try_admit(res(16, 0.01), "p", fds=6) for _ in range(5)]  # 30 of 36
    held[0] = 3 * 2  # two spares
    with pytest.raises(errors.CapacityExceeded) as exc:
        adm.try_admit(res(16, 0.01), "p", fds=3)
    assert exc.value.details["reason"] == "fds" and adm.fds == 30
    held[0] = 3
    t = adm.try_admit(res(16, 0.01), "p", fds=3)
    assert adm.fds == 33
    for x in [*nets, t]:
        adm.release(x)
