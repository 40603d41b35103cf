"""Red-team helpers: real sandboxes through the `edge` fixture, hardened or (for the twin tests
that prove an attack works without hardening) deliberately unhardened. The unhardened twin is
reached only by wrapping the backend's create here; the HTTP API has no way to ask for it."""
from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from rollbox.models import ExecResult, ExecSpec, NetworkPolicy, Resources, SandboxSpec

BB = "busybox:test"
PY = "python:3.11"


@dataclass
class Boxes:
    edge: Any
    lock: asyncio.Lock

    async def make(self, image: str = BB, *, hardened: bool = True,
                   hidden: tuple[str, ...] = (), network: list[str] | None = None,
                   disk_tier: Literal["disk", "memory"] = "disk", **resources: Any) -> str:
        """network: None = loopback only; a list = a network policy with these allow rules."""
        spec = SandboxSpec(image=image, resources=Resources(**resources),
                           hidden_paths=list(hidden), disk_tier=disk_tier,
                           network=NetworkPolicy(allow=network) if network is not None else None)
        backend = self.edge.backend
        async with self.lock:  # the wrapper is per call: never mix flags across creations
            backend.create = functools.partial(type(backend).create, backend,
                                               hardened=hardened)
            try:
                info = await self.edge.create(spec, "redteam")
            finally:
                del backend.create
        return info.id

    async def run(self, sid: str, cmd: str | list[str], **kw: Any) -> ExecResult:
        kw.setdefault("timeout_s", 30)
        eid = await self.edge.exec_start(sid, ExecSpec(cmd=cmd, **kw))
        return await self.edge.exec_wait(sid, eid)

    async def py(self, sid: str, code: str, **kw: Any) -> ExecResult:
        return await self.run(sid, ["python3", "-c", code], **kw)


@pytest.fixture
async def boxes(edge) -> Boxes:
    return Boxes(edge, asyncio.Lock())


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc sandboxes)")
