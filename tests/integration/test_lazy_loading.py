"""Lazy loading end to end: a layer pushed to a dir:// chunk store, dropped from a private image
store, served by the real FUSE daemon with EROFS on top, used by real sandboxes of a real edge.
Faults are injected for real: a killed daemon, a corrupted chunk, a missing store, a full cache
disk. Every mount (EROFS, FUSE, tmpfs) is gone at the end."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox.config import Settings
from rollbox.errors import ChunkCorrupt, InfraError, NodeCacheFull, StoreUnreachable
from rollbox.images import chunks
from rollbox.images.lazy.loader import LazyLoader, loader_for
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.store import ImageStore
from rollbox.isolation import syscalls
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import have_image, node_settings

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/fuse").exists(),
                                reason="needs root and /dev/fuse")
CHUNK = 256 << 10


def mounts_under(path: Path) -> list[str]:
    base = os.path.realpath(path) + "/"
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(base)]


def push_lazy(store: ImageStore, layer: str, url: str, chunk_size: int = CHUNK) -> None:
    """Push the layer to ``url``, then drop its local file: only the lazy record remains."""
    cs = chunks.open_store(url)
    asyncio.run(chunks.push_layer(store, layer, cs, chunk_size=chunk_size))
    (store.layers_dir / f"{layer}.erofs").unlink()
    loader_for(store).register(layer, url)


def small_layer(store: ImageStore, tmp: Path, files: int = 24, size: int = 200_000) -> str:
    src = tmp / "src"
    (src / "d").mkdir(parents=True)
    for i in range(files):
        (src / "d" / f"f{i}").write_bytes(bytes([i]) * size)
    return store.add_layer_from_dir(src, source="test")


def cleanup(store: ImageStore) -> None:
    LayerMounts(store).unmount_all()
    loader = loader_for(store)
    assert loader.stop_sync(), "lazy daemon still in use at the end"
    for mnt in reversed(mounts_under(store.root)):
        syscalls.umount(mnt, syscalls.MNT_DETACH)


@pytest.fixture
def lazy_store(tmp_node_dir: Path):
    store = ImageStore(tmp_node_dir / "images")
    os.chmod(store.root, 0o755)
    try:
        yield store
    finally:
        try:
            cleanup(store)
        finally:
            left = mounts_under(tmp_node_dir)
            assert not left, f"mounts left: {left}"


@pytest.fixture
async def lazy_edge(tmp_node_dir: Path, lazy_store: ImageStore) -> AsyncIterator:
    """A started edge whose image store is ``lazy_store`` (the node's images untouched)."""
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    settings = node_settings(tmp_node_dir)
    settings.images_root = lazy_store.root
    events = EventLog(tmp_node_dir / "events.db")
    e = Edge(settings, events, store=lazy_store)
    await e.start()
    try:
        yield e
    finally:
        await e.close(destroy=True)
        events.close()
        shutil.rmtree(settings.run_dir, ignore_errors=True)


async def run(edge, sid: str, cmd: str):
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd))
    return await edge.exec_wait(sid, eid)


