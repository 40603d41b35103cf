"""Routes of exposed ports' tokens: ``POST /v1/sandboxes/{id}/port-tokens`` (a token for one
port of a live sandbox of the caller's project). The proxy itself is not a route: it is the
middleware of ``rollbox.api.ports`` in front of the app (both of its forms, the path
``/v1/sandboxes/{id}/ports/{port}/...`` included, never reach the routers)."""
from fastapi import APIRouter, Request

from rollbox import errors, models
from rollbox.api.deps import Edge
from rollbox.api.ports import PortConfig, PortTokens

router = APIRouter()
LIVE = ("running", "paused", "creating")


def port_paths(sandbox_id: str, port: int, config: PortConfig) -> tuple[str, str | None]:
    """(the path form's path, the per-sandbox origin's host or None)."""
    host = f"{port}-{sandbox_id}.{config.domain.strip('.')}" if config.domain else None
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}/", host


@router.post("/v1/sandboxes/{sandbox_id}/port-tokens", response_model=models.PortAccess)
async def port_token(sandbox_id: str, body: models.PortTokenRequest, edge: Edge,
                     request: Request) -> models.PortAccess:
    info = await edge.get(sandbox_id)
    if info.state not in LIVE:
        raise errors.SandboxDead(f"sandbox {sandbox_id} is {info.state}", state=info.state)
    tokens: PortTokens = request.app.state.port_tokens
    token, exp = tokens.issue(sandbox_id, body.port, body.ttl_s)
    path, host = port_paths(sandbox_id, body.port, tokens.config)
    return models.PortAccess(sandbox_id=sandbox_id, port=body.port, path=path, host=host,
                             token=token, expires_at=exp)
