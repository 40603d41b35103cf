"""Routes ``/v1/keys``: create, list and revoke API keys, within what the caller administers
(an admin key of a project: its subtree; the operator's: everything).

Lists never carry a key's secret (only its display prefix); a revoke takes effect for the
running server at once (``iam.keys``; ``iam.postgres``: every replica). Owns only these routes.
"""
from typing import Annotated

from fastapi import APIRouter, Query, Response

from rollbox import models
from rollbox.api.deps import Api, Who
from rollbox.iam import KeyInfo

router = APIRouter(tags=["admin"])


def key_info(k: KeyInfo) -> models.ApiKeyInfo:
    return models.ApiKeyInfo(key_id=k.key_id, display=k.display, project=k.project,
                             admin=k.admin, created_at=k.created_at,
                             last_used_at=k.last_used_at, revoked_at=k.revoked_at,
                             scope=k.scope)


@router.post("/v1/keys", status_code=201, response_model=models.CreatedKey)
async def create_key(body: models.KeySpec, who: Who, api: Api) -> models.CreatedKey:
    """A key of a project the caller administers (else Forbidden); ``admin``: it administers
    that project's subtree. The secret is in this answer only."""
    key, info = await api.keys.create_key(who, body.project, body.admin, body.format)
    return models.CreatedKey(key=key, info=key_info(info))


@router.get("/v1/keys", response_model=list[models.ApiKeyInfo])
async def list_keys(who: Who, api: Api,
                    project: Annotated[str | None, Query(max_length=128)] = None,
                    revoked: bool = True) -> list[models.ApiKeyInfo]:
    """The keys of the caller's subtree (or one project's); ``revoked=false`` leaves revoked
    keys out."""
    return [key_info(k) for k in await api.keys.list_keys(who, project)
            if revoked or not k.revoked]


@router.delete("/v1/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, who: Who, api: Api) -> Response:
    """Revoke a key: the next request with it is refused (NotFound if no active key of the
    caller's subtree)."""
    await api.keys.revoke_key(who, key_id)
    return Response(status_code=204)