@pytest.mark.skipif(not have_image("debian:bookworm"), reason="debian:bookworm not built")
async def test_lazy_sandbox_restart_and_crash(lazy_edge, lazy_store: ImageStore,
                                              tmp_node_dir: Path) -> None:
    node = ImageStore(Settings().images_dir)
    layer = node.resolve("debian:bookworm").layers[0]
    await asyncio.to_thread(lazy_store.add_layer_file, node.layer_path(layer))
    url = f"dir://{tmp_node_dir}/chunks"
    await asyncio.to_thread(push_lazy, lazy_store, layer, url, 1 << 20)
    lazy_store.tag("lazy/debian:1", [layer])
    assert lazy_store.is_lazy(layer) and not lazy_store.has_layer(layer)
    loader = loader_for(lazy_store)

    sb = await lazy_edge.create(SandboxSpec(image="lazy/debian:1"), "t")
    r = await run(lazy_edge, sb.id, "cat /etc/debian_version && ls /usr/bin | wc -l")
    assert r.exit_code == 0 and r.stdout.startswith("12."), r
    await asyncio.sleep(0.4)  # stats flush
    st = loader.stats()
    ls = st["layers"][layer]
    size = ls["size"]
    assert 0 < ls["bytes_fetched"] < 0.5 * size, ls
    assert ls["bytes_written"] == ls["bytes_fetched"]
    assert sb.id in st["sandboxes"], st["sandboxes"]  # attributed via the reader's cgroup
    assert st["sandboxes"][sb.id]["bytes_requested"] > 0
    fetched = ls["bytes_fetched"]

    # Daemon restart (no mount in use): nothing is fetched again.
    await lazy_edge.delete(sb.id)
    busy = await asyncio.to_thread(LayerMounts(lazy_store).unmount_all)
    assert not busy, [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                      if layer in ln]
    assert await asyncio.to_thread(loader.stop_sync), mounts_under(tmp_node_dir)
    # Counted after the clean stop: read-ahead still in flight at the first look may have
    # landed since (a prefetch, not a re-fetch).
    st = loader.layer_stats(layer) or {}
    fetched = st["bytes_fetched"]
    cached = st["chunks_present"]
    sb = await lazy_edge.create(SandboxSpec(image="lazy/debian:1"), "t")
    r = await run(lazy_edge, sb.id, "cat /etc/debian_version && ls /usr/bin | wc -l")
    assert r.exit_code == 0 and r.stdout.startswith("12.")
    await asyncio.sleep(0.4)
    ls = loader.stats()["layers"][layer]
    # Chunks cached before the restart are not fetched again: anything new is a chunk that
    # was not cached yet.
    assert ls["bytes_fetched"] - fetched <= (ls["chunks_present"] - cached) * (1 << 20), (
        "a restarted daemon re-fetched cached chunks")
    assert ls["cache_hits"] > 0

    # kill -9: cached pages keep serving the live sandbox; a new sandbox on the same layer
    # fails cleanly (typed, retryable) while the old mount is in use, and works once it is not.
    gen = loader.generation()
    os.kill(int(loader.daemon_state()["pid"]), signal.SIGKILL)
    await asyncio.sleep(0.3)
    r = await run(lazy_edge, sb.id, "cat /etc/debian_version")
    assert r.exit_code == 0 and r.stdout.startswith("12.")
    with pytest.raises(InfraError) as err:
        await lazy_edge.create(SandboxSpec(image="lazy/debian:1"), "t")
    assert err.value.retryable
    assert loader.generation() == gen + 1 and loader.healthy()  # restarted on demand
    await lazy_edge.delete(sb.id)
    sb = await lazy_edge.create(SandboxSpec(image="lazy/debian:1"), "t")
    r = await run(lazy_edge, sb.id, "cat /etc/debian_version && head -c 100000 /usr/bin/perl | wc -c")
    assert r.exit_code == 0 and r.stdout.split() [1] == "100000", r
    await asyncio.sleep(0.4)
    ls = loader.stats()["layers"][layer]
    assert ls["chunks_verified"] > 0  # after an unclean exit cached chunks are re-hashed
    await lazy_edge.delete(sb.id)


def test_corrupt_chunk_is_never_served(lazy_store: ImageStore, tmp_node_dir: Path) -> None:
    layer = small_layer(lazy_store, tmp_node_dir)
    url = f"dir://{tmp_node_dir}/chunks"
    push_lazy(lazy_store, layer, url, 64 << 10)
    m = chunks.load_manifest(lazy_store, layer)
    assert m is not None
    # Corrupt a late chunk (file data), keeping its size.
    bad = len(m.chunks) - 2
    path = tmp_node_dir / "chunks" / chunks.chunk_key(m.chunks[bad].digest, "none")
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    loader = LazyLoader(lazy_store, readahead=0)
    served = loader.ensure_layer_sync(layer)
    with open(served, "rb") as f:
        f.seek(bad * m.chunk_size)
        with pytest.raises(OSError) as err:
            f.read(4096)
    assert err.value.errno == 5  # EIO, never the corrupt bytes
    assert (loader.layer_stats(layer) or {})["last_error"]["code"] == "chunk_corrupt"
    # Corrupt chunk 0 (superblock): mounting fails with a typed, retryable error.
    loader.stop_sync()
    shutil.rmtree(loader.paths.cache)
    loader.paths.cache.mkdir()
    path0 = tmp_node_dir / "chunks" / chunks.chunk_key(m.chunks[0].digest, "none")
    path0.write_bytes(b"\0" * len(path0.read_bytes()))
    with pytest.raises(ChunkCorrupt) as err2:
        LayerMounts(lazy_store).ensure_mounted(layer)
    assert err2.value.retryable
    assert not LayerMounts(lazy_store).is_mounted(layer)


