"""The simulated parts of ``bench/placement.py``: its fake edges refuse when really full by any
budget, its lifetimes have DSec's shape, its arrivals the stated rates."""
from __future__ import annotations

import math
import statistics

import pytest

from rollbox import errors
from rollbox.benchkit import load_bench, percentile
from rollbox.models import Resources, SandboxSpec


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_bench("placement")


async def test_fake_edge_refuses_when_full(bench) -> None:  # noqa: ANN001
    e = bench.FakeEdge("n0", 2, 3.0, 4096, frozenset({"container"}), frozenset(),
                       bench.Refusals())
    spec = SandboxSpec(image="x", resources=Resources(cpus=2, memory_mib=1024))
    await e.create(spec, "p")
    with pytest.raises(errors.CapacityExceeded):  # CPUs: 2 + 2 > 3
        await e.create(spec, "p")
    small = SandboxSpec(image="x", resources=Resources(cpus=0.5, memory_mib=1024))
    await e.create(small, "p")
    with pytest.raises(errors.CapacityExceeded):  # slots
        await e.create(small, "p")
    assert e.refusals.n == 2
    v = e.view(3.0)
    assert v.free == {"sandboxes": 0, "cpus": 0.5, "memory_mib": 2048} and v.seen_at == 3.0


def test_lifetimes_and_arrivals(bench) -> None:  # noqa: ANN001
    import random

    wl = bench.Workload(duration_s=120, warmup_s=0, compression=10, seed=1)
    rng = random.Random(2)
    xs = [rng.lognormvariate(wl.mu, bench.SIGMA) for _ in range(50_000)]
    assert statistics.median(xs) == pytest.approx(17 * 60 / 10, rel=0.03)
    assert percentile(xs, 99) > 3 * 3600 / 10  # p99 > 3 h, compressed
    assert statistics.fmean(xs) == pytest.approx(bench.lifetime_mean_s(10), rel=0.05)
    slots = 473_600
    rate = wl.steady_rate(slots)
    offered = (rate + bench.BURST_SIZE / bench.BURST_EVERY_S) * bench.lifetime_mean_s(10)
    assert offered / slots == pytest.approx(0.75)
    ts = wl.arrivals(rate)
    assert ts == sorted(ts) and len(ts) == pytest.approx(rate * 120 + 2 * bench.BURST_SIZE,
                                                         rel=0.02)
    start = bench.BURST_EVERY_S // 2  # one burst second: 5,000 arrivals in all
    assert sum(start + 1 <= t < start + 2 for t in ts) == pytest.approx(bench.BURST_RATE,
                                                                       rel=0.05)
    assert sum(e.slots for e in bench.make_edges(1, bench.Refusals())) == slots
    assert not math.isnan(rate)
