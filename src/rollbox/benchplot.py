"""Plots of benchmark results: one PNG per saved run, drawn from what ``benchkit.BenchRun``
saved (``docs/bench-results/NAME-STAMP.json``), never by rerunning a benchmark.

A result is a flat JSON object whose keys follow the benchmarks' naming, so the plot is found in
the keys rather than written per benchmark:

- *against concurrency or count*: ``<figure>_c<N>`` (``create_exec_destroy_per_s_c8``) and
  ``<stem><N>_<figure>`` (``fork8_ready_p50_ms``; not a percentile's ``p50_``) are one series
  over N when two or more N are present; rates (``per_s``) and times (``_ms``) get their own
  axes;
- *latency CDFs*: the raw samples a run recorded (``samples_ms``), one curve per series;
  a run without samples gets bars of its ``<figure>_p50_ms`` / ``_p99_ms`` instead;
- *against the peer*: every number with the word ``ratio``, ``vs``, ``over`` or ``speedup``
  in its key (measured in the same run), as bars beside the line at 1;
- *the figures*: the other numbers with a unit in their key (``_ms``, ``_s``, ``per_s``,
  ``_mib``, ``_mib_s``), as bars per unit, for the units no panel above has drawn (a ratio's
  bar alone says little: these are the figures it comes from: ``lazy_s`` and ``local_s``).

Files saved before the run record existed hold only the result (no samples): they are drawn
without the CDF panel.

Owns: reading saved results, finding their series, drawing (matplotlib, Agg backend, imported
only when a plot is drawn). Must not touch: the benchmarks or the runtime; imports ``benchkit``
only for the results directory's name.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.benchkit import RESULTS_DIR

PLOTS_DIR = "docs/bench-plots"
CDF_SERIES_MAX = 10  # the largest series drawn; more are unreadable on one axis
RATIO_BARS_MAX = 24
RATIO_LOG_SPAN = 20  # ratios spanning more than this get a log axis
FIGURE_BARS_MAX = 16  # per figures panel
FIGURE_PANELS_MAX = 2  # the units with the most figures

_FILE_RE = re.compile(r"^(?P<bench>.+?)-(?P<stamp>\d{4}-?\d{2}-?\d{2}T\d{4}[0-9-]*)\.json$")
_CONC_RE = re.compile(r"^(?P<figure>[a-z][a-z0-9_]*?)_c(?P<n>\d+)$")
_P50_RE = re.compile(r"^(?P<figure>[a-z][a-z0-9_]*)_p50_ms$")
_PCT_RE = re.compile(r"(?:^|_)p\d+(?:_|$)")  # a percentile: exec_p50_ms, p99_ms_c8
_PER_SECOND_RE = re.compile(r"_per_(?:[a-z]+_)*?[a-z]+_s(?:_|$)")  # calls_per_own_cpu_s
_PER_S_RE = re.compile(r"per_s(?:_|$)")  # per_s_c8, not per_sandbox
_COUNT_RE = re.compile(r"^(?P<stem>[a-z][a-z_]*?[a-z])(?P<n>\d+)_(?P<figure>[a-z][a-z0-9_]*)$")


class ResultError(ValueError):
    """A saved result that cannot be read or drawn (names the file)."""


@dataclass(frozen=True)
class SavedRun:
    path: Path
    bench: str
    stamp: str
    result: dict[str, Any]
    samples_ms: dict[str, list[float]]
    meta: dict[str, Any]

    @property
    def title(self) -> str:
        bits = [self.bench, self.meta.get("started") or self.stamp]
        if self.meta.get("commit"):
            bits.append(f"main {self.meta['commit'][:8]}")
        if isinstance(self.meta.get("load_start"), int | float):
            bits.append(f"load {self.meta['load_start']:.1f} at start")
        return " · ".join(str(b) for b in bits)


def load(path: Path) -> SavedRun:
    """A saved run: ``benchkit.BenchRun.document()`` or, for older files, the bare result."""
    m = _FILE_RE.match(path.name)
    if m is None:
        raise ResultError(f"{path}: not a saved result's name (NAME-YYYYMMDDTHHMM.json)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"{path}: {exc}") from None
    return from_document(doc, path, m["bench"], m["stamp"])


def from_document(doc: Any, path: Path, bench: str, stamp: str) -> SavedRun:
    """A run from a ``BenchRun.document()`` (or a bare result: older files); ``path`` only
    names it in errors."""
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: not a JSON object")
    if not isinstance(doc.get("result"), dict):
        return SavedRun(path, bench, stamp, doc, {}, {})
    samples = doc.get("samples_ms") or {}
    if not isinstance(samples, dict):
        raise ResultError(f"{path}: samples_ms is not an object")
    clean = {str(k): [float(x) for x in v if isinstance(x, int | float)]
             for k, v in samples.items() if isinstance(v, list)}
    meta = {k: v for k, v in doc.items() if k not in ("result", "samples_ms")}
    return SavedRun(path, str(doc.get("bench") or bench), stamp, doc["result"], clean, meta)


def flatten(result: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The result's numbers as ``{key: value}``, nested objects joined with ``_`` (a list of
    objects by index: ``samples_0_pss_mib``); booleans, strings, other lists and non-finite
    numbers left out."""
    out: dict[str, float] = {}
    for k, v in result.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}_"))
        elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            for i, x in enumerate(v):  # rows of a table (microvm_idle's samples): by index
                out.update(flatten(x, f"{key}_{i}_"))
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def is_ratio(key: str) -> bool:
    words = key.split("_")
    return "ratio" in words or "vs" in words or "over" in words or "speedup" in words


