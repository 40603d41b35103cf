"""Measurements of the lazy loader against its targets: ``python bench/lazy.py share|burst|cached``.

- ``share``: bytes of an image fetched by a realistic Python workload (imports, pytest, pip,
  git) in one sandbox, cold node cache;
- ``burst``: N sandboxes from a cold node cache running that workload, lazy vs full pull, with
  injected store latency per request;
- ``cached``: reading every file of a layer through EROFS on the warm lazy cache vs EROFS on the
  local layer file (backing pages dropped with fadvise in both cases).

Each run uses private image stores, chunk store, cgroup parent and node id under a temp dir, and
removes all of it (mounts, daemon, sandboxes) at the end. A benchmark (it runs an edge), not
part of ``rollbox.images``. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, ratio
from rollbox.config import Settings
from rollbox.images import chunks
from rollbox.images.lazy.loader import LazyLoader
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.store import ImageStore

WORKLOAD = (
    "python3 -c 'import json, re, asyncio, subprocess, email, http.client, unittest, sqlite3, "
    "urllib.request, decimal, csv, argparse, logging, dataclasses, typing' && "
    "cd /tmp && printf 'def test_a():\\n    assert sum([1, 2]) == 3\\n' > test_a.py && "
    "python3 -m pytest -q test_a.py >/dev/null && pip --version >/dev/null && git --version"
)


def _settings(tmp: Path) -> Settings:
    s = Settings.scratch(tmp, images=tmp / "images")
    tag = secrets.token_hex(3)
    s.cgroup_parent = f"rollbox-lazym-{tag}"
    s.node_id = f"m{tag}"
    s.uid_slots = 64
    s.uid_base = Settings().uid_base + (Settings().uid_slots + 64 + 1100) * 65536
    return s


@asynccontextmanager
async def _edge(tmp: Path, store: ImageStore) -> AsyncIterator[Any]:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from rollbox.isolation import cgroups

    settings = _settings(tmp)
    settings.images_root = store.root
    events = EventLog(tmp / f"events-{secrets.token_hex(2)}.db")
    edge = Edge(settings, events, store=store)
    await edge.start()
    try:
        yield edge
    finally:
        await edge.close(destroy=True)
        events.close()
        cgroups.remove_parent_if_empty(settings.cgroup_parent)


async def _run(edge: Any, cmd: str) -> None:
    from rollbox.models import ExecSpec, SandboxSpec

    sb = await edge.create(SandboxSpec(image="m/img:1"), "measure")
    try:
        eid = await edge.exec_start(sb.id, ExecSpec(cmd=cmd))
        r = await edge.exec_wait(sb.id, eid)
        if r.exit_code != 0:
            raise RuntimeError(f"workload failed: {r.stdout[-300:]} {r.stderr[-300:]}")
    finally:
        await edge.delete(sb.id)


CHUNK_SIZE = 256 << 10  # of the pushes measured (--chunk-size)


async def _prepare(tmp: Path, image: str, chunk_size: int = CHUNK_SIZE
                   ) -> tuple[ImageStore, str, list[str], dict[str, Any]]:
    """Push ``image``'s layers from the node's store to a private dir:// store."""
    node = ImageStore(Settings().images_dir)
    img = node.resolve(image)
    origin = ImageStore(tmp / "origin")
    for layer in img.layers:
        await asyncio.to_thread(origin.add_layer_file, node.layer_path(layer))
    url = f"dir://{tmp}/chunks"
    dst = chunks.open_store(url)
    for layer in img.layers:
        await chunks.push_layer(origin, layer, dst, chunk_size=chunk_size)
    return origin, url, list(img.layers), img.config


def _cleanup(store: ImageStore) -> None:
    LayerMounts(store).unmount_all()
    LazyLoader(store).stop_sync()


async def _lazy_store(tmp: Path, name: str, url: str, layers: list[str],
                      config: dict[str, Any]) -> ImageStore:
    store = ImageStore(tmp / name)
    os.chmod(store.root, 0o755)
    loader = LazyLoader(store)
    for layer in layers:
        await asyncio.to_thread(loader.register, layer, url)
    store.tag("m/img:1", layers, config)
    return store


