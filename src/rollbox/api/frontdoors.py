"""Extra HTTP surfaces mounted on the api app: other backends' routes and peers' protocols.

Each entry of :data:`FRONT_DOORS` names a module with ``mount(app, api)``; it adds its routes to
the FastAPI app and may return an async context manager that the app enters at start-up and
leaves at shutdown (warm pools, background tasks). Owns only this list; the front doors own
their routes and must not touch the core ``/v1`` routes.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

FRONT_DOORS: tuple[str, ...] = (
    "rollbox.compat.e2b",  # E2B control plane under /e2b, envd under /e2b/envd
    "rollbox.netpolicy.mirror",  # no routes: runs the PyPI mirror on its own port when enabled
    "rollbox.compat.swerex",  # SWE-ReX remote runtime per sandbox under /swerex/{sandbox_id}
    "rollbox.images.lazy.api",  # GET /v1/images/stats: lazy-loading counters per layer/sandbox
    "rollbox.api.images",  # /v1/images: a project's uploaded images and layer storage
    "rollbox.backends.fncall.http",  # /v1/fncall, /v1/fncall/batch: warm-pool stateless calls
    "rollbox.compat.sandboxfusion",  # SandboxFusion POST /run_code on the fncall pools
    "rollbox.api.jobs",  # /v1/jobs: trainer-job leases (open, heartbeat, list, end)
    "rollbox.api.admin",  # /v1/keys: list, create, revoke API keys (admin keys only)
)


def mount_all(app: FastAPI, api: Any) -> contextlib.AbstractAsyncContextManager[None]:
    """Mount every front door; the returned context runs their start-up and shutdown."""
    contexts = []
    for name in FRONT_DOORS:
        ctx = importlib.import_module(name).mount(app, api)
        if ctx is not None:
            contexts.append(ctx)

    @contextlib.asynccontextmanager
    async def lifetime() -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for ctx in contexts:
                await stack.enter_async_context(ctx)
            yield

    return lifetime()
