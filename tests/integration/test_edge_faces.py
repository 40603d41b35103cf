"""The edge's faces that were local-only (hasattr probes on an in-process edge) are EdgeAPI
methods: capacity, image stats, the platform's own processes and commands, the audit trail.
The fncall pools and the image-stats door are driven here through a proxy that forwards only
the names EdgeAPI declares, so they work with any edge that implements the interface, and
through a RemoteEdge to the edge served over HTTP (``face``: both)."""
from __future__ import annotations

import inspect
from typing import Any

import pytest

from rollbox.agent.protocol import ExecRequest
from rollbox.fncall import FnCallBackend, PoolConfig
from rollbox.edge.interface import EdgeAPI
from rollbox.errors import SandboxPaused
from rollbox.models import FnCallSpec, SandboxSpec
from tests.conftest import have_image, served_edge

BB = "busybox:test"
EDGE_API = {n for n, _ in inspect.getmembers(EdgeAPI) if not n.startswith("_")} | {"node_id"}


class InterfaceOnly:
    """An edge seen only through EdgeAPI (as a remote edge would be): anything else is absent."""

    def __init__(self, edge: Any) -> None:
        self._edge = edge

    def __getattr__(self, name: str) -> Any:
        if name not in EDGE_API:
            raise AttributeError(f"{name!r} is not part of EdgeAPI")
        return getattr(self._edge, name)


@pytest.fixture(params=["interface", "remote"])
async def face(edge, request: pytest.FixtureRequest):  # noqa: ANN001, ANN201
    """The edge through EdgeAPI only: a proxy of it, or a RemoteEdge to it over HTTP."""
    if request.param == "interface":
        yield InterfaceOnly(edge)
        return
    async with served_edge(edge) as remote:
        yield remote


async def test_platform_exec_and_run_shell(edge, face) -> None:  # noqa: ANN001
    sb = await face.create(SandboxSpec(image=BB), "t")
    try:
        code, out = await face.run_shell(sb.id, "echo $X; id -u; exit 4", {"X": "y"}, 10)
        assert (code, out) == (4, b"y\n0\n")
        proc = await face.platform_exec(sb.id, ExecRequest(argv=["cat"], env=[], stdin=True))
        await proc.write_stdin(b"ping")
        await proc.close_stdin()
        got, exit_code = b"", None
        async for kind, payload in proc.events():
            if kind == "stdout":
                got += payload
            elif kind == "exited":
                exit_code = payload.exit_code
        assert (got, exit_code) == (b"ping", 0)
        assert await face.exec_list(sb.id) == []  # not an exec of the sandbox's own
        await face.pause(sb.id)
        with pytest.raises(SandboxPaused):
            await face.run_shell(sb.id, "true", {}, 10)
        await face.resume(sb.id)
        await face.record_event(sb.id, "test.note", "x")
        kinds = [ev.kind async for ev in face.events(sb.id, 0, False)]
        assert "test.note" in kinds and "exec.started" not in kinds
    finally:
        await face.delete(sb.id)


async def test_image_stats_and_capacity_through_the_interface(edge, face) -> None:  # noqa: ANN001
    st = await face.image_stats(None)
    assert isinstance(st["sandboxes"], dict)
    cap = await face.capacity()
    assert cap["max_sandboxes"] == edge.limits.max_sandboxes and "container" in cap["backends"]
    with pytest.raises(AttributeError):
        face.live  # noqa: B018 - what the probes looked for is not there


@pytest.mark.skipif(not have_image("fncall:1"), reason="fncall:1 not built (run `make images`)")
async def test_fncall_pools_need_only_the_interface(edge, face) -> None:  # noqa: ANN001
    async with FnCallBackend(face, PoolConfig(max_workers=1)) as fb:
        r = await fb.call(FnCallSpec(language="python", code="print(6*7)"))
        assert (r.status, r.stdout) == ("ok", "42\n")
        kinds = [ev.kind async for ev in edge.events(r.worker, 0, False)]
        assert "fncall.call" in kinds
