"""The lazy daemon's chunk cache without FUSE: a Layer over a real dir:// chunk store, driven
directly (fetch dedupe, verification, bitmap persistence, unclean-restart re-hashing, eviction),
plus the store's view of lazy layers and sandbox attribution."""
from __future__ import annotations

import asyncio
import errno
import json
import threading
import time
from pathlib import Path

import mfusepy
import pytest

from rollbox.config import Settings
from rollbox.errors import NodeCacheFull
from rollbox.images import chunks
from rollbox.images.lazy.daemon import Daemon
from rollbox.images.lazy.loader import LazyLoader, sandbox_of
from rollbox.images.lazy.paths import LazyPaths
from rollbox.images.store import ImageStore

CHUNK = 4096


@pytest.fixture
def setup(tmp_path: Path):
    store = ImageStore(tmp_path / "images")
    data = b"".join(bytes([i]) * CHUNK for i in range(10)) + b"tail"
    layer_file = tmp_path / "layer.bin"
    layer_file.write_bytes(data)
    digest = "sha256-" + __import__("hashlib").sha256(data).hexdigest()
    url = f"dir://{tmp_path}/chunks"
    cs = chunks.open_store(url)
    refs = []
    for ref, stored in chunks.chunk_layer(layer_file, CHUNK):
        asyncio.run(cs.put_chunk(ref, stored))
        refs.append(ref)
    m = chunks.LayerManifest(layer=digest, size=len(data), chunk_size=CHUNK, chunks=refs)
    LazyLoader(store).register(digest, url, m)
    daemons: list[Daemon] = []

    def new_daemon(**kw) -> Daemon:
        d = Daemon(LazyPaths(store.root), 1, tmp_path / "mnt", cache_limit=kw.pop("limit", 1 << 30),
                   readahead=kw.pop("readahead", 0), **kw)
        daemons.append(d)
        return d

    yield store, digest, data, url, new_daemon
    for d in daemons:
        if not d.loop.is_closed():
            d.stop_fetch_loop()


def test_reads_fetch_once_and_survive_restart(setup) -> None:
    _store, digest, data, _url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(layer.read(100, CHUNK * 3, "/a")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data[CHUNK * 3:CHUNK * 3 + 100]] * 8
    assert layer.counters["chunks_fetched"] == 1  # eight readers, one fetch
    assert layer.read(10_000, len(data) - 50, "/a") == data[-50:]
    assert layer.read(10, len(data) + 5, "/a") == b""
    d.flush_stats()
    fetched = layer.counters["bytes_fetched"]
    # A clean restart trusts the bitmap: nothing fetched again.
    d.destroy("/")
    d2 = new_daemon()
    assert d2.trusted
    l2 = d2.layer(digest)
    assert l2 is not None and l2.read(100, CHUNK * 3, "/b") == data[CHUNK * 3:CHUNK * 3 + 100]
    assert l2.counters["bytes_fetched"] == fetched and l2.counters["chunks_verified"] == 0


def test_unclean_restart_rehashes_and_refetches_torn_chunk(setup) -> None:
    store, digest, data, _url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    layer.read(CHUNK * 2, 0, "/a")
    paths = LazyPaths(store.root)
    # A torn write: present byte set, data on disk wrong (what a crash could leave).
    with open(paths.cache_file(digest), "r+b") as f:
        f.seek(10)
        f.write(b"XXXX")
    d2 = new_daemon()  # no .clean marker: the previous daemon did not shut down
    assert not d2.trusted
    l2 = d2.layer(digest)
    assert l2 is not None
    assert l2.read(CHUNK, 0, "/b") == data[:CHUNK]  # re-fetched, never the torn bytes
    assert l2.read(CHUNK, CHUNK, "/b") == data[CHUNK:CHUNK * 2]
    assert l2.counters["chunks_verified"] == 1  # chunk 1 was intact, checked once


def test_corrupt_or_missing_chunk_is_eio_with_typed_reason(setup, tmp_path: Path) -> None:
    _store, digest, data, _url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    key = chunks.chunk_key(layer.m.chunks[4].digest, "none")
    (tmp_path / "chunks" / key).write_bytes(b"\0" * CHUNK)
    with pytest.raises(mfusepy.FuseOSError) as err:
        layer.read(10, CHUNK * 4, "/a")
    assert err.value.errno == errno.EIO
    assert layer.last_error is not None and layer.last_error["code"] == "chunk_corrupt"
    assert not layer.present[4]
    (tmp_path / "chunks" / key).unlink()
    with pytest.raises(mfusepy.FuseOSError):
        layer.read(10, CHUNK * 4, "/a")
    assert layer.last_error["code"] == "chunk_missing"
    assert layer.read(10, 0, "/a") == data[:10]  # other chunks unaffected


