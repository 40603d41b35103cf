"""Routes ``/v1/projects/{project}/quota``: a project's per-node limits (a project key reads its
own; setting them, or reading another project's, needs an admin key)."""
from fastapi import APIRouter

from rollbox import models
from rollbox.api.deps import Api, Who
from rollbox.iam.quotas import check_quota

router = APIRouter(tags=["projects"])


@router.get("/v1/projects/{project:path}/quota", response_model=models.Quota)
async def get_quota(project: str, who: Who, api: Api) -> models.Quota:
    """A project's per-node limits; a project key may read its own."""
    return api.quota_store(who, project, write=False).get(project)


@router.put("/v1/projects/{project:path}/quota", response_model=models.Quota)
async def set_quota(project: str, body: models.Quota, who: Who, api: Api) -> models.Quota:
    """Replace a project's per-node limits (a null field is unlimited). A negative limit
    or one above a node's capacity is refused and nothing is stored."""
    store = api.quota_store(who, project, write=True)
    check_quota(body, await api.placement.node_limits())
    return store.set(project, body)