def test_unreachable_store_and_full_cache(lazy_store: ImageStore,
                                                tmp_node_dir: Path) -> None:
    layer = small_layer(lazy_store, tmp_node_dir)
    store_dir = tmp_node_dir / "chunks"
    push_lazy(lazy_store, layer, f"dir://{store_dir}", 64 << 10)
    store_dir.rename(tmp_node_dir / "chunks-away")
    store_dir.write_text("not a store")  # the path can neither be read nor re-created
    with pytest.raises(StoreUnreachable) as err:
        LayerMounts(lazy_store).ensure_mounted(layer)
    assert err.value.retryable
    store_dir.unlink()
    (tmp_node_dir / "chunks-away").rename(store_dir)
    loader = loader_for(lazy_store)
    assert loader.stop_sync()

    # A full cache disk: a 32 KiB tmpfs cannot take a 64 KiB chunk.
    shutil.rmtree(loader.paths.cache)
    loader.paths.cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(loader.paths.cache)],
                   check=True)
    try:
        with pytest.raises(NodeCacheFull) as err3:
            LayerMounts(lazy_store).ensure_mounted(layer)
        assert err3.value.retryable
        assert loader.stop_sync()
    finally:
        syscalls.umount(loader.paths.cache)
    # And with room, the same layer mounts and reads back exactly.
    mounts = LayerMounts(lazy_store)
    mnt = mounts.ensure_mounted(layer)
    assert (mnt / "d" / "f7").read_bytes() == bytes([7]) * 200_000
    mounts.unmount(layer)


def test_cache_limit_evicts_unused_layers(lazy_store: ImageStore,
                                                tmp_node_dir: Path) -> None:
    a = small_layer(lazy_store, tmp_node_dir / "a", files=8)
    b = small_layer(lazy_store, tmp_node_dir / "b", files=9)
    url = f"dir://{tmp_node_dir}/chunks"
    push_lazy(lazy_store, a, url, 64 << 10)
    push_lazy(lazy_store, b, url, 64 << 10)
    loader = LazyLoader(lazy_store, cache_limit=2_400_000)
    mounts = LayerMounts(lazy_store)
    mnt_a = mounts.ensure_mounted(a)
    for f in (mnt_a / "d").iterdir():
        f.read_bytes()
    assert loader.paths.cache_file(a).exists()
    mounts.unmount(a)  # a is now unused: evictable
    time.sleep(0.1)
    mnt_b = mounts.ensure_mounted(b)
    for f in (mnt_b / "d").iterdir():
        assert f.read_bytes() == bytes([int(f.name[1:])]) * 200_000
    assert not loader.paths.cache_file(a).exists(), "unused layer a was not evicted"
    mounts.unmount(b)


