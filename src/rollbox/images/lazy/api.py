"""Front door ``GET /v1/images/stats``: lazy-loading counters of every in-process edge's node.

Per layer: bytes requested (reads through the daemon), bytes fetched from the chunk store, bytes
written to the node cache, cache hits/misses, chunks present. Per sandbox: the same read
counters, attributed by the reader's cgroup (the FUSE request's pid). Non-admin callers see only
their own sandboxes. Also the full-pull transfers of this process (``chunks.TRANSFERS``).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import FastAPI, Query

from rollbox.api.app import Who


def node_stats(edge: Any, project: str | None) -> dict[str, Any]:
    """Stats of one in-process edge's image store; sandboxes filtered to ``project`` unless
    None (admin)."""
    from rollbox.images.lazy.loader import loader_for

    st = loader_for(edge.store).stats(cgroup_parent=edge.settings.cgroup_parent)
    live = getattr(edge, "live", {})
    sandboxes = {}
    for sid, c in st["sandboxes"].items():
        owner = live[sid].info.owner if sid in live else None
        if project is None or owner == project:
            sandboxes[sid] = {**c, "live": sid in live}
    st["sandboxes"] = sandboxes
    return st


def mount(app: FastAPI, api: Any) -> contextlib.AbstractAsyncContextManager[None] | None:

    @app.get("/v1/images/stats", tags=["images"])
    async def images_stats(
        who: Who,
        sandbox: Annotated[str | None, Query(max_length=128)] = None,
    ) -> dict[str, Any]:
        project = None if who.admin else who.project
        nodes: dict[str, Any] = {}
        for node_id, edge in api.placement.edges.items():
            if not hasattr(edge, "store") or not hasattr(edge, "settings"):
                nodes[node_id] = {"error": "remote edge: ask its node"}
                continue
            st = await asyncio.to_thread(node_stats, edge, project)
            if sandbox is not None:
                st["sandboxes"] = {k: v for k, v in st["sandboxes"].items() if k == sandbox}
            nodes[node_id] = st
        from rollbox.images import chunks

        transfers = [t.to_dict() for t in chunks.TRANSFERS[-100:]] if who.admin else []
        return {"nodes": nodes, "transfers": transfers}

    return None
