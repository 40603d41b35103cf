"""``rollbox bench images [--quick] [--json]``: lazy loading vs full pull of a >= 1 GB image.

Set-up: ``python-big:3.11`` (``rollbox image ensure-bench-images``; ``--quick`` falls back to
``python:3.11``) is pushed into an S3-compatible server on loopback (moto, in its own process)
with 2 ms injected per request, in ``FULL_CHUNK_SIZE`` chunks for the full pull and
``LAZY_CHUNK_SIZE`` for lazy loading (both 1 MiB, measured: one push then serves both; see
docs/images.md "Chunk size"). Then, for each mode, on
a *cold node* (a fresh image store; the layer files' page cache evicted) N sandboxes are started
together and each runs the workload: import the standard library and a few packages (numpy,
dateutil, pytz, attrs, packaging), pytest on a small repo, git status.

- **full**: pull every layer (all chunks, verified), then start the sandboxes;
- **lazy**: pull the ref and manifests only, register the layers with the lazy loader
  (``rollbox.images.lazy``), start the sandboxes; chunks are fetched on first read.

Reported: ``full_pull_s_16`` / ``lazy_s_16`` (start of the mode to the last workload done),
``speedup_16``, time to first exec for 1 and 16 sandboxes, ``node_bytes_written_full/lazy``
(layer bytes written on the node), ``read_fraction`` (lazy, 16 sandboxes: distinct bytes of the
layer files that the EROFS mounts read through FUSE, 4 KiB pages, summed over layers / image
bytes), ``fetch_fraction`` (chunks fetched from the store, demand + read-ahead, / image bytes);
from the full run, the page residency of the layer files after the workload mapped to chunk
sizes. The last line of ``--json`` is one JSON object.

``python bench/images.py sweep [KiB,...] [readahead,...] [--full]``: one sandbox per point, chunk
size x read-ahead (the measurement behind ``LAZY_CHUNK_SIZE`` / ``LAZY_READAHEAD``).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import (
    CpuMeter, cgroup_cpu_s, emit, find_pids, machine_busy_s, percentile, process_cpu_s, say,
)
from rollbox.config import Settings
from rollbox.images import chunks
from rollbox.default_images import BENCH_IMAGE, PYTHON_IMAGE
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.store import ImageStore
from rollbox.images.stores.loopback_s3 import loopback_s3
from rollbox.models import Resources

LATENCY_MS = 2
CHUNK_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
BUCKET = "rollbox-bench"
STDLIB_IMPORTS = ("import json, os, sys, re, asyncio, email.parser, http.client, sqlite3, "
                  "xml.etree.ElementTree, unittest, decimal, csv, logging, argparse, subprocess")
# "A few packages": numpy (the usual compiled one) and light pure-Python ones in the image
# (dateutil, pytz from the pip layer; attrs, packaging from Debian). Not the scientific stack:
# 16 x scipy/pandas/sklearn imports on 2 cores is ~40 s of CPU that hides any pull time.
PACKAGE_IMPORTS = "import numpy, dateutil.parser, pytz, attr, packaging.version"
WORKLOAD_BIG = [
    f"python3 -c '{STDLIB_IMPORTS}; {PACKAGE_IMPORTS}'",
    "cd /work/repo && python3 -m pytest -q -p no:cacheprovider",
    "cd /work/repo && git status --short",
]
WORKLOAD_SMALL = [  # python:3.11 has no packages or repo: the quick fallback
    f"python3 -c '{STDLIB_IMPORTS}'",
    "python3 -m pytest --version",
    "git --version",
]
# Store layout per mode. The chunk size is per push; the sweep (docs/images.md, "Chunk size")
# found 1 MiB best for both on this store (per-request cost dominates: 64 KiB chunks fetch
# 3.7 % of the image but take 2.3x longer than 1 MiB chunks fetching 10 %), so both modes read
# the same pushed image. Kept separate so another store can pick differently.
FULL_CHUNK_SIZE = chunks.DEFAULT_CHUNK_SIZE
LAZY_CHUNK_SIZE = chunks.DEFAULT_CHUNK_SIZE
LAZY_READAHEAD = 4  # chunks, after two sequential reads


# ---- page-cache residency (which bytes of a layer file the workload read) -------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_pages(path: Path) -> bytes:
    """One byte per page of ``path``: 1 if in the page cache."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return bytes(b & 1 for b in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def chunk_fractions(traces: list[bytes], sizes: list[int]) -> dict[str, Any]:
    """From page residency: bytes read, and per chunk size the fraction of the image in
    touched chunks and the number of chunk fetches a lazy loader would make."""
    total = sum(sizes)
    out: dict[str, Any] = {"pages_read_fraction": sum(sum(t) for t in traces) * PAGE / total}
    for cs in CHUNK_SIZES:
        per = cs // PAGE
        touched = 0
        fetched_bytes = 0
        for trace, size in zip(traces, sizes, strict=True):
            for i in range(0, len(trace), per):
                if any(trace[i:i + per]):
                    touched += 1
                    fetched_bytes += min(cs, size - (i // per) * cs)
        out[f"chunk_{cs >> 10}k"] = {"read_fraction": fetched_bytes / total, "fetches": touched}
    return out


# ---- one cold node ------------------------------------------------------------------------

async def run_cmd(box: Any, cmd: str, env: dict[str, str]) -> tuple[int, bytes]:
    return await box.run_shell(cmd, env, 10 * 60, tail=2000)


# ---- CPU per component (where a run's time goes) -------------------------------------------

def component_cpu(url: str, cgroup_parent: str, daemon_pid: int | None) -> CpuMeter:
    """CPU seconds per component: the lazy FUSE daemon, the moto S3 server, the sandboxes (v1
    cpuacct of the bench's cgroup parent; 0 until the first sandbox makes it), this process
    (the bench: edge-side Python) with its reaped children (runc); :func:`with_rest` adds the
    rest of the machine (system-wide /proc/stat busy time minus those: kernel threads, other
    users' work)."""
    moto = next(iter(find_pids(argv_has=(b"moto.server", _store_port(url).encode()))), None)
    cpuacct = Path("/sys/fs/cgroup/cpuacct") / cgroup_parent
    return CpuMeter({"machine": machine_busy_s,
                     "bench": lambda: process_cpu_s(children=True),
                     "daemon": lambda: process_cpu_s(daemon_pid) if daemon_pid else 0.0,
                     "moto": lambda: process_cpu_s(moto) if moto else 0.0,
                     "sandboxes": lambda: cgroup_cpu_s(cpuacct)})


def _store_port(url: str) -> str:
    return url.split("endpoint=http://127.0.0.1:", 1)[-1].split("&", 1)[0]


def with_rest(spent: dict[str, float]) -> dict[str, float]:
    d = {"wall" if k == "wall_s" else k: round(v, 3) for k, v in spent.items()}
    d["rest"] = round(d["machine"] - d["bench"] - d["daemon"] - d["moto"] - d["sandboxes"], 3)
    return d


async def cold_node(mode: str, n: int, image_name: str, url: str, workload: list[str],
                    image_size: int, readahead: int = LAZY_READAHEAD,
                    node_dir: Path | None = None) -> dict[str, Any]:
    """Fresh node store; ``mode`` "full" or "lazy"; N sandboxes started together.

    ``node_dir`` (measurements only): use and keep this node directory, so a second lazy run
    finds the node cache of the first (warm node cache; page cache of its files evicted)."""
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.isolation.userns import UidSlots

    keep = node_dir is not None
    tmp = node_dir or Path(tempfile.mkdtemp(prefix=f"rollbox-bench-images-{mode}-"))
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o711)
    base = Settings()
    settings = Settings.scratch(tmp, images=tmp / "images")
    settings.cgroup_parent = f"rollbox-bench-{secrets.token_hex(2)}"
    settings.node_id = f"bi{secrets.token_hex(2)}"
    node = ImageStore(settings.images_root)
    slots = UidSlots(base.uid_base + (base.uid_slots + 4096) * 65536, n + 2)
    mounts = LayerMounts(node)
    backend = ContainerBackend(settings, mounts, slots)
    loader = None
    boxes: list[Any] = []
    res: dict[str, Any] = {"mode": mode, "n": n}
    src = chunks.open_store(url)
    try:
        if mode == "lazy":
            from rollbox.images.lazy.loader import LazyLoader

            # The lazy-loading daemon is a node service, started with the node like the edge
            # and the backend above (and outside the timer like them); its cache is cold:
            # registration, manifests and every chunk fetch are timed.
            loader = LazyLoader(node, readahead=readahead)
            await loader.start()
        t0 = time.monotonic()
        if mode == "full":
            image, stats = await chunks.pull_image(src, image_name, node)
            res["pull_s"] = time.monotonic() - t0
            res["node_bytes_written"] = sum(s.bytes_logical for s in stats)
            res["bytes_fetched"] = sum(s.bytes_transferred for s in stats)
            for d in image.layers:  # cold page cache: the workload's reads show in mincore
                evict(node.layer_path(d))
        else:
            assert loader is not None
            image, _ = await chunks.pull_image(src, image_name, node, lazy=True)
            for f in (tmp / "images").rglob("lazy/cache/*.erofs"):
                evict(f)  # a kept node cache (warm run): its bytes on disk, not in memory
            for d in image.layers:
                await asyncio.to_thread(loader.register, d, url, chunks.load_manifest(node, d))
            node.tag(image.name, image.layers, image.config)
            res["pull_s"] = time.monotonic() - t0
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "LANG": "C.UTF-8"}
        env.update(image.config.get("env", {}))
        first_exec: list[float] = []
        done: list[float] = []
        failures: list[str] = []
        meter = component_cpu(url, settings.cgroup_parent,
                              int((loader.daemon_state() or {}).get("pid", 0)) or None
                              if loader is not None else None).start()
        t_work = time.monotonic()

        async def one(i: int) -> None:
            box = await backend.create(f"bimg-{secrets.token_hex(6)}", list(image.layers),
                                       Resources(cpus=1, memory_mib=1536, pids=1024,
                                                 disk_mib=512, inodes=200_000), env)
            boxes.append(box)
            code, out = await run_cmd(box, "true", env)
            first_exec.append(time.monotonic() - t0)
            for cmd in workload:
                code, out = await run_cmd(box, cmd, env)
                if code != 0:
                    failures.append(f"{cmd!r} -> {code}: {out[-300:].decode(errors='replace')}")
            done.append(time.monotonic() - t0)

        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        res["cpu_s"] = with_rest(meter.stop())
        res["total_s"] = max(done) if done else None
        # The sandboxes' part alone (after the pull / lazy registration): for "full" this is
        # the floor, the same workloads with every layer local and the page cache cold.
        res["work_s"] = max(done) - (t_work - t0) if done else None
        res["first_exec_s"] = {"min": min(first_exec), "median": percentile(first_exec, 50),
                               "max": max(first_exec)} if first_exec else None
        res["errors"] = [f"{type(e).__name__}: {e}" for e in errors][:3] + failures[:3]
        if mode == "full":
            traces = [resident_pages(node.layer_path(d)) for d in image.layers]
            res["residency"] = chunk_fractions(traces, [node.layer_path(d).stat().st_size
                                                        for d in image.layers])
        elif loader is not None:
            st = loader.stats()
            layers = [st["layers"].get(d, {}) for d in image.layers]

            def total(key: str) -> int:
                return sum(int(x.get(key, 0)) for x in layers)

            res["node_bytes_written"] = total("bytes_written")
            res["bytes_fetched"] = total("bytes_fetched_stored") or total("bytes_fetched")
            # Distinct bytes of the layer files that the EROFS mounts read through FUSE (4 KiB
            # pages; kernel readahead on the FUSE files included): what the workload read.
            res["read_fraction"] = total("bytes_read_unique") / image_size
            # Chunks fetched from the store (demand misses + read-ahead) x chunk size.
            res["fetch_fraction"] = total("bytes_fetched") / image_size
            res["lazy_counters"] = {k: total(k) for k in ("bytes_requested", "bytes_read_unique",
                                                           "bytes_fetched",
                                                           "chunks_fetched", "chunks_prefetched",
                                                           "cache_misses", "fetch_errors")}
        return res
    finally:
        for box in boxes:
            with contextlib.suppress(Exception):
                await backend.destroy(box)
        with contextlib.suppress(Exception):
            backend.release_node_resources()
        with contextlib.suppress(Exception):
            mounts.unmount_all()
        if loader is not None:
            with contextlib.suppress(Exception):
                await loader.stop()
        slots.close()
        await src.close()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- main ---------------------------------------------------------------------------------

