"""The lazy loader's families on a real edge, scraped from its HTTP ``/metrics`` (the cluster
token) and parsed with Prometheus' text parser, through a real lazy pull: a layer pushed to a
``dir://`` chunk store served with an injected 20 ms per request, dropped from the node's store,
read by a real sandbox through the FUSE daemon and EROFS. The fetch latency histogram counts
every chunk the daemon fetched (its stats file says how many), none faster than the store's
injected delay, and the cache-read and bytes families move by what the daemon counted; after
a daemon restart the histogram goes on from what the old daemon counted. The edge started before the node had a lazy layer: its families come from the loader the first lazy
mount made."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollbox.config import Settings
from rollbox.edge import wire
from rollbox.images import chunks
from rollbox.images.lazy.loader import loader_for
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.lazy.paths import FETCH_BUCKETS
from rollbox.images.store import ImageStore
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import CLUSTER_TOKEN, have_image, served_edge
from tests.integration.test_lazy_loading import lazy_edge, lazy_store  # noqa: F401 - fixtures

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/fuse").exists(),
                                 reason="needs root and /dev/fuse")]
DELAY_S = 0.02


async def scrape(url: str) -> list:
    async with aiohttp.ClientSession() as s, s.get(
            url + wire.PREFIX + "/metrics",
            headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"}) as r:
        assert r.status == 200
        return list(text_string_to_metric_families(await r.text()))


def samples(fams: list, name: str, **labels: str) -> list:
    return [s for f in fams for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def total(fams: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples(fams, name, **labels))


@pytest.mark.skipif(not have_image("busybox:test"), reason="busybox:test not built")
async def test_lazy_fetch_latency_cache_reads_and_bytes(
        lazy_edge, lazy_store: ImageStore, tmp_node_dir: Path) -> None:  # noqa: F811
    node_store = ImageStore(Settings().images_dir)
    bb = node_store.resolve("busybox:test")
    layer = bb.layers[0]
    await asyncio.to_thread(lazy_store.add_layer_file, node_store.layer_path(layer))
    url = f"dir://{tmp_node_dir}/chunks"
    await chunks.push_layer(lazy_store, layer, chunks.open_store(url), chunk_size=64 << 10)
    (lazy_store.layers_dir / f"{layer}.erofs").unlink()
    # Served with a 20 ms round trip per request: every fetch takes at least that.
    loader_for(lazy_store).register(layer, f"{url}?latency_ms={DELAY_S * 1000:g}")
    lazy_store.tag("lazy/bb:1", bb.layers, bb.config)
    assert lazy_store.is_lazy(layer) and not lazy_store.has_layer(layer)
    assert lazy_edge._lazy is None  # started before the node had a lazy layer

    node = lazy_edge.node_id
    loader = loader_for(lazy_store)

    async def read_in_a_sandbox(url: str) -> tuple[list, dict]:
        """A sandbox reads the whole busybox binary; then (the daemon flushes its stats every
        0.25 s, prefetches may still land) the scrape once it and the daemon's file agree."""
        sb = await lazy_edge.create(SandboxSpec(image="lazy/bb:1"), "t")
        try:
            eid = await lazy_edge.exec_start(sb.id, ExecSpec(
                cmd="busybox cat /bin/busybox | busybox wc -c"))
            r = await lazy_edge.exec_wait(sb.id, eid)
            assert r.exit_code == 0 and int(r.stdout) > 100_000, r
            deadline, agreed, fams, st = time.monotonic() + 15, 0, [], {}
            while time.monotonic() < deadline and agreed < 2:
                await asyncio.sleep(0.3)
                st = loader.layer_stats(layer) or {}
                fams = await scrape(url)
                same = total(fams, "rollbox_lazy_fetch_seconds_count") == st.get("chunks_fetched")
                agreed = agreed + 1 if same else 0
            assert agreed >= 2, (st, total(fams, "rollbox_lazy_fetch_seconds_count"))
            assert sb.id not in "\n".join(str(x) for f in fams for x in f.samples)
        finally:
            await lazy_edge.delete(sb.id)
        return fams, st

    async with served_edge(lazy_edge) as remote:
        await scrape(remote.url)
        fams, st = await read_in_a_sandbox(remote.url)
        # The histogram outlives the daemon: a new daemon loads it with the counters, so after
        # a restart the families still equal the daemon's (cumulative) chunks_fetched.
        assert not await asyncio.to_thread(LayerMounts(lazy_store).unmount_all)
        assert await asyncio.to_thread(loader.stop_sync)
        fams2, st2 = await read_in_a_sandbox(remote.url)
        assert st2["chunks_fetched"] >= st["chunks_fetched"]
        assert total(fams2, "rollbox_lazy_fetch_seconds_count") == st2["chunks_fetched"]
    fetched = st["chunks_fetched"]
    assert fetched >= 2 and total(fams, "rollbox_lazy_fetch_seconds_count", kind="demand") >= 1
    for kind in ("demand", "prefetch"):
        buckets = {s.labels["le"]: s.value for s in samples(
            fams, "rollbox_lazy_fetch_seconds_bucket", node=node, kind=kind)}
        assert list(buckets) == [*(repr(b) for b in FETCH_BUCKETS), "+Inf"]
        values = list(buckets.values())
        assert values == sorted(values)  # cumulative
        count = total(fams, "rollbox_lazy_fetch_seconds_count", node=node, kind=kind)
        assert buckets["+Inf"] == count
        # The injected delay is a floor: no fetch in a bucket below it, the sum above it.
        assert buckets["0.01"] == 0, buckets
        assert total(fams, "rollbox_lazy_fetch_seconds_sum", kind=kind) >= DELAY_S * count
    assert total(fams, "rollbox_lazy_cache_reads_total", node=node, result="miss") \
        == st["cache_misses"] > 0
    assert total(fams, "rollbox_lazy_cache_reads_total", node=node, result="hit") \
        == st["cache_hits"]
    assert total(fams, "rollbox_lazy_fetch_bytes_total", node=node) == st["bytes_fetched"] > 0
    assert total(fams, "rollbox_lazy_cache_bytes", node=node, what="used") > 0
