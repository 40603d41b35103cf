"""Routes ``/v1/sandboxes/{id}/screenshot``, ``/display``, ``/computer`` and ``/view``: computer use of a
"vm" sandbox (docs/backends/vm.md). The edge checks and records every action in the sandbox's
event log (``computer.<action>``); the api adds nothing but the ownership check (``deps.Edge``).
A sandbox of another backend answers 400 ``bad_request`` (reason ``no_display``), a paused one
409 ``sandbox_paused``; while a person holds the live view's take-over, ``/computer`` answers 409
``display_locked``. ``/view`` issues a live view's login URL (the view itself:
``rollbox.api.liveview``). Owns the HTTP shapes only; no behaviour."""
import json
from typing import Literal

from fastapi import APIRouter, Query, Request, Response

from rollbox import models
from rollbox.api.deps import Edge, Who
from rollbox.api.liveview import LiveView, view_path

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/screenshot", tags=["computer"],
            responses={200: {"content": {"image/png": {}}}})
async def screenshot(sandbox_id: str, edge: Edge,
                     format: Literal["png"] = Query("png")) -> Response:
    """The screen as the VM draws it now (PNG, as QEMU wrote it)."""
    data = await edge.screenshot(sandbox_id, format)
    return Response(content=data, media_type="image/png")


@router.get("/v1/sandboxes/{sandbox_id}/display", response_model=models.DisplayInfo,
            tags=["computer"])
async def display(sandbox_id: str, edge: Edge) -> models.DisplayInfo:
    return await edge.display_info(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/computer", response_model=models.ComputerActionResult,
             tags=["computer"])
async def computer_action(sandbox_id: str, body: models.ComputerAction,
                          edge: Edge) -> models.ComputerActionResult:
    """One mouse or keyboard action; bad input (off-screen, unknown keys, text it can not
    type) is a 400 naming why, and nothing reaches the guest."""
    return await edge.computer_action(sandbox_id, body)


@router.post("/v1/sandboxes/{sandbox_id}/view", response_model=models.ViewAccess,
             tags=["computer"])
async def view(sandbox_id: str, body: models.ViewRequest, edge: Edge, who: Who,
               request: Request) -> models.ViewAccess:
    """A live view of the screen: a URL a browser opens once (its one-time code becomes the
    view's cookie). A sandbox of another backend: 400 ``no_display``; paused: 409."""
    await edge.display_info(sandbox_id)  # a live VM with a screen, or the typed refusal
    live: LiveView = request.app.state.view
    code, code_exp, life = live.tokens.issue_code(sandbox_id, body.ttl_s)
    await edge.record_event(sandbox_id, "computer.view_issued", data=json.dumps(
        {"by": who.project, "key_id": who.key_id, "session": code.split(".")[3], "ttl_s": life}))
    return models.ViewAccess(sandbox_id=sandbox_id, url=f"{view_path(sandbox_id)}login/{code}",
                             code_expires_at=code_exp, expires_in_s=life)