def pick_image(quick: bool) -> tuple[ImageStore, str, list[str]]:
    store = ImageStore(Settings().images_dir)
    if store.exists(BENCH_IMAGE):
        return store, BENCH_IMAGE, WORKLOAD_BIG
    if quick:
        say(f"{BENCH_IMAGE} not built: --quick uses {PYTHON_IMAGE}")
        return store, PYTHON_IMAGE, WORKLOAD_SMALL
    raise SystemExit(f"{BENCH_IMAGE} is not built: run `rollbox image ensure-bench-images`")


async def push(store: ImageStore, name: str, endpoint: str, chunk_size: int) -> tuple[str, float]:
    """Push ``name`` with ``chunk_size`` under its own prefix; (store URL, seconds)."""
    url = (f"s3://{BUCKET}/c{chunk_size >> 10}k?endpoint={endpoint}&latency_ms={LATENCY_MS}")
    dst = chunks.open_store(url)
    t = time.monotonic()
    try:
        await chunks.push_image(store, name, dst, chunk_size=chunk_size)
    finally:
        await dst.close()
    return url, time.monotonic() - t


async def run(quick: bool) -> dict[str, Any]:
    store, name, workload = pick_image(quick)
    image = store.resolve(name)
    size = sum(store.layer_path(d).stat().st_size for d in image.layers)
    n_big = 4 if quick else 16
    out: dict[str, Any] = {"image": name, "image_bytes": size, "layers": len(image.layers),
                           "latency_ms": LATENCY_MS, "chunk_size_full": FULL_CHUNK_SIZE,
                           "chunk_size_lazy": LAZY_CHUNK_SIZE, "readahead_chunks": LAZY_READAHEAD,
                           "n": n_big, "load_before": os.getloadavg()}
    try:
        import rollbox.images.lazy.loader  # noqa: F401
        have_lazy = True
    except ImportError as exc:
        say(f"lazy loader not available ({exc}): full pull only")
        have_lazy = False
    with loopback_s3(BUCKET) as endpoint:
        urls: dict[str, str] = {}
        for mode, cs in (("full", FULL_CHUNK_SIZE), ("lazy", LAZY_CHUNK_SIZE)):
            if mode == "lazy" and not have_lazy:
                continue
            if mode == "lazy" and cs == FULL_CHUNK_SIZE:
                urls["lazy"] = urls["full"]
                continue
            urls[mode], out[f"push_s_{mode}"] = await push(store, name, endpoint, cs)
            say(f"pushed {name} ({size / 2**20:.0f} MiB, {len(image.layers)} layers, "
                f"{cs >> 10} KiB chunks) in {out[f'push_s_{mode}']:.1f}s")
        runs: dict[str, Any] = {}
        modes = ["full", "lazy"] if have_lazy else ["full"]
        for mode in modes:
            for n in (1, n_big):
                say(f"{mode} n={n} ...")
                r = await cold_node(mode, n, name, urls[mode], workload, size)
                runs[f"{mode}_{n}"] = r
                say(f"  total {r['total_s']:.1f}s, first exec "
                    f"{(r['first_exec_s'] or {}).get('median', float('nan')):.1f}s, "
                    f"written {r.get('node_bytes_written', 0) / 2**20:.0f} MiB, "
                    f"read {r.get('read_fraction', float('nan')):.3f} "
                    f"fetched {r.get('fetch_fraction', float('nan')):.3f}, "
                    f"errors {r['errors']}")
    out["load_after"] = os.getloadavg()
    out["runs"] = runs
    full, full1 = runs[f"full_{n_big}"], runs["full_1"]
    out[f"full_pull_s_{n_big}"] = full["total_s"]
    out["full_pull_s_1"] = full1["total_s"]
    out["first_exec_full_1_s"] = (full1["first_exec_s"] or {}).get("max")
    out[f"first_exec_full_{n_big}_s"] = (full["first_exec_s"] or {}).get("median")
    out["node_bytes_written_full"] = full["node_bytes_written"]
    out["residency"] = res_ = full.get("residency")
    if res_ and full1.get("pull_s"):
        # Chunk-size trade-off: a cold read blocks on one fetch per missing chunk; model the
        # serial time as fetches x (round trip + chunk / measured pull bandwidth).
        bw = full1["bytes_fetched"] / full1["pull_s"]
        out["pull_bandwidth_mib_s"] = bw / 2**20
        for cs in CHUNK_SIZES:
            r = res_[f"chunk_{cs >> 10}k"]
            r["modeled_serial_fetch_s"] = r["fetches"] * (LATENCY_MS / 1000 + cs / bw)
    if have_lazy:
        lazy, lazy1 = runs[f"lazy_{n_big}"], runs["lazy_1"]
        out[f"lazy_s_{n_big}"] = lazy["total_s"]
        out["lazy_s_1"] = lazy1["total_s"]
        out[f"speedup_{n_big}"] = (full["total_s"] / lazy["total_s"]
                                   if full["total_s"] and lazy["total_s"] else None)
        out["speedup_1"] = (full1["total_s"] / lazy1["total_s"]
                            if full1["total_s"] and lazy1["total_s"] else None)
        out["first_exec_lazy_1_s"] = (lazy1["first_exec_s"] or {}).get("max")
        out[f"first_exec_lazy_{n_big}_s"] = (lazy["first_exec_s"] or {}).get("median")
        out["node_bytes_written_lazy"] = lazy.get("node_bytes_written")
        out["read_fraction"] = lazy.get("read_fraction")
        out["fetch_fraction"] = lazy.get("fetch_fraction")
    out["errors"] = sum(len(r["errors"]) for r in runs.values())
    return out


