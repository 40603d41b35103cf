"""Placement decisions on a simulated 160-node cluster (`rollbox bench placement [--json]`).

Simulated in virtual time, decided for real: rollbox's Placement (from a ClusterView, as in a
cluster) and two baselines in the same run, random and least-loaded (both retry a refusal on
another node as Placement does), each over the same arrivals, lifetimes and nodes. Two more
runs of Placement: without the layer bonus (what the bonus costs in balance), and as 4 api
replicas taking turns over the same view, each with its own pending placements (the only way
a node refuses Placement here: one replica never overfills a node its view shows), also at
95 % offered load, where the bursts take the cluster past full for a while.

The cluster (DSec-like, issue 14 item 9):
- 144 container nodes: 3,200 sandboxes, 192 cores x 32 CPU overcommit (6,144 CPUs of
  requests), 1.5 TiB x 4 memory overcommit; 16 microVM nodes (container + microvm): 800
  sandboxes, 192 cores x 32, 1.5 TiB x 1. 473,600 sandbox slots in all.
- Every node caches the layers of 5 of 20 images (the layer bonus has something to find).
- Requests: CPUs 0.5/1/2/4 (30/40/20/10 %), memory 512/1024/2048/4096 MiB (same shares), 2 %
  microvm, 5 % qos latency; an image of 20, each named by its layer digest.
- Lifetimes: lognormal, median 17 min, sigma 1.03 (mean 28.9 min, p99 3.1 h, DSec's shape),
  compressed by COMPRESSION (10: median 102 s, p99 18.7 min).
- Arrivals: a steady Poisson stream plus a 32 K-sandbox job every 60 s arriving with the
  stream at 5,000/s in all; the steady rate makes the offered load rate x mean lifetime = 75 %
  of the slots. At t=0 the cluster holds the steady-state population (residual lifetimes of a
  length-biased lognormal), spread evenly over the nodes.
- Fake edges keep their own state and refuse (CapacityExceeded) when really full by any budget
  (sandboxes, CPUs, memory); the view (ClusterView) is their state at each whole second (1 Hz,
  ``seen_at`` = that second): between refreshes placement sees only its own placements.
- A create completes at once in virtual time (the fake edge answers without waiting), one
  after another: a decision's cost is measured, not a node's create.

Measured: decisions/s = creates / CPU seconds of this thread inside ``create()`` (filter,
score, pending accounting, the snapshot rebuild after each refresh, retries on refusal, the
fake edge's own bookkeeping, and the two clock reads around each call) on one core (this
process pinned to one CPU); ``*_per_wall_s`` the same over wall seconds (lower on a loaded
host: the load average at start and end is in the output); load balance = max/mean
over nodes of occupancy (a node's highest used share of sandboxes, CPUs, memory), sampled each
second after WARMUP_S, averaged (and the worst sample); refusal rate (edge refusals per
create), retry rate (creates that needed another node), failures (creates every attempt of
which was refused, or no node fitted).
Targets (issue 14): >= 20,000 decisions/s, max/mean <= 1.15.
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from rollbox import errors
from rollbox.benchkit import emit, ratio, say
from rollbox.config import Settings
from rollbox.models import Resources, SandboxInfo, SandboxSpec
from rollbox.placement import Placement, PlacementConfig
from rollbox.placement.view import NodeView

MEDIAN_S = 17 * 60
SIGMA = 1.03
COMPRESSION = 10
OCCUPANCY = 0.75
BURST_EVERY_S = 60
BURST_SIZE = 32_768
BURST_RATE = 5_000  # arrivals/s in all while a burst lasts
DURATION_S = 420
WARMUP_S = 180
CPUS = ((0.5, 0.3), (1.0, 0.4), (2.0, 0.2), (4.0, 0.1))
MEMORY = ((512, 0.3), (1024, 0.4), (2048, 0.2), (4096, 0.1))
IMAGES = 20
CACHED_IMAGES = 5
MICROVM_SHARE = 0.02
LATENCY_SHARE = 0.05


def digest(i: int) -> str:
    return f"sha256-{i:064x}"


class Refusals:
    n = 0


class FakeEdge:
    """A node's real state: admits while every budget has room, else refuses."""

    def __init__(self, node_id: str, slots: int, cpus: float, memory_mib: float,
                 backends: frozenset[str], layers: frozenset[str], refusals: Refusals) -> None:
        self.node_id = node_id
        self.slots, self.cpus, self.memory_mib = slots, cpus, memory_mib
        self.backends, self.layers = backends, layers
        self.n, self.used_cpus, self.used_mib = 0, 0.0, 0.0
        self.refusals = refusals
        self.info = SandboxInfo(id=f"{node_id}-00000000", node=node_id, image="x", layers=[],
                                state="running", created_at=0, expires_at=0, labels={},
                                resources=Resources())

    def capacity(self) -> dict[str, object]:
        raise AssertionError("a decision called capacity()")

    async def create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        r = spec.resources
        if (self.n >= self.slots or self.used_cpus + r.cpus > self.cpus
                or self.used_mib + r.memory_mib > self.memory_mib):
            self.refusals.n += 1
            raise errors.CapacityExceeded(f"node {self.node_id} is full")
        self.n += 1
        self.used_cpus += r.cpus
        self.used_mib += r.memory_mib
        return self.info

    def release(self, cpus: float, memory_mib: float) -> None:
        self.n -= 1
        self.used_cpus -= cpus
        self.used_mib -= memory_mib

    def occupancy(self) -> float:
        return max(self.n / self.slots, self.used_cpus / self.cpus,
                   self.used_mib / self.memory_mib)

    def view(self, t: float) -> NodeView:
        return NodeView(self.node_id, "alive", self.backends,
                        {"sandboxes": self.slots - self.n, "cpus": self.cpus - self.used_cpus,
                         "memory_mib": self.memory_mib - self.used_mib},
                        limits={"sandboxes": self.slots, "cpus": self.cpus,
                                "memory_mib": self.memory_mib},
                        layers=self.layers, seen_at=t)