def scaling_series(flat: Mapping[str, float]) -> dict[str, dict[int, float]]:
    """``{series name: {N: value}}`` for every figure present at two or more N (ratios are the
    peer panel's, not here)."""
    return {k: {n: v for n, (_, v) in pts.items()} for k, pts in _scaling(flat).items()}


def _scaling(flat: Mapping[str, float]) -> dict[str, dict[int, tuple[str, float]]]:
    found: dict[str, dict[int, tuple[str, float]]] = defaultdict(dict)
    for key, v in flat.items():
        if is_ratio(key):
            continue
        m = _CONC_RE.match(key)
        if m is not None:
            found[f"{m['figure']} (c=N)"][int(m["n"])] = (key, v)
            continue
        m = _COUNT_RE.match(key)
        if m is not None and not (m["stem"] == "p" or m["stem"].endswith("_p")):  # p50, p99
            found[f"{m['stem']}N_{m['figure']}"][int(m["n"])] = (key, v)
    return {k: dict(sorted(v.items())) for k, v in found.items() if len(v) >= 2}


def percentiles(flat: Mapping[str, float], in_series: Iterable[str]) -> dict[str, tuple[float, float | None]]:
    """``{figure: (p50, p99 or None)}`` of every ``<figure>_p50_ms`` that no scaling series
    draws already."""
    drawn = set(in_series)
    out: dict[str, tuple[float, float | None]] = {}
    for key, v in sorted(flat.items()):
        m = _P50_RE.match(key)
        if m is None or key in drawn:
            continue
        out[m["figure"]] = (v, flat.get(f"{m['figure']}_p99_ms"))
    return dict(list(out.items())[:RATIO_BARS_MAX])


def ratios(flat: Mapping[str, float]) -> dict[str, float]:
    picked = {k: v for k, v in flat.items() if is_ratio(k) and v > 0}
    return dict(sorted(picked.items())[:RATIO_BARS_MAX])


def figure_unit(key: str) -> str | None:
    """The unit a figure's key names (``write_mib_s``: MiB/s, ``lazy_s_4``: s), or None."""
    def has(suffix: str) -> bool:
        return key.endswith(suffix) or f"{suffix}_" in key

    if _PER_S_RE.search(key) or has("_rps") or _PER_SECOND_RE.search(key):
        return "per second"
    for suffix, unit in (("_mib_s", "MiB/s"), ("_ms", "ms"), ("_mib", "MiB"), ("_s", "s")):
        if has(suffix):
            return unit
    return None


def figures(flat: Mapping[str, float], drawn: Iterable[str], units_drawn: Iterable[str] = ()
            ) -> dict[str, dict[str, float]]:
    """``{unit: {key: value}}`` of the numbers with a unit that no other panel draws (not in
    ``drawn``, not a ratio, not of a unit in ``units_drawn``): the FIGURE_PANELS_MAX units with
    the most (two at least), each its first FIGURE_BARS_MAX keys."""
    skip, done = set(drawn), set(units_drawn)
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for key, v in sorted(flat.items()):
        unit = figure_unit(key)
        if unit is not None and unit not in done and key not in skip and not is_ratio(key):
            found[unit][key] = v
    best = sorted(((u, kv) for u, kv in found.items() if len(kv) >= 2),  # one: a setting
                  key=lambda kv: -len(kv[1]))[:FIGURE_PANELS_MAX]
    return {u: dict(list(kv.items())[:FIGURE_BARS_MAX]) for u, kv in best}


def _unit(name: str) -> str | None:
    if _PER_S_RE.search(name) or name.endswith("_rps") or "_rps_" in name:
        return "per second"
    if "_ms" in name:
        return "ms"
    return None


