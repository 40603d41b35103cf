"""``mount(app, api)``: the E2B front door (listed in ``rollbox.compat.frontdoors``)."""
from __future__ import annotations

import contextlib
from fastapi import FastAPI

from rollbox.api.context import ApiContext
from rollbox.compat.e2b.control import mount_control, mount_fallback
from rollbox.compat.e2b.envd import mount_envd
from rollbox.compat.e2b.state import E2BState


def mount(app: FastAPI, api: ApiContext, state: E2BState | None = None
          ) -> contextlib.AbstractAsyncContextManager[None] | None:
    state = state or E2BState()
    app.state.e2b = state
    mount_envd(app, api, state)
    mount_control(app, api, state)
    mount_fallback(app, api)
    return None
