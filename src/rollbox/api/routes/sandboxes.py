"""Routes ``/v1/sandboxes``: create, list, get, delete, TTL, pause/resume, network policy, grade,
snapshot, fork. Create (and fork, for all its children) reserves the sandbox's room in the project's quota first and a delete gives
it back (``ApiContext.create_sandbox``, ``sandbox_ended``). Everything after create names a
sandbox the caller's project owns (``deps.Edge``); the edge logs each change in the sandbox's
audit trail, the api adds only who asked (``ApiContext.record``)."""
import contextlib
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rollbox import errors, models
from rollbox.api import hot
from rollbox.api.context import ApiContext
from rollbox.api.deps import Api, Edge, Who, context_of
from rollbox.iam import Principal

router = APIRouter()


class TTLRequest(BaseModel):
    ttl_s: float = Field(..., gt=0, le=models.MAX_TIMEOUT_S)


class PauseRequest(BaseModel):
    """``POST /v1/sandboxes/{id}/pause``'s optional body."""
    model_config = ConfigDict(extra="forbid")
    # False: filesystem-only (every process stopped, memory and CPU released, files kept; a
    # resume boots it again). True (the default): frozen in place, memory kept.
    keep_memory: bool = True


async def _made_before(api: Api, spec: models.SandboxSpec,
                       owner: str) -> models.SandboxInfo | None:
    """A retried keyed create: the sandbox an earlier attempt made under the key, on
    whichever node (the attempt may have gone through another replica, whose placement chose
    another node), asked of that node again so it checks the spec (or waits for a create
    still under way there). None: no node has one."""
    found = [i for i in await api.list_sandboxes(owner, {})  # a lost node's: none
             if i.idempotency_key == spec.idempotency_key and i.owner == owner
             and i.state != "dead"]
    if not found:
        return None
    edge = api.placement.edge_for(found[0].id)
    info = await edge.create(spec, owner)
    if info.id == found[0].id:
        return info
    # It ended after the list (a delete raced the retry) and the edge made a new one, outside
    # the quota ledger and the audit log: gone again, and the caller creates as a first
    # attempt (its room reserved) instead.
    with contextlib.suppress(errors.RollboxError):
        await edge.delete(info.id)
    return None


ATTEMPT_HEADER = "X-Rollbox-Attempt"
_attempt = TypeAdapter(Annotated[int, Field(ge=1, le=1000)])


async def _create(api: ApiContext, who: Principal, spec: models.SandboxSpec,
                  attempt: int) -> models.SandboxInfo:
    if spec.job is not None:  # NotFound unless the project's job is live
        await api.lease_store().live(who.project, spec.job)
    info = None
    if attempt > 1 and spec.idempotency_key is not None:
        info = await _made_before(api, spec, who.project)
    if info is None:  # a keyed create on the node that is making it joins it there
        # who asked: logged by the edge after its own sandbox.created (image, layers, owner,
        # job), in the create call (the sandbox id names the node)
        info = await api.create_sandbox(spec, who.project, requested={
            "op": "create", "by": who.key_id, "labels": spec.labels,
            "resources": spec.resources.model_dump(), "ttl_s": spec.ttl_s,
        })
    api.remember_owner(info.id, who.project)
    if api.watcher is not None:  # its labels, for label filters once its node is lost
        api.watcher.remember([info])
    return info


@router.post("/v1/sandboxes", status_code=201, response_model=models.SandboxInfo,
             tags=["sandboxes"])
async def create_sandbox(
    spec: models.SandboxSpec, who: Who, api: Api,
    attempt: Annotated[int, Header(alias=ATTEMPT_HEADER, ge=1, le=1000, description=(
        "the SDK's attempt number of this call; above 1 with an idempotency_key, every node "
        "is asked for the sandbox an earlier attempt made"))] = 1,
) -> models.SandboxInfo:
    return await _create(api, who, spec, attempt)