async def share(image: str = "python:3.11", chunk_size: int = CHUNK_SIZE) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-lazym-"))
    os.chmod(tmp, 0o711)
    try:
        _origin, url, layers, config = await _prepare(tmp, image, chunk_size)
        store = await _lazy_store(tmp, "lazy", url, layers, config)
        try:
            async with _edge(tmp, store) as edge:
                await _run(edge, WORKLOAD)
            await asyncio.sleep(0.4)
            st = LazyLoader(store).stats()["layers"]
        finally:
            _cleanup(store)
        size = sum(st[d]["size"] for d in layers)
        fetched = sum(st[d]["bytes_fetched"] for d in layers)
        requested = sum(st[d]["bytes_requested"] for d in layers)
        return {"image": image, "image_bytes": size, "bytes_fetched": fetched,
                "bytes_requested": requested, "fetched_share": fetched / size,
                "requested_share": requested / size}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def burst(n: int = 16, latency_ms: float = 2.0, image: str = "python:3.11",
                modes: tuple[str, ...] = ("full", "lazy"), chunk_size: int = CHUNK_SIZE
                ) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-lazym-"))
    os.chmod(tmp, 0o711)
    out: dict[str, Any] = {"sandboxes": n, "latency_ms": latency_ms, "image": image}
    try:
        _origin, url, layers, config = await _prepare(tmp, image, chunk_size)
        slow_url = f"{url}?latency_ms={latency_ms:g}"
        for mode in modes:
            if mode == "full":
                store = ImageStore(tmp / "full")
                os.chmod(store.root, 0o755)
            t0 = time.monotonic()
            if mode == "full":
                src = chunks.open_store(slow_url)
                for layer in layers:
                    await chunks.pull_layer(src, layer, store)
                store.tag("m/img:1", layers, config)
            else:
                store = await _lazy_store(tmp, "lazy", slow_url, layers, config)
            try:
                async with _edge(tmp, store) as edge:
                    await asyncio.gather(*(_run(edge, WORKLOAD) for _ in range(n)))
                    out[f"{mode}_s"] = time.monotonic() - t0
                await asyncio.sleep(0.4)
                if mode == "lazy":
                    st = LazyLoader(store).stats()["layers"]
                    out["lazy_bytes_written"] = sum(st[d]["bytes_written"] for d in layers)
                else:
                    out["full_bytes_written"] = sum(
                        (store.layers_dir / f"{d}.erofs").stat().st_size for d in layers)
            finally:
                _cleanup(store)
        if "full_s" in out and "lazy_s" in out:
            out["speedup"] = ratio(out["full_s"], out["lazy_s"])
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_tree(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            try:
                with open(p, "rb") as f:
                    while b := f.read(1 << 20):
                        total += len(b)
            except OSError:
                pass
    return total


async def cached(image: str = "debian:bookworm", rounds: int = 3,
                 chunk_size: int = CHUNK_SIZE) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-lazym-"))
    os.chmod(tmp, 0o711)
    try:
        origin, url, layers, config = await _prepare(tmp, image, chunk_size)
        layer = layers[-1]
        store = await _lazy_store(tmp, "lazy", url, [layer], config)
        loader = LazyLoader(store)
        local, lazy = LayerMounts(origin), LayerMounts(store)
        try:
            mnt = lazy.ensure_mounted(layer)
            _read_tree(mnt)  # warm the node cache (fetch everything read)
            lazy.unmount(layer)
            times: dict[str, list[float]] = {"local": [], "lazy": []}
            for _ in range(rounds):
                for kind, mounts, backing in (
                        ("local", local, [origin.layers_dir / f"{layer}.erofs"]),
                        ("lazy", lazy, [loader.paths.cache_file(layer)])):
                    for b in backing:
                        _drop(b)
                    m = mounts.ensure_mounted(layer)
                    if kind == "lazy":
                        _drop(loader.ensure_layer_sync(layer))  # the FUSE file's own pages
                    t0 = time.monotonic()
                    n = _read_tree(m)
                    times[kind].append(time.monotonic() - t0)
                    mounts.unmount(layer)
            best = {k: min(v) for k, v in times.items()}
            return {"image": image, "layer": layer, "bytes": n, "local_s": best["local"],
                    "lazy_s": best["lazy"], "ratio": ratio(best["lazy"], best["local"])}
        finally:
            local.unmount_all()
            _cleanup(store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/lazy.py")
    ap.add_argument("what", choices=("share", "burst", "cached"))
    ap.add_argument("--image", default=None)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=2.0)
    ap.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, help="bytes per pushed chunk")
    args = ap.parse_args()
    if args.what == "share":
        res = asyncio.run(share(args.image or "python:3.11", args.chunk_size))
    elif args.what == "burst":
        res = asyncio.run(burst(args.n, args.latency_ms, args.image or "python:3.11",
                                chunk_size=args.chunk_size))
    else:
        res = asyncio.run(cached(args.image or "debian:bookworm", chunk_size=args.chunk_size))
    emit(res, json_out=True, digits=None)


if __name__ == "__main__":
    main()