def test_cache_limit_evicts_least_recent_unused_layer(setup) -> None:
    store, digest, _data, _url, new_daemon = setup
    d = new_daemon(limit=2 * CHUNK + 100)
    layer = d.layer(digest)
    assert layer is not None
    layer.read(2 * CHUNK, 0, "/a")
    # Nothing else to evict and the layer itself is never evicted while being filled.
    with pytest.raises(NodeCacheFull):
        d.make_room(2 * CHUNK, keep=digest)
    with pytest.raises(mfusepy.FuseOSError):
        layer.read(10, 5 * CHUNK, "/a")
    assert layer.last_error["code"] == "cache_full"
    # Unused (no open handle) and not the requester: evictable.
    d.make_room(2 * CHUNK, keep="sha256-" + "0" * 64)
    assert digest not in d.layers and not LazyPaths(store.root).cache_file(digest).exists()


def test_stats_and_attribution(setup) -> None:
    store, digest, _data, _url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    layer.read(100, 0, "/rollbox/n1-0123456789ab/s1")
    layer.read(100, 0, "/rollbox/n1-0123456789ab/s2")
    layer.read(100, CHUNK, "/user.slice")
    d.flush_stats()
    st = LazyLoader(store).stats(cgroup_parent="rollbox")
    ls = st["layers"][digest]
    assert ls["bytes_requested"] == 300 and ls["cache_hits"] == 1 and ls["cache_misses"] == 2
    assert st["sandboxes"]["n1-0123456789ab"]["bytes_requested"] == 200
    assert st["sandboxes"]["n1-0123456789ab"]["cache_hits"] == 1
    assert sandbox_of("/rollbox/n1-0123456789ab/s1") == "n1-0123456789ab"
    assert sandbox_of("/user.slice") is None
    assert sandbox_of("/x/rollbox/abc/s", "rollbox") == "abc"
    assert json.loads(LazyPaths(store.root).stats_file(digest).read_text())["layer"] == digest


def test_store_sees_lazy_layers(setup) -> None:
    store, digest, data, url, _new_daemon = setup
    assert store.is_lazy(digest) and not store.has_layer(digest)
    assert store.layer_path(digest).name == f"{digest}.erofs"
    meta = store.layer_meta(digest)
    assert meta["size"] == len(data) and meta["lazy"]["store"] == url
    image = store.tag("lazy/t:1", [digest])
    assert store.resolve("lazy/t:1").layers == image.layers
    time.sleep(0)


def test_bytes_read_unique_counts_each_page_once(setup) -> None:
    """bytes_read_unique: distinct 4 KiB pages of the layer read through FUSE, clamped to the
    file's end; repeated reads add to bytes_requested only."""
    _store, digest, data, _url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    layer.read(100, 0, "/a")
    layer.read(100, 0, "/b")
    layer.read(100, CHUNK + 10, "/a")
    layer.read(10_000, len(data) - 50, "/a")  # last full page + the 4-byte tail page
    c = layer.counters
    assert c["bytes_requested"] == 350
    assert c["bytes_read_unique"] == 3 * 4096 + 4
    # Prefetch (read-ahead) fetches without counting as read.
    layer.prefetch([5, 6])
    deadline = time.monotonic() + 5
    while layer.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c["chunks_fetched"] == 6 and c["bytes_read_unique"] == 3 * 4096 + 4


def test_store_that_does_not_verify_is_hashed_by_the_daemon(setup) -> None:
    """Our stores verify each chunk in their worker thread (and the daemon trusts that); any
    other ChunkStore's bytes are hashed by the daemon before they reach the cache."""
    _store, digest, data, url, new_daemon = setup
    d = new_daemon()
    layer = d.layer(digest)
    assert layer is not None
    real = d.store_for(url)
    assert getattr(real, "verifies_chunks", False)

    class Unverified:  # returns wrong bytes for chunk 2, claims no verification
        verifies_chunks = False

        async def get_chunk(self, ref: chunks.ChunkRef) -> bytes:
            raw = await real.get_chunk(ref)
            return b"\xff" * len(raw) if ref.digest == layer.m.chunks[2].digest else raw

    d.stores[url] = Unverified()  # type: ignore[assignment]
    with pytest.raises(mfusepy.FuseOSError) as err:
        layer.read(10, CHUNK * 2, "/a")
    assert err.value.errno == errno.EIO
    assert layer.last_error is not None and layer.last_error["code"] == "chunk_corrupt"
    assert not layer.present[2]
    assert layer.read(10, CHUNK * 3, "/a") == data[CHUNK * 3:CHUNK * 3 + 10]


