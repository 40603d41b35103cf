"""``GET /v1/cluster/status``: the nodes, their health and live sandboxes per node, backend and
project, as the api's watcher sees them (``rollbox cluster status``). A project key sees only
its own project's sandboxes counted; an admin sees all, or one project's with ``project``."""
from typing import Annotated

from fastapi import APIRouter, Query

from rollbox import errors, models
from rollbox.api.deps import Api, Who

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster/status", response_model=models.ClusterStatus)
async def cluster_status(
    who: Who, api: Api,
    project: Annotated[str | None, Query(max_length=128,
                                         description="admin: one project's")] = None,
) -> models.ClusterStatus:
    if api.watcher is None:
        raise errors.BadRequest("this api has no watcher (no cluster view)")
    if not who.admin:
        project = who.project  # another project's counts look absent
    return api.watcher.status(project)
