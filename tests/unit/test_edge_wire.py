"""The edge's HTTP transport covers the whole interface: every EdgeAPI method is in one of
``edge.wire``'s tables (or is platform_exec), ``RemoteEdge`` has each with the interface's own
signature, the edge takes each by the interface's argument names, every method that may be
remote is async; frames read back as written and an oversized frame is refused."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest

from rollbox import errors
from rollbox.edge import wire
from rollbox.edge.edge import Edge
from rollbox.edge.interface import EdgeAPI
from rollbox.edge.remote import RemoteEdge

MEMBERS = {n for n, _ in inspect.getmembers(EdgeAPI) if not n.startswith("_")}


def test_every_method_of_the_interface_is_on_the_wire() -> None:
    tables = set(wire.UNARY) | set(wire.SERVER_STREAMS) | set(wire.CLIENT_STREAMS)
    assert len(tables) == len(wire.UNARY) + len(wire.SERVER_STREAMS) + len(wire.CLIENT_STREAMS)
    assert MEMBERS == tables | {"platform_exec", "port_open", "display_open"}


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_remote_and_local_edges_have_the_interfaces_signature(name: str) -> None:
    proto = inspect.signature(getattr(EdgeAPI, name))
    assert inspect.signature(getattr(RemoteEdge, name)) == proto
    local = inspect.signature(getattr(Edge, name)).parameters
    for pname, param in proto.parameters.items():
        assert pname in local, f"Edge.{name} lacks {pname}"
        assert local[pname].default == param.default, f"Edge.{name}({pname}=...)"
    for impl in (EdgeAPI, Edge, RemoteEdge):
        fn = getattr(impl, name)
        assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or (
            impl is EdgeAPI and name in wire.SERVER_STREAMS), f"{impl.__name__}.{name}"


def test_frames_read_back_and_an_oversized_frame_is_refused() -> None:
    payloads = [(wire.DATA, b"\0\xff" * 1000), (wire.JSON_ITEM, b'{"a":1}')]
    stream = (b"".join(wire.frame(k, p) for k, p in payloads) + wire.HEARTBEAT_FRAME
              + wire.DONE_FRAME + wire.frame(wire.DATA, b"after the end"))

    async def read(data: bytes, step: int = 7) -> list[tuple[bytes, bytes]]:
        async def chunks() -> AsyncIterator[bytes]:  # split anywhere, headers too
            for i in range(0, len(data), step):
                yield data[i:i + step]

        return [f async for f in wire.read_frames(chunks())]

    for step in (1, 3, 7, 4096):
        assert asyncio.run(read(stream, step)) == [*payloads, (wire.DONE, b"")]
    big = wire.HEAD.pack(wire.DATA, wire.MAX_FRAME + 1)
    with pytest.raises(errors.InfraError):
        asyncio.run(read(big))
    with pytest.raises(asyncio.IncompleteReadError):  # the client maps it to ConnectionLost
        asyncio.run(read(wire.frame(wire.DATA, b"cut")[:-1]))


def test_disk_full_comes_back_as_disk_full() -> None:
    err = wire.error_of(errors.DiskFull("full", path="/x").to_payload())
    assert type(err) is errors.DiskFull and err.details == {"reason": "disk_full", "path": "/x"}
    assert type(wire.error_of(errors.BadRequest("bad").to_payload())) is errors.BadRequest
    assert errors.EdgeUnreachable("x").retryable


def test_arguments_are_bounded_by_name() -> None:
    ok = wire.METHODS["exec_stream"].args.model_validate_json(
        '{"sandbox_id": "n0-0123456789ab", "exec_id": "e1", "offsets": [3, 4]}')
    assert ok.offsets == (3, 4)  # type: ignore[attr-defined]
    for bad in ('{"sandbox_id": "n0-0123456789ab", "exec_id": "e1", "offsets": [-1, 0]}',
                '{"sandbox_id": "../n0-0123456789ab", "exec_id": "e1"}',
                '{"sandbox_id": "n0-0123456789ab", "exec_id": "e 1"}'):
        with pytest.raises(ValueError):
            wire.METHODS["exec_stream"].args.model_validate_json(bad)
    m = wire.METHODS["image_list"].args
    assert m.model_validate_json('{"owner": null}').owner is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        m.model_validate_json('{"owner": "a\\u0000b"}')
