"""Front door ``GET /v1/images/stats``: lazy-loading counters of every edge's node
(``EdgeAPI.image_stats``).

Per layer: bytes requested (reads through the daemon), bytes fetched from the chunk store, bytes
written to the node cache, cache hits/misses, chunks present. Per sandbox: the same read
counters, attributed by the reader's cgroup (the FUSE request's pid). Non-admin callers see only
their own sandboxes. Also the full-pull transfers of this process (``chunks.TRANSFERS``).
"""
from __future__ import annotations

import contextlib
from typing import Annotated, Any

from fastapi import FastAPI, Query

from rollbox.api.app import Who
from rollbox.errors import RollboxError


def mount(app: FastAPI, api: Any) -> contextlib.AbstractAsyncContextManager[None] | None:

    @app.get("/v1/images/stats", tags=["images"])
    async def images_stats(
        who: Who,
        sandbox: Annotated[str | None, Query(max_length=128)] = None,
    ) -> dict[str, Any]:
        project = None if who.admin else who.project
        nodes: dict[str, Any] = {}
        for node_id, edge in api.placement.edges.items():
            try:  # EdgeAPI: a remote edge answers for its node
                st = await edge.image_stats(project)
            except RollboxError as exc:  # one node's trouble is not the others'
                nodes[node_id] = {"error": exc.message}
                continue
            if sandbox is not None:
                st["sandboxes"] = {k: v for k, v in st["sandboxes"].items() if k == sandbox}
            nodes[node_id] = st
        from rollbox.images import chunks

        transfers = [t.to_dict() for t in chunks.TRANSFERS[-100:]] if who.admin else []
        return {"nodes": nodes, "transfers": transfers}

    return None