async def sweep(sizes: list[int], readaheads: list[int], full: bool) -> list[dict[str, Any]]:
    """Chunk size x read-ahead for one sandbox on a cold node (the measurement behind
    LAZY_CHUNK_SIZE / LAZY_READAHEAD): ``python bench/images.py sweep``."""
    store, name, workload = pick_image(True)
    image = store.resolve(name)
    size = sum(store.layer_path(d).stat().st_size for d in image.layers)
    rows: list[dict[str, Any]] = []
    with loopback_s3(BUCKET) as endpoint:
        for cs in sizes:
            url, push_s = await push(store, name, endpoint, cs)
            if full:
                r = await cold_node("full", 1, name, url, workload, size)
                rows.append({"chunk_kib": cs >> 10, "mode": "full", "push_s": push_s,
                             "pull_s": r["pull_s"], "total_s": r["total_s"],
                             "errors": r["errors"], "load": os.getloadavg()[0]})
                say(json.dumps(rows[-1]))
            for ra in readaheads:
                r = await cold_node("lazy", 1, name, url, workload, size, readahead=ra)
                c = r["lazy_counters"]
                rows.append({"chunk_kib": cs >> 10, "mode": "lazy", "readahead": ra,
                             "total_s": r["total_s"],
                             "first_exec_s": (r["first_exec_s"] or {}).get("max"),
                             "read_fraction": r["read_fraction"],
                             "fetch_fraction": r["fetch_fraction"],
                             "demand_fetches": c["chunks_fetched"] - c["chunks_prefetched"],
                             "prefetches": c["chunks_prefetched"], "errors": r["errors"],
                             "load": os.getloadavg()[0]})
                say(json.dumps(rows[-1]))
    return rows