def plot(run: SavedRun, out: Path) -> Path:
    """Draw ``run`` into the PNG ``out`` (its panels: scaling, CDFs, ratios, each only where the
    result has something for it); returns ``out``. ResultError if it has nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flat = flatten(run.result)
    scale = scaling_series(flat)
    pcts = percentiles(flat, (key for pts in _scaling(flat).values() for key, _ in pts.values()))
    by_unit: dict[str, dict[str, dict[int, float]]] = defaultdict(dict)
    for name, pts in scale.items():
        unit = _unit(name)
        if unit is not None:
            by_unit[unit][name] = pts
    cdfs = {k: sorted(v) for k, v in sorted(run.samples_ms.items(), key=lambda kv: -len(kv[1]))
            if len(v) >= 2}
    cdfs = dict(list(cdfs.items())[:CDF_SERIES_MAX])
    peer = ratios(flat)
    in_scale = {key for pts in _scaling(flat).values() for key, _ in pts.values()}
    # Percentiles are drawn already: as bars, or (with samples) as the CDFs; other times
    # (CPU per call, a phase's ms) are figures.
    shown_pcts = ({k for k in flat if _PCT_RE.search(k)} if cdfs else
                  {f"{f}_p{q}_ms" for f in pcts for q in (50, 99)})
    figs = figures(flat, in_scale | shown_pcts, set(by_unit))
    panels = [("scale", u) for u in sorted(by_unit)] + ([("cdf", "")] if cdfs else []) + (
        [("pct", "")] if pcts and not cdfs else []) + ([("ratio", "")] if peer else []) + [
        ("figures", u) for u in figs]
    if not panels:
        raise ResultError(f"{run.path}: no series, samples or ratios to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for ax, (kind, unit) in zip((a[0] for a in axes), panels, strict=True):
        if kind == "scale":
            for name, pts in sorted(by_unit[unit].items()):
                style = "--" if "p99" in name else "-"
                ax.plot(list(pts), list(pts.values()), style, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({n for p in by_unit[unit].values() for n in p}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("N (concurrency c=N, or count)")
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.set_title("against concurrency / count")
        elif kind == "cdf":
            for name, xs in cdfs.items():
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
            if min(x for xs in cdfs.values() for x in xs) > 0:
                ax.set_xscale("log")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of samples ≤ x")
            ax.set_ylim(0, 1.01)
            ax.set_title("latency CDFs (raw samples)")
        elif kind == "pct":
            names = list(pcts)
            p99 = [pcts[n][1] if pcts[n][1] is not None else 0.0 for n in names]
            ax.barh(names, p99, color="tab:orange", alpha=0.5, label="p99")
            ax.barh(names, [pcts[n][0] for n in names], color="tab:blue", label="p50")
            ax.set_xlabel("ms")
            ax.set_title("latencies (p50, p99; no raw samples were saved)")
        elif kind == "figures":
            names = list(figs[unit])
            vals = [figs[unit][n] for n in names]
            ax.barh(names, vals, color="tab:green")
            pos = [v for v in vals if v > 0]
            if pos and min(vals) > 0 and max(pos) / min(pos) > RATIO_LOG_SPAN:
                ax.set_xscale("log")
            ax.set_xlabel(unit)
            ax.set_title(f"figures of the run ({unit})")
            for i, v in enumerate(vals):
                ax.text(v, i, f" {v:.4g}", va="center", fontsize=8)
        else:
            names = list(peer)
            # one colour: whether above 1 is better depends on the figure (a rate or a time)
            ax.barh(names, [peer[n] for n in names], color="tab:blue")
            ax.axvline(1.0, color="black", linewidth=0.8)
            vals = list(peer.values())
            if max(vals) / min(vals) > RATIO_LOG_SPAN:  # else a log axis hides the bars' start
                ax.set_xscale("log")
            ax.set_xlabel("ratio (rollbox against the peer of the same run; see the key)")
            ax.set_title("against the peer measured in the same run")
            for i, n in enumerate(names):
                ax.text(peer[n], i, f" {peer[n]:.3g}", va="center", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        if kind not in ("ratio", "figures"):
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(run.title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def newest_per_bench(paths: Iterable[Path]) -> dict[str, SavedRun]:
    """The newest readable saved run of each benchmark (by its file's stamp)."""
    best: dict[str, SavedRun] = {}
    for p in sorted(paths):
        try:
            run = load(p)
        except ResultError:
            continue
        key = _FILE_RE.match(p.name)["bench"]  # type: ignore[index]
        if key not in best or run.stamp.replace("-", "") >= best[key].stamp.replace("-", ""):
            best[key] = run
    return best


def redraw_all(results_dir: Path, out_dir: Path) -> dict[str, Path]:
    """``out_dir/NAME.png`` from the newest saved run of every benchmark in ``results_dir``;
    ``{NAME: png}``. A run with nothing to draw is skipped (named in the ResultError it would
    raise, not an abort of the rest)."""
    if not results_dir.is_dir():
        raise ResultError(f"{results_dir}: no such directory of saved results")
    drawn: dict[str, Path] = {}
    for name, run in sorted(newest_per_bench(results_dir.glob("*.json")).items()):
        try:
            drawn[name] = plot(run, out_dir / f"{name}.png")
        except ResultError:
            continue
    return drawn


def default_dirs() -> tuple[Path, Path]:
    from rollbox.config import REPO_ROOT

    return REPO_ROOT / RESULTS_DIR, REPO_ROOT / PLOTS_DIR
