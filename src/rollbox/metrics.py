"""Prometheus metrics of a platform process (the api, an edge, or both in the embedded node):
one registry per process (:func:`process_metrics`), the metric families every component
records into (:class:`Metrics`), the bounded label values they use, and the text exposition
the api's and the edges' ``/metrics`` serve (docs/operations.md lists every family).

Labels are bounded by construction: never a sandbox, exec or request id; a project is its
top-level project (``a`` of ``a/b/c``), and only the first ``MAX_PROJECTS`` seen (or the
configured list, ``Settings.metrics_projects``) by name, every other ``other``; reasons and
routes come from fixed sets (an admission refusal's ``reason``, a route's template, never its
path). A component whose numbers are a state rather than events (the edge's live sandboxes,
its admission figures, fncall pools) registers a *collector*: a callable read at scrape time.

Owns the registry, the families and the label rules; must not touch what it measures (the
callers record; nothing here reads the edge or the backends except through a collector they
registered).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_PROJECTS = 50  # distinct top-level projects named in labels; later ones are "other"
OTHER = "other"
DELETE_REASONS = ("requested", "expired", "oom", "died", "node_lost", "failed", "other")
REFUSAL_REASONS = ("sandboxes", "memory", "cpus", "memory_available", "memory_pressure",
                   "reserved", "project_grades", "fenced", "draining", "queue", "quota", "other")

# Sandbox latencies: 1 ms .. 5 min (a TCG VM boot takes a minute; a container create ~20 ms).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
API_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0, 30.0)


class _Collected:
    """The registry's view of the collectors components registered (read at each scrape)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[int, Callable[[], Iterable[Metric]]] = {}
        self._next = 0

    def add(self, fn: Callable[[], Iterable[Metric]]) -> int:
        with self._lock:
            self._next += 1
            self._fns[self._next] = fn
            return self._next

    def remove(self, handle: int) -> None:
        with self._lock:
            self._fns.pop(handle, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            fns = list(self._fns.values())
        merged: dict[str, Metric] = {}
        for fn in fns:  # two edges in one process: one family, both edges' samples
            for m in fn():
                if m.name in merged:
                    merged[m.name].samples.extend(m.samples)
                else:
                    merged[m.name] = m
        yield from merged.values()

    def describe(self) -> list[Metric]:
        return []  # families appear as collectors register: nothing to check up front


class _Off:
    """A family of a process whose metrics are off (``Settings.metrics``): records nothing."""

    def labels(self, *_: str) -> _Off:
        return self

    def inc(self, _: float = 1) -> None:
        pass

    def observe(self, _: float) -> None:
        pass

    def set(self, _: float) -> None:
        pass


class Metrics:
    """Every family a platform process records (``rollbox_*``) in its own registry; with
    ``enabled=False`` every family records nothing and the exposition is empty (what the
    container benchmark's metrics-off server runs, to measure what metrics cost)."""

    def __init__(self, projects: Iterable[str] = (), enabled: bool = True) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=False)
        self._configured = tuple(projects)
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        r = self.registry
        self.creates = Counter("rollbox_sandbox_creates", "Sandboxes created (outcome: "
                               "created, failed)", ["backend", "project", "outcome"], registry=r)
        self.deletes = Counter("rollbox_sandbox_deletes", "Sandboxes ended, by why",
                               ["backend", "project", "reason"], registry=r)
        self.refusals = Counter("rollbox_admission_refusals", "Creates refused by a node's "
                                "admission or a project's quota, by reason", ["reason"],
                                registry=r)
        self.create_seconds = Histogram("rollbox_sandbox_create_seconds", "Create, admitted to "
                                        "running", ["backend"], buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.first_exec_seconds = Histogram(
            "rollbox_sandbox_first_exec_seconds", "Sandbox created -> its first command "
            "started", ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.exec_seconds = Histogram("rollbox_exec_seconds", "Commands, start to exit",
                                      ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.grade_seconds = Histogram("rollbox_grade_seconds", "Grades, request to result",
                                       ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.oom_kills = Counter("rollbox_oom_kills", "Commands or sandboxes the OOM killer "
                                 "ended", ["backend", "what"], registry=r)
        self.timeouts = Counter("rollbox_timeouts", "Commands past their timeout and "
                                "sandboxes past their TTL", ["kind"], registry=r)
        self.api_seconds = Histogram("rollbox_api_request_seconds", "API requests, received to "
                                     "response start, by route template and status",
                                     ["method", "route", "status"], buckets=API_BUCKETS,
                                     registry=r)
        self.dns_refusals = Counter("rollbox_dns_gate_refusals", "Names the DNS gate refused "
                                    "to resolve for a sandbox", ["backend"], registry=r)
        self.filter_denials = Counter("rollbox_filter_denials", "What a sandbox's network "
                                      "filter denied (kind: connect, sendmsg, packets)",
                                      ["backend", "kind"], registry=r)
        self.fncall_wait_seconds = Histogram("rollbox_fncall_wait_seconds", "fncall: a call's "
                                             "wait for a free worker", ["pool"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.info = Gauge("rollbox_process_start_time_seconds", "When this platform process "
                          "started (unix time)", registry=r)
        self.info.set(time.time())
        self.collected = _Collected()
        r.register(self.collected)  # type: ignore[arg-type]
        if not enabled:
            for name, v in list(vars(self).items()):
                if isinstance(v, Counter | Histogram | Gauge):
                    setattr(self, name, _Off())

    # ---- label rules ------------------------------------------------------------------
    def configure(self, projects: Iterable[str]) -> None:
        """Name only these top-level projects in labels (``Settings.metrics_projects``; the
        composition root's, at start); none: the first MAX_PROJECTS seen."""
        names = tuple(projects)
        if names:
            self._configured = names

    def project(self, owner: str | None) -> str:
        """The ``project`` label of ``owner``: its top-level project, if configured (or among
        the first MAX_PROJECTS seen when none is configured), else ``other``."""
        top = (owner or "").split("/", 1)[0]
        if not top:
            return OTHER
        if self._configured:
            return top if top in self._configured else OTHER
        if top in self._seen:
            return top
        with self._lock:
            if len(self._seen) < MAX_PROJECTS:
                self._seen.add(top)
                return top
        return OTHER

    @staticmethod
    def delete_reason(reason: str | None) -> str:
        """A bounded ``reason`` of the edge's free-text end reasons."""
        if reason is None:
            return "requested"
        low = reason.lower()
        for key, label in (("ttl", "expired"), ("oom", "oom"), ("died", "died"),
                           ("node", "node_lost"), ("fail", "failed")):
            if key in low:
                return label
        return OTHER

    @staticmethod
    def refusal_reason(details: dict[str, Any]) -> str:
        reason = str(details.get("reason") or "")
        return reason if reason in REFUSAL_REASONS else OTHER

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> int:
        """Read ``fn`` at every scrape (a component's state); the handle removes it."""
        return self.collected.add(fn) if self.enabled else 0

    def remove_collector(self, handle: int) -> None:
        self.collected.remove(handle)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything (``/metrics``)."""
        return generate_latest(self.registry) if self.enabled else b""


Rows = Iterable[tuple[list[str], float]]


def _family(cls: type[Any], name: str, doc: str, labels: list[str], rows: Rows) -> Any:
    fam = cls(name, doc, labels=labels)
    for values, v in rows:
        fam.add_metric(values, v)
    return fam


def counter(name: str, doc: str, labels: list[str], rows: Rows) -> CounterMetricFamily:
    """A counter family for a collector (totals another process keeps: the lazy loader's)."""
    return _family(CounterMetricFamily, name, doc, labels, rows)


def gauge(name: str, doc: str, labels: list[str], rows: Rows) -> GaugeMetricFamily:
    """A gauge family for a collector: ``rows`` of (label values, value)."""
    return _family(GaugeMetricFamily, name, doc, labels, rows)


HistogramRows = Iterable[tuple[list[str], Iterable[float], list[float], float]]


def histogram(name: str, doc: str, labels: list[str], rows: HistogramRows
              ) -> HistogramMetricFamily:
    """A histogram family for a collector (one another process keeps: the lazy loader's
    fetch latencies): ``rows`` of (label values, bucket upper bounds, the count in each bucket
    with +Inf's last (not cumulative: one more than the bounds), sum)."""
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for values, bounds, counts, total in rows:
        les = [*(repr(float(b)) for b in bounds), "+Inf"]
        if len(les) != len(counts):
            raise ValueError(f"{name}: {len(counts)} bucket counts for {len(les)} buckets")
        cum, acc = [], 0.0
        for le, c in zip(les, counts, strict=True):
            acc += c
            cum.append((le, acc))
        fam.add_metric(values, cum, total)
    return fam


_process: Metrics | None = None
_process_lock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's metrics, made at the first call (on or off by ``Settings.metrics``)."""
    global _process
    if _process is None:
        from rollbox.config import Settings

        with _process_lock:
            if _process is None:
                _process = Metrics(enabled=Settings().metrics)
    return _process
