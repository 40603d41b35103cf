"""``GET /v1/sandboxes/{id}/events``: a sandbox's audit trail as NDJSON, from a sequence number,
optionally following. Readable after the sandbox is gone by the project its log names."""
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse

from rollbox import errors
from rollbox.api.deps import Api, Who
from rollbox.api.streams import NDJSON

router = APIRouter(tags=["events"])


@router.get("/v1/sandboxes/{sandbox_id}/events", responses={200: {"content": {NDJSON: {}}}})
async def sandbox_events(
    sandbox_id: str, who: Who, api: Api,
    after: Annotated[int, Query(ge=0)] = 0, follow: bool = False,
) -> Response:
    try:
        await api.sandbox_edge(sandbox_id, who)
    except (errors.NotFound, errors.SandboxDead):
        # Gone (or never ours): the log itself says who owned it.
        owner = await api.logged_owner(sandbox_id)
        if owner is None or (not who.admin and owner != who.project):
            raise errors.NotFound(f"no sandbox {sandbox_id!r}") from None
    events = api.events

    async def body() -> AsyncIterator[bytes]:
        if follow:
            async for ev in events.follow(sandbox_id, after):
                yield ev.model_dump_json().encode() + b"\n"
            return
        last = after
        while True:
            batch = await events.read(sandbox_id, last, 1000)
            for ev in batch:
                yield ev.model_dump_json().encode() + b"\n"
            if len(batch) < 1000:
                return
            last = batch[-1].seq

    return StreamingResponse(body(), media_type=NDJSON)
