"""The benchmarks' toolkit: one definition of every measurement that more than one benchmark
takes, so that a figure means the same thing in every benchmark that reports it.

Owns: percentiles (nearest-rank, :func:`percentile`); CPU meters of the machine
(``/proc/stat``), of a process, of a process tree and of cgroups, each counting a VM's guest time
once (:class:`ProcCpu`, :class:`MachineCpu`); memory meters (MemAvailable, what page cache does
not explain, RSS, PSS, a cgroup's charge); timing of cycles run at a concurrency and of round
trips; the ratio against a peer measured in the same run; finding processes; the output (one
JSON object on the last line of ``--json``, floats rounded, no NaN); loading ``bench/NAME.py`` by
path (how ``rollbox bench NAME`` runs it); the record of one run (:class:`BenchRun`: the result
:func:`emit` printed and the raw samples of every latency the run took, saved under
``docs/bench-results/`` for ``benchplot`` to draw).

Used by ``bench/*.py``, by the ``rollbox demo`` summaries and the ``rollbox bench`` command.
Must not be imported by the product's runtime: the layer contract (pyproject.toml) puts it
above ``embedded`` and everything below. Imports only ``rollbox.config`` (for the repository
root), and that only to load a benchmark.
"""
from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any, Self

MiB = 1 << 20

# ---- percentiles ------------------------------------------------------------------------------