async def create_sandbox_lean(request: Request) -> Response:
    """``create_sandbox`` served by ``api.hot`` (the same checks, no dependency solving)."""
    who = await hot.caller(request)
    spec = await hot.json_body(request, models.SandboxSpec)
    attempt = hot.param(request.headers, ATTEMPT_HEADER, "header", _attempt, 1)
    info = await _create(context_of(request), who, spec, attempt)
    return Response(info.model_dump_json(), 201, media_type="application/json")


@router.get("/v1/sandboxes", response_model=list[models.SandboxInfo], tags=["sandboxes"])
async def list_sandboxes(
    who: Who, api: Api,
    label: Annotated[list[str], Query(description="k=v, repeatable; all must match")] = [],
    state: Annotated[list[models.SandboxState],
                     Query(description="repeatable; any may match (e.g. paused)")] = [],
    job: Annotated[str | None, Query(max_length=128, description="a job's sandboxes")] = None,
    project: Annotated[str | None, Query(max_length=128,
                                         description="admin: one project's")] = None,
) -> list[models.SandboxInfo]:
    labels: dict[str, str] = {}
    for item in label:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise errors.BadRequest(f"label filter must be k=v, got {item!r}")
        labels[k] = v
    owner = None if who.admin else who.project
    if project is not None and project != who.project:
        if not who.admin:
            return []  # another project's sandboxes look absent
        owner = project
    found = await api.list_sandboxes(owner, labels)
    # Filter again here: the edge's own filtering is trusted for speed, not for isolation.
    return [
        i for i in found
        if (owner is None or i.owner == owner)
        and all(i.labels.get(k) == v for k, v in labels.items())
        and (not state or i.state in state)
        and (job is None or i.job == job)
    ]


@router.get("/v1/sandboxes/{sandbox_id}", response_model=models.SandboxInfo,
            tags=["sandboxes"])
async def get_sandbox(sandbox_id: str, edge: Edge) -> models.SandboxInfo:
    return await edge.get(sandbox_id)


@router.get("/v1/sandboxes/{sandbox_id}/usage", response_model=list[models.UsageSample],
            tags=["sandboxes"])
async def sandbox_usage(sandbox_id: str, edge: Edge) -> list[models.UsageSample]:
    """The sandbox's CPU (cumulative), memory and disk use over time, oldest first: a sample
    every ``ROLLBOX_USAGE_SAMPLE_S`` for the last ``ROLLBOX_USAGE_SAMPLES``, and one now."""
    return await edge.usage_history(sandbox_id)


async def _delete(api: ApiContext, who: Principal, sandbox_id: str) -> Response:
    try:
        edge = await api.sandbox_edge(sandbox_id, who)
    except errors.SandboxDead as exc:
        if exc.details.get("reason") != models.NODE_LOST:
            raise
        # Dead with its node: deleting a dead sandbox is a no-op (its node tears it down
        # when it comes back).
        return Response(status_code=204)
    await api.delete_sandbox(edge, sandbox_id, {"op": "delete", "by": who.key_id, "via": "api"})
    return Response(status_code=204)


@router.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
async def delete_sandbox(sandbox_id: str, who: Who, api: Api) -> Response:
    return await _delete(api, who, sandbox_id)


async def delete_sandbox_lean(request: Request) -> Response:
    """``delete_sandbox`` served by ``api.hot``."""
    who = await hot.caller(request)
    return await _delete(context_of(request), who, request.path_params["sandbox_id"])


@router.post("/v1/sandboxes/{sandbox_id}/ttl", response_model=models.SandboxInfo,
             tags=["sandboxes"])
async def set_ttl(sandbox_id: str, body: TTLRequest, edge: Edge, who: Who,
                  api: Api) -> models.SandboxInfo:
    info = await edge.set_ttl(sandbox_id, body.ttl_s)
    await api.record(edge, sandbox_id, "sandbox.ttl", {"ttl_s": body.ttl_s, "by": who.key_id})
    return info


@router.post("/v1/sandboxes/{sandbox_id}/pause", response_model=models.SandboxInfo,
             tags=["sandboxes"])
