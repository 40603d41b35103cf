"""Routes ``/v1/projects``: create a sub-project (with a quota carved out of its parent's),
list the caller's subtree, read and set a project's limits. Who may do what is the IAM
store's (``iam.model``): an admin key of a project administers its subtree, never above or
beside it; the operator's key everything. Owns only these routes."""
from fastapi import APIRouter

from rollbox import errors, models
from rollbox.api.deps import Api, Who
from rollbox.iam import ProjectInfo, Usage
from rollbox.iam.model import check_name
from rollbox.iam.quotas import check_quota

router = APIRouter(tags=["projects"])


def _usage(u: Usage) -> models.QuotaUsage:
    return models.QuotaUsage(sandboxes=u.sandboxes, cpus=round(u.cpus, 6),
                             memory_mib=u.memory_mib)


def project_model(p: ProjectInfo) -> models.Project:
    return models.Project(name=p.name, parent=p.parent, quota=p.quota, used=_usage(p.used),
                          own_used=_usage(p.own_used), delegated=_usage(p.delegated),
                          created_at=p.created_at)


@router.post("/v1/projects", status_code=201, response_model=models.Project)
async def create_project(body: models.ProjectSpec, who: Who, api: Api) -> models.Project:
    """A new project under one the caller administers (a top-level one: the operator's key).
    A quota above what the parent has left, an unknown parent, a malformed name: a typed
    error and nothing made."""
    name = body.name
    if body.parent is not None:
        check_name(body.parent)
        if "/" in name:
            raise errors.BadRequest("with parent, name is one segment (no '/')", field="name")
        name = f"{body.parent}/{name}"
    return project_model(await api.keys.create_project(who, name, body.quota))


@router.get("/v1/projects", response_model=list[models.Project])
async def list_projects(who: Who, api: Api) -> list[models.Project]:
    """The caller's subtree (a project key: its own project), with limits and use."""
    return [project_model(p) for p in await api.keys.projects(who)]


@router.get("/v1/projects/{project:path}/quota", response_model=models.Quota)
async def get_quota(project: str, who: Who, api: Api) -> models.Quota:
    """A project's limits; a project key may read its own, an admin key its subtree's."""
    return await api.keys.get_quota(who, project)


@router.put("/v1/projects/{project:path}/quota", response_model=models.Quota)
async def set_quota(project: str, body: models.Quota, who: Who, api: Api) -> models.Quota:
    """Replace a project's limits (a null field is unlimited; an admin of a project above
    it). A negative limit, one above a node's capacity or above what the parent has left to
    delegate, or one below what the project has delegated and uses, is refused and nothing
    is stored."""
    check_quota(body, await api.placement.node_limits())
    return await api.keys.set_quota(who, project, body)
