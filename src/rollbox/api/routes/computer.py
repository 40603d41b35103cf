"""Routes ``/v1/sandboxes/{id}/screenshot``, ``/display`` and ``/computer``: computer use of a
"vm" sandbox (docs/backends/vm.md). The edge checks and records every action in the sandbox's
event log (``computer.<action>``); the api adds nothing but the ownership check (``deps.Edge``).
A sandbox of another backend answers 400 ``bad_request`` (reason ``no_display``), a paused one
409 ``sandbox_paused``. Owns the HTTP shapes only; no behaviour."""
from typing import Literal

from fastapi import APIRouter, Query, Response

from rollbox import models
from rollbox.api.deps import Edge

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
