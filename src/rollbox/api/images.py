"""Routes ``/v1/images``: a project's task images, uploaded as a tar stream, listed, deleted, and
its layer storage.

``POST /v1/images?name=NAME[&base=IMAGE]`` streams a tar (optionally gz/bz2/xz) of the image's
tree; the edge builds the layer itself (rollbox.edge.storage), never mounting anything the
client made. Images live on a node: with one edge (``rollbox serve``) that is the node; with
several, uploads go to the first and lists/deletes cover all (the cluster issue distributes
layers through the chunk store). Owns only these routes.
"""
from __future__ import annotations

import contextlib
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response

from rollbox import errors, models
from rollbox.api.app import Who, body_chunks

NameQ = Annotated[str, Query(min_length=1, max_length=200)]


def mount(app: FastAPI, api: Any) -> contextlib.AbstractAsyncContextManager[None] | None:
    edges = api.placement.edges

    @app.post("/v1/images", status_code=201, response_model=models.ImageInfo, tags=["images"])
    async def image_upload(name: NameQ, request: Request, who: Who,
                           base: Annotated[str | None, Query(max_length=256)] = None,
                           ) -> models.ImageInfo:
        """Build image ``name`` (it needs a path: ``myproject/task:1``) owned by the caller's
        project from the tar body: one new layer, over ``base``'s layers if given."""
        api.check_image_name(who.project, name)
        edge = next(iter(edges.values()))
        return await edge.image_upload(name, body_chunks(request), who.project, base)

    @app.get("/v1/images", response_model=list[models.ImageInfo], tags=["images"])
    async def image_list(who: Who) -> list[models.ImageInfo]:
        """The node's images and the caller's project's own (admins: all)."""
        seen: dict[str, models.ImageInfo] = {}
        for edge in edges.values():
            for info in await edge.image_list(None if who.admin else who.project):
                seen.setdefault(info.name, info)
        return sorted(seen.values(), key=lambda i: i.name)

    @app.delete("/v1/images", status_code=204, tags=["images"])
    async def image_delete(name: NameQ, who: Who) -> Response:
        """Delete one of the project's images; its layer storage is freed at once."""
        found = False
        for edge in edges.values():
            try:
                await edge.image_delete(name, None if who.admin else who.project)
                found = True
            except errors.NotFound:
                continue
        if not found:
            raise errors.NotFound(f"no image {name!r}", image=name)
        return Response(status_code=204)

    @app.get("/v1/images/usage", response_model=models.LayerUsage, tags=["images"])
    async def image_usage(who: Who, project: Annotated[str | None, Query(max_length=128)] = None,
                          ) -> models.LayerUsage:
        """The project's layer storage (admins may name any project)."""
        if project is not None and project != who.project and not who.admin:
            raise errors.NotFound(f"no project {project!r}")
        return await next(iter(edges.values())).image_usage(project or who.project)

    return None
