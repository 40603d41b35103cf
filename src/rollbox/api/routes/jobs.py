"""Routes of trainer-job leases under ``/v1/jobs``.

A job belongs to the project of the key that opened it; names are per project, so a name the
caller's project does not hold answers NotFound whatever other projects hold. Admin keys may
name another project with ``?project=``. The lease state is the api's ``LeaseStore`` (see
rollbox.jobs); the edges' reapers delete the sandboxes of jobs that expire. Owns only these
routes.
"""
import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Query

from rollbox import errors, models
from rollbox.api.context import ApiContext
from rollbox.api.deps import Api, Who
from rollbox.iam import Principal

log = logging.getLogger(__name__)
router = APIRouter(tags=["jobs"])
ProjectQ = Annotated[str | None, Query(max_length=128, description="admin: another project")]


def _project(who: Principal, project: str | None, name: str) -> str:
    """The project a job route acts on; NotFound (as for an absent job) for a project key
    naming another project."""
    if not models.JOB_NAME_RE.match(name):
        raise errors.BadRequest(f"invalid job name {name[:130]!r}")
    if project is None or project == who.project:
        return who.project
    if not who.admin:
        raise errors.NotFound(f"no job {name!r}", job=name)
    return project


async def job_sandboxes(api: ApiContext, project: str, name: str) -> list[models.SandboxInfo]:
    found = await api.list_sandboxes(project, {})  # a lost node's are dead already
    return [i for i in found if i.owner == project and i.job == name and i.state != "dead"]


@router.post("/v1/jobs", response_model=models.JobInfo)
async def open_job(spec: models.JobSpec, who: Who, api: Api) -> models.JobInfo:
    """Open the lease of job ``name``, or resume it if live (a trainer restarted within
    its lease). It expires after MISSED_HEARTBEATS intervals without a heartbeat."""
    return await api.lease_store().open(who.project, spec)


@router.get("/v1/jobs", response_model=list[models.JobInfo])
async def list_jobs(who: Who, api: Api, project: ProjectQ = None,
                    state: Annotated[list[models.JobState], Query()] = []
                    ) -> list[models.JobInfo]:
    """The project's jobs (admin: every project's unless ``project``)."""
    if project is not None and project != who.project and not who.admin:
        return []
    scope = project if project is not None else (None if who.admin else who.project)
    return [j for j in await api.lease_store().list(scope) if not state or j.state in state]


@router.get("/v1/jobs/{name}", response_model=models.JobInfo)
async def get_job(name: str, who: Who, api: Api, project: ProjectQ = None) -> models.JobInfo:
    return await api.lease_store().get(_project(who, project, name), name)


@router.post("/v1/jobs/{name}/heartbeat", response_model=models.JobInfo)
async def heartbeat(name: str, who: Who, api: Api) -> models.JobInfo:
    """Keep the lease alive; NotFound once it ended or expired."""
    return await api.lease_store().heartbeat(_project(who, None, name), name)


@router.get("/v1/jobs/{name}/sandboxes", response_model=list[models.SandboxInfo])
async def list_job_sandboxes(name: str, who: Who, api: Api,
                             project: ProjectQ = None) -> list[models.SandboxInfo]:
    owner = _project(who, project, name)
    await api.lease_store().get(owner, name)  # NotFound for a job the project never had
    return await job_sandboxes(api, owner, name)


@router.delete("/v1/jobs/{name}", response_model=models.JobEnded)
async def end_job(name: str, who: Who, api: Api, project: ProjectQ = None) -> models.JobEnded:
    """End the job: no more sandboxes in it, and the ones it has are deleted (a sandbox
    whose create was still running is caught by the edge's next lease sweep)."""
    owner = _project(who, project, name)
    info = await api.lease_store().end(owner, name, f"ended by {who.key_id}")
    doomed = await job_sandboxes(api, owner, name)

    async def delete(sandbox_id: str) -> None:
        edge = api.placement.edge_for(sandbox_id)
        await api.record(edge, sandbox_id, "sandbox.job_ended",
                         {"by": who.key_id, "reason": f"job {name!r} ended"})
        await edge.delete(sandbox_id)  # the edge logs sandbox.deleted
        await api.sandbox_ended(sandbox_id)

    results = await asyncio.gather(*(delete(i.id) for i in doomed), return_exceptions=True)
    deleted = []
    for i, res in zip(doomed, results):
        if isinstance(res, BaseException) and not isinstance(res, errors.NotFound):
            log.warning("job %s/%s: deleting %s failed: %r", owner, name, i.id, res)
        else:
            deleted.append(i.id)
    return models.JobEnded(job=info, deleted=deleted)