class FakeView:
    """The edges' state as of the last refresh (the watcher's job, at 1 Hz)."""

    def __init__(self, edges: Sequence[FakeEdge]) -> None:
        self.edges = edges
        self._nodes: tuple[NodeView, ...] = ()

    def refresh(self, t: float) -> None:
        self._nodes = tuple(e.view(t) for e in self.edges)

    def nodes(self) -> Sequence[NodeView]:
        return self._nodes

    def node(self, node_id: str) -> NodeView | None:
        return next((n for n in self._nodes if n.node_id == node_id), None)


def make_edges(seed: int, refusals: Refusals) -> list[FakeEdge]:
    rng = random.Random(seed)
    out = []
    for i in range(160):
        vm = i >= 144
        cached = frozenset(digest(j) for j in rng.sample(range(IMAGES), CACHED_IMAGES))
        out.append(FakeEdge(f"n{i:03d}", 800 if vm else 3200, 192 * 32.0,
                            (1 if vm else 4) * 1.5 * 1024 * 1024,
                            frozenset({"container", "microvm"} if vm else {"container"}),
                            cached, refusals))
    return out


# ---- the baselines ----------------------------------------------------------------------------

class _Baseline:
    """Shared by the baselines: the view's nodes offering the backend (listed once per view
    snapshot, in the order the baseline tries them); a refusal is retried on the next node,
    max_attempts in all, as Placement does."""

    def __init__(self, edges: Sequence[FakeEdge], view: FakeView, max_attempts: int,
                 rng: random.Random) -> None:
        self.edges = {e.node_id: e for e in edges}
        self.view = view
        self.max_attempts = max_attempts
        self.rng = rng
        self._source: object = None
        self._lists: dict[str, list[NodeView]] = {}

    def candidates(self, backend: str) -> list[NodeView]:
        nodes = self.view.nodes()
        if nodes is not self._source:
            self._source, self._lists = nodes, {}
        out = self._lists.get(backend)
        if out is None:
            out = self._lists[backend] = self.order([n for n in nodes if backend in n.backends])
        return out

    def order(self, nodes: list[NodeView]) -> list[NodeView]:
        return nodes

    def pick(self, nodes: list[NodeView], spec: SandboxSpec, tried: list[str]) -> NodeView | None:
        raise NotImplementedError

    async def create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        nodes, tried = self.candidates(spec.backend), []
        for _ in range(self.max_attempts):
            nv = self.pick(nodes, spec, tried)
            if nv is None:
                break
            try:
                return await self.edges[nv.node_id].create(spec, owner)
            except errors.CapacityExceeded:
                tried.append(nv.node_id)
        raise errors.CapacityExceeded("every node tried is full")