async def pause_sandbox(sandbox_id: str, edge: Edge, who: Who, api: Api,
                        body: PauseRequest | None = None) -> models.SandboxInfo:
    """Pause the whole sandbox (state ``paused``): exec answers 409 sandbox_paused until
    resume; files, TTL, network and delete still work; the TTL keeps counting. Frozen in
    place (memory kept), or with ``{"keep_memory": false}`` stopped (``memory_kept`` false:
    processes gone, memory and CPU released, files kept; resume boots it again)."""
    keep = body.keep_memory if body is not None else True
    # the edge logs sandbox.paused; the api, who asked
    info = await edge.pause(sandbox_id, keep_memory=keep)
    await api.record(edge, sandbox_id, "sandbox.requested",
                     {"op": "pause", "by": who.key_id, "keep_memory": keep})
    return info


@router.post("/v1/sandboxes/{sandbox_id}/resume", response_model=models.SandboxInfo,
             tags=["sandboxes"])
async def resume_sandbox(sandbox_id: str, edge: Edge, who: Who,
                         api: Api) -> models.SandboxInfo:
    """Thaw a paused sandbox; its processes continue where they stopped (a filesystem-paused
    one boots again over its files: a fresh agent, no process of before)."""
    info = await edge.resume(sandbox_id)
    await api.record(edge, sandbox_id, "sandbox.requested", {"op": "resume", "by": who.key_id})
    return info


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=models.SandboxInfo,
            tags=["sandboxes"])
async def set_network(sandbox_id: str, body: models.NetworkPolicy,
                      edge: Edge) -> models.SandboxInfo:
    """Replace the sandbox's network policy (default deny; effective for open connections)."""
    return await edge.set_network(sandbox_id, body)


@router.post("/v1/sandboxes/{sandbox_id}/grade", response_model=models.GradeResult,
             tags=["sandboxes"])
async def grade(sandbox_id: str, spec: models.GradeSpec, edge: Edge,
                who: Who, api: Api) -> models.GradeResult:
    owner = (await edge.get(sandbox_id)).owner
    result = await edge.grade(sandbox_id, spec, owner)
    await api.record(edge, sandbox_id, "sandbox.graded", {
        "grader": result.grader_id, "files": result.files,
        "exit_code": result.result.exit_code, "by": who.key_id})
    return result


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201,
             response_model=models.ForkResult, tags=["sandboxes"])
async def fork(sandbox_id: str, spec: models.ForkSpec, edge: Edge, who: Who,
               api: Api) -> models.ForkResult:
    """``n`` new sandboxes with this one's filesystem state (image, layers and writable
    layer, frozen for an instant: nothing copied), env, hidden paths, network policy,
    resources, labels (+ ``fork_of``), job and deadline; each its own hostname and
    machine-id. Containers carry no processes (microVMs do). All ``n`` are reserved in the
    project's quota at once: quota_exceeded or capacity_exceeded makes none. The children are
    on the source's node (a cluster places them there, not by the placement's choice)."""
    src = await edge.get(sandbox_id)
    if src.job is not None:  # NotFound unless the project's job is still live
        await api.lease_store().live(src.owner, src.job)
    result = await api.fork_sandbox(edge, sandbox_id, spec, src.owner, src.resources)
    for child in result.children:
        api.remember_owner(child.id, src.owner)
    if api.watcher is not None:
        api.watcher.remember(result.children)
    await api.record(edge, sandbox_id, "sandbox.requested", {
        "op": "fork", "by": who.key_id, "n": spec.n,
        "children": [c.id for c in result.children]})
    return result


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=models.SnapshotResult,
             tags=["sandboxes"])
async def snapshot(sandbox_id: str, spec: models.SnapshotSpec, edge: Edge,
                   api: Api) -> models.SnapshotResult:
    """pack_diff: the sandbox's writable layer, scrubbed, becomes a new layer; ``name`` is
    tagged as the sandbox's layers + it (create sandboxes from it on this node). The image
    belongs to the sandbox's project: other projects can't see or use it."""
    owner = (await edge.get(sandbox_id)).owner
    await api.check_image_name(owner, spec.name)
    return await edge.snapshot(sandbox_id, spec, owner)


# The cycle's routes served by api.hot's lean path (create_app installs them).
LEAN = {create_sandbox: create_sandbox_lean, delete_sandbox: delete_sandbox_lean}