async def floor(n: int = 16, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Where the lazy run's time goes: ``python bench/images.py floor [N [LABEL,...]]``
    (labels: local, lazy_cold, lazy_warm, lazy_cold_traced; default all). N sandboxes with
    every layer local (the full run's work part: pull done, page cache evicted), lazy from a
    cold node cache, lazy from a warm node cache (the cold run's chunks kept, page cache
    evicted), lazy from a cold node cache again with the chunk-read trace the first lazy node
    left in the store; CPU per component for each."""
    store, name, workload = pick_image(False)
    image = store.resolve(name)
    size = sum(store.layer_path(d).stat().st_size for d in image.layers)
    out: dict[str, Any] = {"image": name, "n": n, "load_before": os.getloadavg()}
    node = Path(tempfile.mkdtemp(prefix="rollbox-bench-images-warm-"))
    try:
        with loopback_s3(BUCKET) as endpoint:
            url, _ = await push(store, name, endpoint, LAZY_CHUNK_SIZE)
            for label, mode, kept in (("local", "full", None), ("lazy_cold", "lazy", node),
                                      ("lazy_warm", "lazy", node),
                                      # a fresh node again: cold cache, the store holds the
                                      # trace the lazy_cold node put there
                                      ("lazy_cold_traced", "lazy", None)):
                if only and label not in only:
                    continue
                r = await cold_node(mode, n, name, url, workload, size, node_dir=kept)
                out[label] = {k: r.get(k) for k in ("total_s", "work_s", "pull_s", "cpu_s",
                                                    "errors", "lazy_counters")}
                if label == "lazy_cold":  # chunk read order per layer (first touches)
                    out["traces"] = {t.name.split(".")[0][:19]: json.loads(t.read_text())
                                     for t in node.rglob("lazy/cache/*.trace")}
                say(f"{label}: work {r['work_s']:.2f}s (total {r['total_s']:.2f}s) "
                    f"cpu {r['cpu_s']} errors {r['errors']}")
    finally:
        shutil.rmtree(node, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    return out


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    res = asyncio.run(run(quick))
    summary = {k: v for k, v in res.items() if k != "runs"}
    say(json.dumps(summary, indent=1))
    return emit(res, json_out, digits=None)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["sweep"]:
        kib = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,256,1024").split(",")]
        ras = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0,4").split(",")]
        asyncio.run(sweep([k << 10 for k in kib], ras, full="--full" in sys.argv))
    elif sys.argv[1:2] == ["floor"]:
        print(json.dumps(asyncio.run(floor(int(sys.argv[2]) if len(sys.argv) > 2 else 16,
                                           tuple(sys.argv[3].split(",")) if len(sys.argv) > 3
                                           else ()))))
    else:
        main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