class RandomPlacement(_Baseline):
    """Any node offering the backend, uniformly (one not tried yet)."""

    def pick(self, nodes: list[NodeView], spec: SandboxSpec, tried: list[str]) -> NodeView | None:
        for _ in range(64):
            nv = nodes[int(self.rng.random() * len(nodes))] if nodes else None
            if nv is None or nv.node_id not in tried:
                return nv
        return None


class LeastLoaded(_Baseline):
    """The node with the largest share free in the view (tightest budget) that fits there:
    the view's order is the same for every decision until the next refresh (no pending
    placements: that is what this baseline lacks)."""

    def order(self, nodes: list[NodeView]) -> list[NodeView]:
        def share(n: NodeView) -> float:
            f, lim = n.free, n.limits
            return min(f["sandboxes"] / lim["sandboxes"], f["cpus"] / lim["cpus"],
                       f["memory_mib"] / lim["memory_mib"])

        return sorted(nodes, key=share, reverse=True)

    def pick(self, nodes: list[NodeView], spec: SandboxSpec, tried: list[str]) -> NodeView | None:
        r = spec.resources
        for n in nodes:
            f = n.free
            if (f["sandboxes"] >= 1 and f["cpus"] >= r.cpus and f["memory_mib"] >= r.memory_mib
                    and n.node_id not in tried):
                return n
        return None


# ---- the workload -----------------------------------------------------------------------------

