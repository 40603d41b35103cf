"""Extra HTTP surfaces mounted on the api app: peers' protocols and services run with it.

Each entry of :data:`FRONT_DOORS` names a module with a :class:`FrontDoor` ``mount(app, api)``;
it adds its routes to the FastAPI app and may return an async context manager that the app
enters at start-up and leaves at shutdown (background tasks, a server of its own). They are
named, not imported, here: they sit above the api (``compat``) and import it. Owns only this
list; the front doors own their routes and must not touch the core ``/v1`` routes
(``api.routes``).
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rollbox.api.context import ApiContext

FRONT_DOORS: tuple[str, ...] = (
    "rollbox.compat.e2b",  # E2B control plane under /e2b, envd under /e2b/envd
    "rollbox.api.mirror",  # no routes: runs the PyPI mirror on its own port when enabled
    "rollbox.compat.swerex",  # SWE-ReX remote runtime per sandbox under /swerex/{sandbox_id}
    "rollbox.compat.sandboxfusion",  # SandboxFusion POST /run_code on the fncall pools
)


class FrontDoor(Protocol):
    def __call__(self, app: FastAPI, api: ApiContext
                 ) -> contextlib.AbstractAsyncContextManager[None] | None: ...


def mount_all(app: FastAPI, api: ApiContext) -> contextlib.AbstractAsyncContextManager[None]:
    """Mount every front door; the returned context runs their start-up and shutdown."""
    contexts = []
    for name in FRONT_DOORS:
        mount: FrontDoor = importlib.import_module(name).mount
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