def percentile(xs: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0 <= p <= 100) of ``xs`` by the **nearest-rank** method: the
    smallest sample such that at least p % of the samples are <= it, i.e. the sample of rank
    ceil(p / 100 * n) (1-based; p = 0 gives the minimum). NaN when there are no samples.

    Why this one: a benchmark's p99 is a claim about its samples ("99 % of the cycles took at
    most X"), and nearest-rank makes it true of them: X is a time that was measured, not one
    interpolated between two, and it is never below p % of the samples. With fewer than 100
    samples p99 is the maximum, which is all a small run can say about its tail. p50 of an even
    count is the lower of the two middle samples. (The two definitions this replaces: index
    round(p/100 * (n-1)) with Python's round-half-to-even, whose p50 of an even count was the
    lower or the upper middle sample depending on n and whose p99 of 160 samples had 3 samples
    (1.9 %) above it; and index int(p/100 * n), one rank above nearest-rank whenever p/100 * n
    is whole, so its p99 of 100 samples was the maximum. docs/benchmarks.md, Percentiles.)"""
    s = sorted(xs)
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not in [0, 100]")
    if not s:
        return math.nan
    rank = math.ceil(Fraction(str(p)) * len(s) / 100)  # exact: 7 / 100 * 100 > 7 in floats
    return s[max(1, rank) - 1]


def latency_ms(xs_s: Iterable[float], prefix: str = "", *, series: str | None = None
               ) -> dict[str, float]:
    """``{prefix}p50_ms`` and ``{prefix}p99_ms`` of samples in seconds; the samples are
    recorded (:func:`record`) as ``series`` (default: ``prefix`` without its trailing ``_``, or
    ``latency``)."""
    xs = list(xs_s)
    record(series or prefix.rstrip("_") or "latency", xs)
    return {f"{prefix}p50_ms": percentile(xs, 50) * 1000,
            f"{prefix}p99_ms": percentile(xs, 99) * 1000}


def ratio(ours: float | None, peer: float | None) -> float | None:
    """``ours / peer`` (e.g. our rate over the peer's, measured in the same run); None when
    either is missing, the peer is 0 or either is NaN."""
    if ours is None or peer is None or not peer or math.isnan(ours) or math.isnan(peer):
        return None
    return ours / peer


# ---- timing -----------------------------------------------------------------------------------


async def run_cycles(cycle: Callable[[], Awaitable[object]], n: int, conc: int, *,
                     raise_errors: bool = False, series: str | None = "cycle") -> dict[str, Any]:
    """Run ``n`` cycles, at most ``conc`` at a time: ``n``, ``per_s`` (cycles that succeeded
    per second of the whole run's wall time), ``wall_s``, ``p50_ms``/``p99_ms`` over every cycle
    (failed ones too) and ``errors``. A cycle fails when it returns False or raises; the
    exception is said and counted, or with ``raise_errors`` it ends the run. The cycles' times
    are recorded (:func:`record`) as ``{series}_c{conc}`` (``series`` None: not recorded; the
    caller pools them)."""
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        async with sem:
            t = time.monotonic()
            try:
                if await cycle() is False:
                    errors += 1
            except Exception as exc:  # noqa: BLE001 - counted and said, or re-raised
                if raise_errors:
                    raise
                errors += 1
                say(f"  cycle error: {type(exc).__name__}: {exc}")
            lat.append(time.monotonic() - t)

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.monotonic() - t0
    return {"n": n, "per_s": (n - errors) / wall if wall else 0.0, "wall_s": wall,
            **(latency_ms(lat, series=f"{series}_c{conc}") if series is not None else
               {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000}),
            "errors": errors}


async def round_trips(op: Callable[[], Awaitable[object]], n: int, warmup: int = 10
                      ) -> list[float]:
    """Seconds of each of ``n`` sequential ``await op()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        await op()
    lat = []
    for _ in range(n):
        t = time.monotonic()
        await op()
        lat.append(time.monotonic() - t)
    return lat


# ---- CPU --------------------------------------------------------------------------------------
#
# Guest time is counted once. When a QEMU vCPU thread runs its guest (KVM), the kernel adds the
# time to the thread's utime *and* its guest_time, to /proc/stat's user *and* guest (nice and
# guest_nice for a niced thread), and to the cgroup's usage once. So guest time is a part of
# utime / user, never added to them: every meter here sums utime + stime, or /proc/stat's fields
# without guest and guest_nice, or a cgroup's usage. (Under TCG there is no guest time at all:
# emulation is plain user time.)


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcCpu:
    """The CPU fields of ``/proc/<pid>/stat`` in clock ticks (fields 14-17, 43, 44 of proc(5)).
    ``utime`` includes ``guest_time`` and ``cutime`` includes ``cguest_time``."""

    utime: int
    stime: int
    cutime: int
    cstime: int
    guest_time: int
    cguest_time: int

    @classmethod
    def parse(cls, stat: str) -> ProcCpu:
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold ") "
        # fields[0] is proc(5)'s field 3 (state)
        return cls(*(int(fields[i - 3]) for i in (14, 15, 16, 17, 43, 44)))

    def ticks(self, children: bool = False) -> int:
        """utime + stime (guest time is inside utime), + the reaped children's with
        ``children``."""
        return self.utime + self.stime + (self.cutime + self.cstime if children else 0)


def read_proc_cpu(pid: int | str) -> ProcCpu | None:
    """``pid``'s CPU fields, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return ProcCpu.parse(f.read())
    except (OSError, IndexError, ValueError):
        return None


def process_cpu_s(pid: int | str | None = None, children: bool = False) -> float:
    """CPU seconds of a process (all its threads; with ``children`` plus its reaped children's
    and theirs); 0 if it is gone. ``pid`` None: this process, from the kernel's clocks (finer than
    the ticks of /proc)."""
    if pid is None:
        own = time.process_time()
        if not children:
            return own
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own + c.ru_utime + c.ru_stime
    st = read_proc_cpu(pid)
    return st.ticks(children) / clock_ticks() if st is not None else 0.0


def tree_pids(root: int) -> list[int]:
    """``root`` and its live descendants (from the parent pid of every process)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds of a process tree: each live process's own and its reaped children's. A
    process reaped inside the tree is counted by its reaper, a live one by itself: each once.
    (A descendant reaped outside the tree, e.g. orphaned to init, is lost.)"""
    return sum(process_cpu_s(pid, children=True) for pid in tree_pids(root))


@dataclass(frozen=True)
class MachineCpu:
    """The ``cpu`` line of ``/proc/stat`` in clock ticks."""

    user: int
    nice: int
    system: int
    idle: int
    iowait: int
    irq: int
    softirq: int
    steal: int = 0
    guest: int = 0
    guest_nice: int = 0

    @classmethod
    def parse(cls, line: str) -> MachineCpu:
        name, *values = line.split()
        if name != "cpu":
            raise ValueError(f"not the cpu line of /proc/stat: {line[:40]!r}")
        return cls(*(int(v) for v in values[:10]))

    def busy_ticks(self) -> int:
        """What the machine's CPUs worked: user, nice, system, irq, softirq. Not idle or
        iowait; not steal (the hypervisor ran someone else); not guest and guest_nice (already
        inside user and nice)."""
        return self.user + self.nice + self.system + self.irq + self.softirq


def machine_busy_s() -> float:
    """CPU seconds the machine's CPUs worked since boot (:meth:`MachineCpu.busy_ticks`)."""
    with open("/proc/stat") as f:
        return MachineCpu.parse(f.readline()).busy_ticks() / clock_ticks()


def cgroup_cpu_s(*dirs: Path) -> float:
    """CPU seconds charged to cgroups (their descendants included): ``cpu.stat`` usage_usec
    (v2) or ``cpuacct.usage`` (v1, ns); 0 for one that is gone or not made yet."""
    total = 0.0
    for d in dirs:
        try:
            if (d / "cpuacct.usage").exists():
                total += int((d / "cpuacct.usage").read_text()) / 1e9
                continue
            for line in (d / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    total += int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
    return total


class CpuMeter:
    """CPU seconds spent by named sources between start and stop (``with`` or
    :meth:`start`/:meth:`stop`): each source is a function returning a cumulative figure (e.g.
    :func:`machine_busy_s`, ``lambda: process_cpu_s(pid)``); ``spent`` holds the differences and
    ``wall_s``."""

    def __init__(self, sources: Mapping[str, Callable[[], float]]) -> None:
        self.sources = dict(sources)
        self.spent: dict[str, float] = {}
        self._t0 = 0.0
        self._start: dict[str, float] = {}

    def start(self) -> Self:
        self._start = {k: f() for k, f in self.sources.items()}
        self._t0 = time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._t0
        self.spent = {k: f() - self._start[k] for k, f in self.sources.items()}
        self.spent["wall_s"] = wall
        return self.spent

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- memory -----------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def mem_available() -> int:
    """MemAvailable, bytes. A drop of it across a phase is the host memory the phase took,
    moving with everything else on the host too."""
    return meminfo()["MemAvailable"]


def used_without_page_cache() -> int:
    """Bytes in use that page cache does not explain: anonymous and kernel memory, shmem
    (tmpfs) counted as used although it sits in Cached."""
    m = meminfo()
    return (m["MemTotal"] - m["MemFree"] - m["Buffers"] - m["Cached"] - m["SReclaimable"]
            + m["Shmem"])


def rss_bytes(pid: int) -> int:
    """VmRSS of a process (0 for a zombie); OSError if it is gone."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def smaps_rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (``Rss``, ``Pss`` -- shared pages split among their
    sharers --, ``Anonymous``, ...); {} if the process is gone."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def own_superblocks(mountinfo: str, host_mountinfo: str) -> set[tuple[str, str]]:
    """(fs type, first mount point) of each superblock a sandbox's mount table (its
    ``/proc/<pid>/mountinfo``) holds of its own: its root's (the overlay, made on the host) and
    every one no mount of ``host_mountinfo`` has. Each superblock makes every memory cgroup of
    the host bigger (backends/container/masks.py)."""
    host = {line.split()[2] for line in host_mountinfo.splitlines()}
    own: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        f = line.split()
        if f[2] not in host or f[4] == "/":
            own.setdefault(f[2], (f[f.index("-") + 1], f[4]))
    return set(own.values())


def cgroup_memory_bytes(pid: int) -> int:
    """The charge of a process's memory cgroup (v1 ``memory.usage_in_bytes``, else v2
    ``memory.current``; pages shared by KSM are charged once); 0 if none or gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        for line in lines:
            _, ctl, path = line.split(":", 2)
            if ctl == "memory":
                return int(Path(f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
                           .read_text())
            if ctl == "" and Path(f"/sys/fs/cgroup{path}/memory.current").is_file():
                return int(Path(f"/sys/fs/cgroup{path}/memory.current").read_text())
    except (OSError, ValueError):
        pass
    return 0


# ---- processes --------------------------------------------------------------------------------


def find_pids(*, comm: str | None = None, comm_prefix: str | None = None,
              cgroup_part: str | None = None, argv_has: Sequence[bytes] = ()) -> list[int]:
    """Pids of the processes whose command name is ``comm`` (or starts with ``comm_prefix``),
    whose ``/proc/<pid>/cgroup`` contains ``cgroup_part`` and whose argv holds each of
    ``argv_has`` as a whole argument; each test only when given."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if comm is not None or comm_prefix is not None:
                name = Path(f"/proc/{d}/comm").read_text().rstrip("\n")
                if (comm is not None and name != comm) or (
                        comm_prefix is not None and not name.startswith(comm_prefix)):
                    continue
            if cgroup_part is not None and cgroup_part not in Path(f"/proc/{d}/cgroup").read_text():
                continue
            if argv_has:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                if not all(a in argv for a in argv_has):
                    continue
        except OSError:
            continue
        out.append(int(d))
    return out


# ---- output -----------------------------------------------------------------------------------


def say(msg: str) -> None:
    """A progress line (flushed: a benchmark's output is read while it runs)."""
    print(msg, flush=True)


def rounded(x: Any, digits: int | None = 3) -> Any:
    """``x`` with every float rounded to ``digits`` (None: as it is), in dicts, lists and tuples
    too (tuples become lists, as in JSON); NaN and infinities become None (JSON has neither)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return round(x, digits) if digits is not None else x
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v, digits) for v in x]
    return x


def emit(res: Mapping[str, Any], json_out: bool, digits: int | None = 3) -> dict[str, Any]:
    """A benchmark's result, :func:`rounded`; with ``json_out`` printed as one JSON object on
    one line, which must be the benchmark's last line of output. The run being recorded
    (:class:`BenchRun`) keeps it as its result."""
    out: dict[str, Any] = rounded(dict(res), digits)
    run = _current_run.get()
    if run is not None:
        run.result = out
    if json_out:
        print(json.dumps(out), flush=True)
    return out


# ---- the record of one run: result + raw samples (docs/bench-results) --------------------------

RESULTS_DIR = "docs/bench-results"
SAMPLES_KEEP = 20_000  # per series: a plot's CDF needs no more; bounds a soak's file


@dataclass
class BenchRun:
    """One ``rollbox bench NAME`` run: what :func:`emit` printed and every series of raw
    latency samples (milliseconds) that :func:`record` was given meanwhile. Active for the
    ``with`` block (a context variable: code the run awaits or calls sees it; a benchmark's
    child process does not, so only the parent's samples are kept)."""

    bench: str
    argv: list[str] = field(default_factory=list)
    started: str = ""
    finished: str = ""
    result: dict[str, Any] | None = None
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    load_start: float = 0.0
    _token: contextvars.Token[BenchRun | None] | None = None

    def __enter__(self) -> Self:
        self.started = _utc_now()
        self.load_start = os.getloadavg()[0]
        self._token = _current_run.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished = _utc_now()
        if self._token is not None:
            _current_run.reset(self._token)
            self._token = None

    def record(self, series: str, xs_s: Iterable[float]) -> None:
        name, k = series, 2
        while name in self.samples_ms:  # a series taken twice keeps both: name, name#2, ...
            name, k = f"{series}#{k}", k + 1
        xs = [x * 1000 for x in xs_s]
        if len(xs) > SAMPLES_KEEP:  # evenly thinned, in order
            step = len(xs) / SAMPLES_KEEP
            xs = [xs[int(i * step)] for i in range(SAMPLES_KEEP)]
        self.samples_ms[name] = rounded(xs, 4)

    def document(self) -> dict[str, Any]:
        """What is saved: ``{"bench", "started", "finished", "argv", "commit", "load_start",
        "result", "samples_ms"}`` (``result`` is what ``--json`` printed)."""
        return {"bench": self.bench, "started": self.started, "finished": self.finished,
                "argv": self.argv, "commit": _git_commit(), "load_start": self.load_start,
                "result": self.result, "samples_ms": self.samples_ms}

    def save(self, results_dir: Path | None = None) -> Path:
        """Write :meth:`document` as ``<results_dir>/<bench>-<started, UTC>.json`` (default
        ``docs/bench-results`` of this checkout); returns the path."""
        if self.result is None:
            raise ValueError(f"benchmark {self.bench} emitted no result: nothing to save")
        from rollbox.config import REPO_ROOT

        out_dir = results_dir or REPO_ROOT / RESULTS_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = self.started.replace("-", "").replace(":", "")[:13]  # 20261202T1418
        path = out_dir / f"{self.bench}-{stamp}.json"
        k = 2
        while path.exists():
            path, k = out_dir / f"{self.bench}-{stamp}-{k}.json", k + 1
        path.write_text(json.dumps(self.document(), indent=None) + "\n")
        return path


_current_run: contextvars.ContextVar[BenchRun | None] = contextvars.ContextVar(
    "rollbox_bench_run", default=None)


def record(series: str, xs_s: Iterable[float]) -> None:
    """Keep samples (seconds) of a latency as raw series ``series`` of the run being recorded,
    if any (for its CDF plot); nothing otherwise."""
    run = _current_run.get()
    if run is not None:
        run.record(series, xs_s)


def _utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git_commit() -> str | None:
    from rollbox.config import REPO_ROOT

    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# ---- loading a benchmark ----------------------------------------------------------------------


def bench_path(name: str) -> Path:
    from rollbox.config import REPO_ROOT

    return REPO_ROOT / "bench" / f"{name}.py"


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` of this checkout as module ``rollbox_bench_NAME`` (registered in
    ``sys.modules``: its dataclasses need that); FileNotFoundError if there is none."""
    path = bench_path(name)
    spec = importlib.util.spec_from_file_location(f"rollbox_bench_{name}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"benchmark {name} not found at {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