def _weighted(rng: random.Random, items: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([x for x, _ in items], [w for _, w in items])[0]


def spec_table(rng: random.Random, n: int = 4096) -> list[SandboxSpec]:
    """``n`` specs drawn from the request mix (pydantic objects made once, not per arrival)."""
    made: dict[tuple[Any, ...], SandboxSpec] = {}
    out = []
    for _ in range(n):
        key = (_weighted(rng, CPUS), _weighted(rng, MEMORY), rng.randrange(IMAGES),
               "microvm" if rng.random() < MICROVM_SHARE else "container",
               "latency" if rng.random() < LATENCY_SHARE else "batch")
        if key not in made:
            made[key] = SandboxSpec(image=digest(key[2]), backend=key[3], qos=key[4],
                                    resources=Resources(cpus=key[0], memory_mib=key[1]))
        out.append(made[key])
    return out


def lifetime_mean_s(compression: float) -> float:
    return MEDIAN_S / compression * math.exp(SIGMA ** 2 / 2)


@dataclasses.dataclass
class Workload:
    duration_s: int
    warmup_s: int
    compression: float
    seed: int
    occupancy: float = OCCUPANCY

    @property
    def mu(self) -> float:
        return math.log(MEDIAN_S / self.compression)

    def steady_rate(self, slots: int) -> float:
        offered = self.occupancy * slots / lifetime_mean_s(self.compression)
        return offered - BURST_SIZE / BURST_EVERY_S

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times: Poisson at ``rate``, plus at the start of every burst period a 32 K
        job whose arrivals bring the total rate to BURST_RATE until it is all in."""
        rng = random.Random(self.seed)
        out, t = [], rng.expovariate(rate)
        while t < self.duration_s:
            out.append(t)
            t += rng.expovariate(rate)
        extra = BURST_RATE - rate
        for start in range(BURST_EVERY_S // 2, self.duration_s, BURST_EVERY_S):
            out.extend(start + i / extra for i in range(BURST_SIZE)
                       if start + i / extra < self.duration_s)
        out.sort()
        return out


# ---- one run ----------------------------------------------------------------------------------

async def run_policy(name: str, wl: Workload, quick: bool) -> dict[str, Any]:
    refused = Refusals()
    edges = make_edges(wl.seed, refused)
    view = FakeView(edges)
    by_id = {e.node_id: e for e in edges}
    rng = random.Random(wl.seed + 1)
    specs = spec_table(random.Random(wl.seed + 2))
    slots = sum(e.slots for e in edges)
    rate = wl.steady_rate(slots)
    now = 0.0
    cfg = PlacementConfig.from_settings(Settings())
    if name.startswith("rollbox"):
        if name == "rollbox_no_layer_bonus":
            cfg = dataclasses.replace(cfg, layer_bonus=0.0)
        # rollbox_4_replicas: 4 api replicas take turns, each with its own pending placements
        # over the same view (as stateless replicas behind one port would).
        placements: list[Any] = [
            Placement(edges, view, config=cfg, clock=lambda: now,  # type: ignore[arg-type]
                      rng=random.Random(wl.seed + 3 + i))
            for i in range(4 if name == "rollbox_4_replicas" else 1)]
    elif name == "random":
        placements = [RandomPlacement(edges, view, cfg.max_attempts, random.Random(wl.seed + 3))]
    else:
        placements = [LeastLoaded(edges, view, cfg.max_attempts, random.Random(wl.seed + 3))]
    replicas = len(placements)

    # The steady state at t=0: rate x mean lifetime sandboxes, spread evenly, with residual
    # lifetimes (a length-biased lognormal's, times a uniform share).
    departures: list[tuple[float, FakeEdge, float, int]] = []
    n0 = int(wl.occupancy * slots)
    k = 0
    for e in edges:
        for _ in range(round(n0 * e.slots / slots)):
            s = specs[k % len(specs)]
            k += 1
            if s.backend not in e.backends:
                s = specs[0] if specs[0].backend == "container" else SandboxSpec(image="x")
            r = s.resources
            if e.used_cpus + r.cpus > e.cpus or e.used_mib + r.memory_mib > e.memory_mib:
                continue
            e.n += 1
            e.used_cpus += r.cpus
            e.used_mib += r.memory_mib
            life = rng.lognormvariate(wl.mu + SIGMA ** 2, SIGMA) * rng.random()
            departures.append((life, e, r.cpus, r.memory_mib))
    heapq.heapify(departures)

    arrivals = wl.arrivals(rate)
    lognorm, mu = rng.lognormvariate, wl.mu
    decide_s = wall_s = 0.0
    placed = failed = retried = placed_or_not = 0
    samples: list[float] = []
    occ_means: list[float] = []
    next_refresh = 0.0
    perf, cpu = time.perf_counter, time.thread_time
    nspecs = len(specs)
    for t in arrivals:
        while next_refresh <= t:  # whole seconds: departures up to it, then the view
            while departures and departures[0][0] <= next_refresh:
                _, e, c, m = heapq.heappop(departures)
                e.release(c, m)
            if next_refresh >= wl.warmup_s:
                occ = [e.occupancy() for e in edges]
                occ_means.append(sum(occ) / len(occ))
                samples.append(max(occ) / occ_means[-1])
            view.refresh(next_refresh)
            next_refresh += 1.0
        while departures and departures[0][0] <= t:
            _, e, c, m = heapq.heappop(departures)
            e.release(c, m)
        now = t
        spec = specs[int(rng.random() * nspecs)]
        before = refused.n
        placed_or_not += 1
        c0 = cpu()
        t0 = perf()
        try:
            info = await placements[placed_or_not % replicas].create(spec, "p")
        except errors.CapacityExceeded:
            wall_s += perf() - t0
            decide_s += cpu() - c0
            failed += 1
            retried += refused.n > before
            continue
        wall_s += perf() - t0
        decide_s += cpu() - c0
        placed += 1
        retried += refused.n > before
        r = spec.resources
        heapq.heappush(departures, (t + lognorm(mu, SIGMA), by_id[info.node], r.cpus,
                                    r.memory_mib))
    refusals = refused.n
    creates = placed + failed
    occ = [e.occupancy() for e in edges]
    res = {
        "creates": creates,
        "decisions_per_s": creates / decide_s if decide_s else None,
        "decisions_per_wall_s": creates / wall_s if wall_s else None,
        "us_per_decision": decide_s / creates * 1e6 if creates else None,
        "max_over_mean": sum(samples) / len(samples) if samples else None,
        "max_over_mean_worst": max(samples) if samples else None,
        "refusals_per_create": refusals / creates if creates else None,
        "retried_share": retried / creates if creates else None,
        "failed_share": failed / creates if creates else None,
        "mean_occupancy_end": sum(occ) / len(occ),
        "steady_rate_per_s": rate,
        "mean_occupancy": sum(occ_means) / len(occ_means) if occ_means else None,
    }
    return res


def pin_one_core() -> int | None:
    """Pin this process to one CPU (the one it runs on): decisions/s is per core."""
    try:
        cpu = os.sched_getaffinity(0)
        one = min(cpu)
        os.sched_setaffinity(0, {one})
        return one
    except (AttributeError, OSError):
        return None


async def run(quick: bool, seed: int = 14) -> dict[str, Any]:
    wl = (Workload(duration_s=150, warmup_s=60, compression=COMPRESSION, seed=seed) if quick
          else Workload(duration_s=DURATION_S, warmup_s=WARMUP_S, compression=COMPRESSION,
                        seed=seed))
    cpu = pin_one_core()
    load0 = os.getloadavg()[0]
    say(f"placement: 160 nodes, {wl.duration_s} s simulated (lifetimes / {wl.compression:g}), "
        f"warm-up {wl.warmup_s} s, pinned to CPU {cpu}")
    out: dict[str, Any] = {"nodes": 160, "compression": wl.compression,
                           "duration_s": wl.duration_s, "warmup_s": wl.warmup_s}
    results = {}
    # Near full: 95 % offered load (the bursts take it past 100 % for a while), 4 replicas:
    # where refusals, retries and failures show.
    tight = dataclasses.replace(wl, occupancy=0.95)
    for name in ("rollbox", "rollbox_no_layer_bonus", "rollbox_4_replicas", "random",
                 "least_loaded", "rollbox_4_replicas_95"):
        t0 = time.monotonic()
        results[name] = r = await run_policy(name.removesuffix("_95"),
                                             tight if name.endswith("_95") else wl, quick)
        say(f"  {name:22s} {r['decisions_per_s']:>9,.0f} decisions/s  max/mean "
            f"{r['max_over_mean']:.3f} (worst {r['max_over_mean_worst']:.3f})  refusals/create "
            f"{r['refusals_per_create']:.4f}  retried {r['retried_share']:.4f}  "
            f"failed {r['failed_share']:.4f}  occupancy {r['mean_occupancy']:.3f}  "
            f"({time.monotonic() - t0:.0f} s)")
    ours = results["rollbox"]
    out.update({"placement_decisions_per_s": ours["decisions_per_s"],
                "placement_us_per_decision": ours["us_per_decision"],
                "placement_decisions_per_wall_s": ours["decisions_per_wall_s"],
                "placement_max_over_mean": ours["max_over_mean"],
                "placement_max_over_mean_worst": ours["max_over_mean_worst"],
                "placement_refusals_per_create": ours["refusals_per_create"],
                "placement_retried_share": ours["retried_share"],
                "placement_failed_share": ours["failed_share"],
                "placement_creates": ours["creates"],
                "placement_mean_occupancy": ours["mean_occupancy"],
                "steady_rate_per_s": ours["steady_rate_per_s"]})
    for name in ("rollbox_no_layer_bonus", "rollbox_4_replicas", "rollbox_4_replicas_95"):
        r = results[name]
        key = name.replace("rollbox_", "placement_")
        out.update({f"{key}_max_over_mean": r["max_over_mean"],
                    f"{key}_refusals_per_create": r["refusals_per_create"],
                    f"{key}_retried_share": r["retried_share"],
                    f"{key}_failed_share": r["failed_share"],
                    f"{key}_mean_occupancy": r["mean_occupancy"],
                    f"{key}_decisions_per_s": r["decisions_per_s"]})
    for name in ("random", "least_loaded"):
        r = results[name]
        out.update({f"{name}_decisions_per_s": r["decisions_per_s"],
                    f"{name}_decisions_per_wall_s": r["decisions_per_wall_s"],
                    f"{name}_max_over_mean": r["max_over_mean"],
                    f"{name}_max_over_mean_worst": r["max_over_mean_worst"],
                    f"{name}_refusals_per_create": r["refusals_per_create"],
                    f"{name}_retried_share": r["retried_share"],
                    f"{name}_failed_share": r["failed_share"]})
        out[f"placement_max_over_mean_vs_{name}"] = ratio(ours["max_over_mean"],
                                                          r["max_over_mean"])
    out["load_avg_1m"] = [load0, os.getloadavg()[0]]
    out["targets"] = {"placement_decisions_per_s": 20_000, "placement_max_over_mean": 1.15}
    out["met"] = bool(ours["decisions_per_s"] >= 20_000 and ours["max_over_mean"] <= 1.15)
    return out


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    return emit(asyncio.run(run(quick)), json_out)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
