"""Admin-only routes ``/v1/keys``: list and revoke API keys.

Lists never carry a key's secret (only its display prefix); a revoke takes effect for the
running server at once (``iam.keys``). Owns only these routes.
"""
from typing import Annotated

from fastapi import APIRouter, Query, Response

from rollbox import models
from rollbox.api.deps import AdminWho, Api
from rollbox.iam import KeyInfo

router = APIRouter(tags=["admin"])


def key_info(k: KeyInfo) -> models.ApiKeyInfo:
    return models.ApiKeyInfo(key_id=k.key_id, display=k.display, project=k.project,
                             admin=k.admin, created_at=k.created_at,
                             last_used_at=k.last_used_at, revoked_at=k.revoked_at)


@router.get("/v1/keys", response_model=list[models.ApiKeyInfo])
async def list_keys(_: AdminWho, api: Api,
                    project: Annotated[str | None, Query(max_length=128)] = None,
                    revoked: bool = True) -> list[models.ApiKeyInfo]:
    """Every key (or one project's); ``revoked=false`` leaves revoked keys out."""
    return [key_info(k) for k in api.keys.list(project) if revoked or not k.revoked]


@router.delete("/v1/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, _: AdminWho, api: Api) -> Response:
    """Revoke a key: the next request with it is refused (NotFound if no active key)."""
    api.keys.revoke(key_id)
    return Response(status_code=204)
