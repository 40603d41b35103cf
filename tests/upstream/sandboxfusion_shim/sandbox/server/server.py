"""``app``: an ASGI app that forwards every request (the tests post ``/run_code`` through
FastAPI's ``TestClient(app)``) to rollbox's SandboxFusion front door at
``{ROLLBOX_URL}/sandboxfusion/{ROLLBOX_API_KEY}`` and answers with rollbox's status and body."""
from __future__ import annotations

import os
from typing import Any

import httpx

BASE = f"{os.environ['ROLLBOX_URL'].rstrip('/')}/sandboxfusion/{os.environ['ROLLBOX_API_KEY']}"


async def app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = [(k.decode(), v.decode()) for k, v in scope["headers"]
               if k.lower() in (b"content-type", b"accept")]
    async with httpx.AsyncClient(timeout=600) as client:
        r = await client.request(scope["method"], BASE + scope["path"], content=body,
                                 headers=headers)
    await send({"type": "http.response.start", "status": r.status_code,
                "headers": [(k.encode(), v.encode()) for k, v in r.headers.items()
                            if k.lower() in ("content-type",)]})
    await send({"type": "http.response.body", "body": r.content})