def test_trace_is_recorded_then_replayed(lazy_store: ImageStore, tmp_node_dir: Path) -> None:
    layer = small_layer(lazy_store, tmp_node_dir)
    push_lazy(lazy_store, layer, f"dir://{tmp_node_dir}/chunks", 64 << 10)
    loader = LazyLoader(lazy_store, readahead=0)  # prefetch only from the trace
    mounts = LayerMounts(lazy_store)
    mnt = mounts.ensure_mounted(layer)
    wanted = ["f3", "f11", "f17"]
    for name in wanted:
        (mnt / "d" / name).read_bytes()
    mounts.unmount(layer)  # the daemon saves the trace when the file is released
    assert loader.stop_sync()
    trace = loader.paths.trace_file(layer)
    assert trace.exists()
    first = (loader.layer_stats(layer) or {})["bytes_fetched"]
    # Cold cache, same trace: the first use of the layer prefetches what the trace names.
    for p in (loader.paths.cache_file(layer), loader.paths.present_file(layer)):
        p.unlink()
    mnt = mounts.ensure_mounted(layer)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = loader.layer_stats(layer) or {}
        if st.get("bytes_fetched", 0) >= 2 * first:
            break
        time.sleep(0.05)
    st = loader.layer_stats(layer) or {}
    assert st["chunks_prefetched"] > 0, st
    misses = st["cache_misses"]
    for name in wanted:
        assert (mnt / "d" / name).read_bytes() == bytes([int(name[1:])]) * 200_000
    time.sleep(0.4)
    # Replayed: (almost) every chunk is a hit; kernel readahead may reach a chunk or two
    # that the first run did not.
    extra = (loader.layer_stats(layer) or {})["cache_misses"] - misses
    assert extra <= max(2, len(json.loads(trace.read_text())) // 5), (extra, trace.read_text())
    mounts.unmount(layer)


@pytest.mark.skipif(not have_image("busybox:test"), reason="busybox:test not built")
async def test_pull_lazy_cli_and_stats_api(lazy_edge, lazy_store: ImageStore,
                                           tmp_node_dir: Path) -> None:
    import httpx
    from typer.testing import CliRunner

    import rollbox
    from rollbox.api import BackgroundServer, create_app
    from rollbox.iam import KeyStore
    from rollbox.image_cli import app as image_cli
    from rollbox.watcher import placement_over

    node = ImageStore(Settings().images_dir)
    bb = node.resolve("busybox:test")
    origin = ImageStore(tmp_node_dir / "origin")
    await asyncio.to_thread(origin.add_layer_file, node.layer_path(bb.layers[0]))
    origin.tag("lazy/bb:1", bb.layers, bb.config)
    url = f"dir://{tmp_node_dir}/chunks"
    runner = CliRunner()
    res = await asyncio.to_thread(runner.invoke, image_cli, [
        "--root", str(origin.root), "push", "lazy/bb:1", url, "--chunk-size", "65536"])
    assert res.exit_code == 0, res.output
    res = await asyncio.to_thread(runner.invoke, image_cli, [
        "--root", str(lazy_store.root), "pull", "--lazy", "lazy/bb:1", url])
    assert res.exit_code == 0, res.output
    assert lazy_store.is_lazy(bb.layers[0]) and lazy_store.exists("lazy/bb:1")

    keys = KeyStore(tmp_node_dir / "keys.db")
    key = keys.create("proj")
    other = keys.create("other")
    api_app = create_app(placement_over([lazy_edge]), keys)
    async with BackgroundServer(api_app) as srv, rollbox.AsyncClient(srv.url, key) as c:
        sb = await c.create("lazy/bb:1")
        r = await sb.exec("busybox ls /bin | busybox wc -l")
        assert r.exit_code == 0 and int(r.stdout) > 10
        await asyncio.sleep(0.4)
        async with httpx.AsyncClient(base_url=srv.url) as h:
            mine = (await h.get("/v1/images/stats",
                                headers={"Authorization": f"Bearer {key}"})).json()
            theirs = (await h.get("/v1/images/stats", headers={"X-API-Key": other})).json()
            anon = await h.get("/v1/images/stats")
        assert anon.status_code in (400, 401)  # as the core routes answer a missing key
        assert "nodes" in mine, mine
        st = mine["nodes"][lazy_edge.node_id]
        ls = st["layers"][bb.layers[0]]
        assert 0 < ls["bytes_fetched"] <= ls["size"] and ls["bytes_requested"] > 0
        assert st["sandboxes"][sb.id]["bytes_requested"] > 0 and st["sandboxes"][sb.id]["live"]
        assert sb.id not in theirs["nodes"][lazy_edge.node_id]["sandboxes"]
        res = await asyncio.to_thread(runner.invoke, image_cli, [
            "--root", str(lazy_store.root), "stats", "--json",
            "--cgroup-parent", lazy_edge.settings.cgroup_parent])
        assert res.exit_code == 0, res.output
        assert sb.id in json.loads(res.output)["sandboxes"]
        await sb.delete()


async def test_edge_watch_restarts_crashed_daemon(lazy_store: ImageStore,
                                                  tmp_node_dir: Path) -> None:
    """An edge on a node with lazy layers starts the loader's watch task: a daemon killed
    with no sandbox asking is replaced by a new generation within seconds; close() stops the
    watch only (mounts may still need the daemon)."""
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    layer = await asyncio.to_thread(small_layer, lazy_store, tmp_node_dir, 4, 50_000)
    await asyncio.to_thread(push_lazy, lazy_store, layer, f"dir://{tmp_node_dir}/chunks")
    settings = node_settings(tmp_node_dir)
    settings.images_root = lazy_store.root
    events = EventLog(tmp_node_dir / "events.db")
    edge = Edge(settings, events, store=lazy_store)
    await edge.start()
    try:
        loader = loader_for(lazy_store)
        assert edge._lazy is loader and loader.healthy()
        gen = loader.generation()
        os.kill(int(loader.daemon_state()["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (loader.generation() > gen
                                                   and loader.healthy()):
            await asyncio.sleep(0.1)
        assert loader.generation() == gen + 1 and loader.healthy()
    finally:
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(settings.run_dir, ignore_errors=True)
    assert edge._lazy is None and loader._watch is None


async def test_edge_without_lazy_layers_starts_no_daemon(lazy_edge) -> None:
    assert lazy_edge._lazy is None
    assert loader_for(lazy_edge.store).daemon_state() is None


def test_daemon_sets_fuse_readahead(lazy_store: ImageStore) -> None:
    """The daemon raises the kernel readahead of its FUSE mount (fewer round trips per cached
    read)."""
    from rollbox.images.lazy.daemon import FUSE_READ_AHEAD_KB

    state = loader_for(lazy_store).ensure_daemon()
    st = os.stat(state["mountpoint"])
    bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and int(bdi.read_text()) != FUSE_READ_AHEAD_KB:
        time.sleep(0.05)
    assert int(bdi.read_text()) == FUSE_READ_AHEAD_KB
