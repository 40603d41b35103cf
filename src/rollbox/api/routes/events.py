"""``GET /v1/sandboxes/{id}/events``: a sandbox's audit trail as NDJSON, from a sequence number,
optionally following. The trail is the edge's (``EdgeAPI.events`` of the sandbox's node; it
outlives the sandbox): readable after the sandbox is gone by the project its log names."""
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse

from rollbox import errors
from rollbox.api.deps import Api, Who
from rollbox.api.streams import NDJSON, primed

router = APIRouter(tags=["events"])


@router.get("/v1/sandboxes/{sandbox_id}/events", responses={200: {"content": {NDJSON: {}}}})
async def sandbox_events(
    sandbox_id: str, who: Who, api: Api,
    after: Annotated[int, Query(ge=0)] = 0, follow: bool = False,
) -> Response:
    try:
        edge = await api.sandbox_edge(sandbox_id, who)
    except (errors.NotFound, errors.SandboxDead):
        # Gone (or never ours): the log itself says who owned it. An unknown node stays
        # NotFound; a node that does not answer gives its own error.
        owner = await api.logged_owner(sandbox_id)
        if owner is None or (not who.admin and owner != who.project):
            raise errors.NotFound(f"no sandbox {sandbox_id!r}") from None
        edge = api.placement.edge_for(sandbox_id)

    async def body() -> AsyncIterator[bytes]:
        async for ev in events:
            yield ev.model_dump_json().encode() + b"\n"

    events = await primed(edge.events(sandbox_id, after, follow), 0.2)
    return StreamingResponse(body(), media_type=NDJSON)
