"""Extra HTTP surfaces mounted on the api app: peers' protocols and services run with it.

A :class:`FrontDoor` is a ``mount(app, api)`` function: it adds its routes to the FastAPI app
and may return an async context manager that the app enters at start-up and leaves at shutdown
(background tasks, a server of its own). ``create_app(..., front_doors=...)`` mounts the ones it
is given: most sit above the api (peers' protocols) and import it, so the api can not know them;
whoever builds a node's app (its composition root) passes the node's list. Owns only the
protocol and the mounting; the front doors own their routes and must not touch the core ``/v1``
routes (``api.routes``).
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rollbox.api.context import ApiContext


class FrontDoor(Protocol):
    def __call__(self, app: FastAPI, api: ApiContext
                 ) -> contextlib.AbstractAsyncContextManager[None] | None: ...


def mount_all(app: FastAPI, api: ApiContext, front_doors: Sequence[FrontDoor]
              ) -> contextlib.AbstractAsyncContextManager[None]:
    """Mount ``front_doors`` in order; the returned context runs their start-up and shutdown."""
    contexts = []
    for mount in front_doors:
        ctx = mount(app, api)
        if ctx is not None:
            contexts.append(ctx)

    @contextlib.asynccontextmanager
    async def lifetime() -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for ctx in contexts:
                await stack.enter_async_context(ctx)
            yield

    return lifetime()
