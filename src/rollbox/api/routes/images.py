"""Routes ``/v1/images``: a project's task images, uploaded as a tar stream, listed, deleted;
its layer storage; and the lazy-loading counters of every node (``/v1/images/stats``).

``POST /v1/images?name=NAME[&base=IMAGE]`` streams a tar (optionally gz/bz2/xz) of the image's
tree; the edge builds the layer itself (rollbox.edge.storage), never mounting anything the
client made. Images live on a node: with one edge (``rollbox serve``) that is the node; with
several, uploads go to the first and lists/deletes cover all (the cluster issue distributes
layers through the chunk store).

``GET /v1/images/stats`` (``EdgeAPI.image_stats``): per layer, bytes requested (reads through
the lazy-loading daemon), bytes fetched from the chunk store, bytes written to the node cache,
cache hits/misses, chunks present; per sandbox, the same read counters, attributed by the
reader's cgroup (the FUSE request's pid). Non-admin callers see only their own sandboxes. Also
the full-pull transfers of this process (``chunks.TRANSFERS``, admins only). Owns only these
routes.
"""
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from rollbox import errors, models
from rollbox.api.bodies import body_chunks
from rollbox.api.deps import Api, Who
from rollbox.images import chunks

router = APIRouter(tags=["images"])
NameQ = Annotated[str, Query(min_length=1, max_length=200)]


@router.get("/v1/images/stats")
async def images_stats(
    who: Who, api: Api,
    sandbox: Annotated[str | None, Query(max_length=128)] = None,
) -> dict[str, Any]:
    project = None if who.admin else who.project
    nodes: dict[str, Any] = {}
    for node_id, edge in api.placement.edges.items():
        try:  # EdgeAPI: a remote edge answers for its node
            st = await edge.image_stats(project)
        except errors.RollboxError as exc:  # one node's trouble is not the others'
            nodes[node_id] = {"error": exc.message}
            continue
        if sandbox is not None:
            st["sandboxes"] = {k: v for k, v in st["sandboxes"].items() if k == sandbox}
        nodes[node_id] = st
    transfers = [t.to_dict() for t in chunks.TRANSFERS[-100:]] if who.admin else []
    return {"nodes": nodes, "transfers": transfers}


@router.post("/v1/images", status_code=201, response_model=models.ImageInfo)
async def image_upload(name: NameQ, request: Request, who: Who, api: Api,
                       base: Annotated[str | None, Query(max_length=256)] = None,
                       ) -> models.ImageInfo:
    """Build image ``name`` (it needs a path: ``myproject/task:1``) owned by the caller's
    project from the tar body: one new layer, over ``base``'s layers if given."""
    await api.check_image_name(who.project, name)
    edge = next(iter(api.placement.edges.values()))
    return await edge.image_upload(name, body_chunks(request), who.project, base)


@router.get("/v1/images", response_model=list[models.ImageInfo])
async def image_list(who: Who, api: Api) -> list[models.ImageInfo]:
    """The node's images and the caller's project's own (admins: all)."""
    seen: dict[str, models.ImageInfo] = {}
    for edge in api.placement.edges.values():
        for info in await edge.image_list(None if who.admin else who.project):
            seen.setdefault(info.name, info)
    return sorted(seen.values(), key=lambda i: i.name)


@router.delete("/v1/images", status_code=204)
async def image_delete(name: NameQ, who: Who, api: Api) -> Response:
    """Delete one of the project's images; its layer storage is freed at once."""
    found = False
    for edge in api.placement.edges.values():
        try:
            await edge.image_delete(name, None if who.admin else who.project)
            found = True
        except errors.NotFound:
            continue
    if not found:
        raise errors.NotFound(f"no image {name!r}", image=name)
    return Response(status_code=204)


@router.get("/v1/images/usage", response_model=models.LayerUsage)
async def image_usage(who: Who, api: Api,
                      project: Annotated[str | None, Query(max_length=128)] = None,
                      ) -> models.LayerUsage:
    """The project's layer storage (admins may name any project)."""
    if project is not None and project != who.project and not who.admin:
        raise errors.NotFound(f"no project {project!r}")
    return await next(iter(api.placement.edges.values())).image_usage(project or who.project)
