"""The api's request metrics: an ASGI middleware that times every HTTP request from its arrival
to its response start and counts it by method, route template (``/v1/sandboxes/{sandbox_id}``:
the matched route's path, never the request's; ``unmatched`` for none) and status, into
``rollbox.metrics`` (``rollbox_api_request_seconds``). Pure ASGI: a stream passes as it is.

Owns the timing only; the families and their label rules are ``rollbox.metrics``'.
"""
from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollbox.metrics import Metrics, process_metrics


class ApiMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics or process_metrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.metrics.enabled:  # off: not even the timing
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        seen = False

        def observe(status: int) -> None:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.api_seconds.labels(scope["method"], template, str(status)).observe(
                time.monotonic() - t0)

        async def timed(message: Message) -> None:
            nonlocal seen
            if message["type"] == "http.response.start" and not seen:
                seen = True
                observe(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, timed)
        finally:
            if not seen:  # no answer started (the client left, or a bug): counted as 499/500
                observe(499)