def test_trace_shared_through_the_store_prefetches_on_a_cold_node(setup, tmp_path: Path) -> None:
    """The first node's chunk-read trace goes into the store; a second node with a cold cache
    replays it as prefetch (verified chunks, like any fetch) before its reader asks."""
    store, digest, data, url, new_daemon = setup
    d1 = new_daemon()
    layer1 = d1.layer(digest)
    assert layer1 is not None
    deadline = time.monotonic() + 5
    while not layer1.share_trace and time.monotonic() < deadline:  # store checked: none yet
        time.sleep(0.01)
    assert layer1.share_trace
    for i in (7, 2, 5):
        assert layer1.read(10, CHUNK * i, "/a") == data[CHUNK * i:CHUNK * i + 10]
    layer1.save_trace()
    assert asyncio.run(chunks.open_store(url).get_trace(digest)) == [7, 2, 5]

    node2 = ImageStore(tmp_path / "images2")
    m = chunks.load_manifest(store, digest)
    LazyLoader(node2).register(digest, url, m)
    d2 = Daemon(LazyPaths(node2.root), 1, tmp_path / "mnt2", cache_limit=1 << 30, readahead=0)
    try:
        layer2 = d2.layer(digest)
        assert layer2 is not None
        deadline = time.monotonic() + 5
        while layer2.counters["chunks_prefetched"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [i for i in range(layer2.n) if layer2.present[i]] == [2, 5, 7]
        assert layer2.counters["chunks_prefetched"] == 3
        assert layer2.read(10, CHUNK * 5, "/b") == data[CHUNK * 5:CHUNK * 5 + 10]
        assert layer2.counters["cache_misses"] == 0
    finally:
        d2.stop_fetch_loop()


def test_node_local_traces_stay_out_of_the_store(setup) -> None:
    """lazy_store_traces off (the daemon's --no-store-traces): another node's trace in the
    store is not replayed, this node's is kept on the node and never put into the store."""
    store, digest, data, url, new_daemon = setup
    asyncio.run(chunks.open_store(url).put_trace(digest, [4, 6]))
    d = new_daemon(store_traces=False)
    layer = d.layer(digest)
    assert layer is not None
    time.sleep(0.5)  # on, the store's trace is replayed within milliseconds (the test above)
    assert layer.counters["chunks_prefetched"] == 0 and not layer.share_trace
    for i in (3, 1):
        assert layer.read(10, CHUNK * i, "/a") == data[CHUNK * i:CHUNK * i + 10]
    layer.save_trace()
    assert asyncio.run(chunks.open_store(url).get_trace(digest)) == [4, 6]


def test_the_loader_runs_the_daemon_with_the_node_settings(tmp_path: Path) -> None:
    s = Settings.scratch(tmp_path)
    store = ImageStore(tmp_path / "images")
    cmd = LazyLoader(store, s).daemon_command(3)
    assert cmd[cmd.index("--cache-limit") + 1] == str(64 << 30)
    assert cmd[cmd.index("--readahead") + 1] == "4" and cmd[cmd.index("--generation") + 1] == "3"
    assert not {"--read-ahead-kb", "--max-readahead", "--no-store-traces"} & set(cmd)
    s.lazy_cache_bytes, s.lazy_readahead, s.lazy_store_traces = 1 << 20, 8, False
    s.lazy_read_ahead_kb, s.lazy_max_readahead = 0, 131072
    cmd = LazyLoader(store, s).daemon_command(1)
    assert cmd[cmd.index("--cache-limit") + 1] == str(1 << 20)
    assert cmd[cmd.index("--readahead") + 1] == "8"
    assert cmd[cmd.index("--read-ahead-kb") + 1] == "0"
    assert cmd[cmd.index("--max-readahead") + 1] == "131072" and "--no-store-traces" in cmd
    cmd = LazyLoader(store, s, readahead=0, cache_limit=4096).daemon_command(1)
    assert cmd[cmd.index("--readahead") + 1] == "0"
    assert cmd[cmd.index("--cache-limit") + 1] == "4096"
