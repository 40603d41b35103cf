"""The api -> edge control path of a cluster: HTTP (``RemoteEdge``) vs a Ray actor call
(`rollbox bench cluster-control [--json]`).

A one-node cluster on this host (Ray head, its edge actor, one api replica) in a scratch dir
and port range. From one asyncio loop, the same edge is called both ways, interleaved:

* a small call: ``capacity()`` (the watcher's probe), 300 sequential round trips each way;
* ``create`` of a debian:bookworm container sandbox (then deleted, untimed), 20 each way.

HTTP is ``edge.remote.RemoteEdge`` to the edge's ``edge.service`` (keep-alive aiohttp,
bearer token); Ray is ``await actor.capacity.remote()`` / ``actor.create.remote()`` on the
``cluster.edge_actor.EdgeActor`` (which hops onto the edge's own loop). The ratio is
Ray over HTTP (> 1: HTTP is faster).
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, latency_ms, ratio, round_trips, say
from rollbox.config import Settings
from rollbox.models import SandboxSpec


async def measure(state: Any, quick: bool) -> dict[str, Any]:
    import ray

    from rollbox.cluster.edge_actor import edge_actor
    from rollbox.edge.remote import RemoteEdge

    node = state.nodes[0]
    token = Path(state.token_file).read_text().strip()
    remote = RemoteEdge(node.node_id, node.edge_url, token)
    actor = edge_actor(node.node_id)
    n_small, n_create = (60, 6) if quick else (300, 20)
    http_small: list[float] = []
    ray_small: list[float] = []

    async def http_cap() -> object:
        return await remote.capacity()

    async def ray_cap() -> object:
        return await actor.capacity.remote()

    for _ in range(3):  # interleaved thirds
        http_small += await round_trips(http_cap, n_small // 3)
        ray_small += await round_trips(ray_cap, n_small // 3)
    spec = SandboxSpec(image="debian:bookworm")
    http_create: list[float] = []
    ray_create: list[float] = []
    for _ in range(n_create):
        t = time.monotonic()
        info = await remote.create(spec, "bench")
        http_create.append(time.monotonic() - t)
        await remote.delete(info.id)
        t = time.monotonic()
        raw = await actor.create.remote(spec.model_dump(mode="json"), "bench")
        ray_create.append(time.monotonic() - t)
        await remote.delete(raw["id"])
    await remote.close()
    del ray
    out = {**latency_ms(http_small, "capacity_http_"), **latency_ms(ray_small, "capacity_ray_"),
           **latency_ms(http_create, "create_http_"), **latency_ms(ray_create, "create_ray_")}
    out["capacity_ray_over_http_p50"] = ratio(out["capacity_ray_p50_ms"],
                                              out["capacity_http_p50_ms"])
    out["create_ray_over_http_p50"] = ratio(out["create_ray_p50_ms"], out["create_http_p50_ms"])
    return out


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    import ray

    from rollbox.cluster import local

    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-cluster-"))
    root.chmod(0o711)  # runc resolves rootfs paths as the sandbox's unprivileged host uid
    s = Settings()
    s.cluster_dir = root
    s.cluster_port_base = 48000 + 400 * secrets.randbelow(10)
    s.node_id = f"b{secrets.token_hex(2)}"
    try:
        say("cluster up (1 node, 1 replica)")
        state = local.up(s, replicas=1, nodes=1)
        ray.init(address=state.gcs, namespace="rollbox", log_to_driver=False,
                 logging_level="warning")
        try:
            res = asyncio.run(measure(state, quick))
        finally:
            ray.shutdown()
    finally:
        local.down(s)
        shutil.rmtree(root, ignore_errors=True)
    for k, v in res.items():
        say(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    return emit(res, json_out)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
