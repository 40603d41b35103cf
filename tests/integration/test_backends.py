"""The edge's registry of backends (rollbox.backends.base): SandboxSpec.backend picks one, a kind
the node does not offer is refused before anything is made, node capacity lists each kind."""
from __future__ import annotations

import pytest

from rollbox.errors import BadRequest
from rollbox.models import ExecSpec, SandboxSpec

BB = "busybox:test"


async def test_unknown_backend_is_refused_naming_the_offered_kinds(edge) -> None:  # noqa: ANN001
    with pytest.raises(BadRequest) as exc:
        await edge.create(SandboxSpec(image=BB, backend="firecracker"), "t")
    assert "firecracker" in exc.value.message and "container" in exc.value.message
    assert exc.value.details["offered"] == [k for k, b in sorted(edge.backends.items())
                                            if b.capacity().offered]
    assert await edge.list(None, {}) == []  # nothing made, nothing journaled as live
    assert edge.journal.live() == []
    with pytest.raises(ValueError):
        SandboxSpec(image=BB, backend="Not A Kind")


async def test_container_is_the_default_and_reported(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    try:
        assert sb.backend == "container" and sb.guest_reported is False
        eid = await edge.exec_start(sb.id, ExecSpec(cmd=["true"]))
        assert (await edge.exec_wait(sb.id, eid)).guest_reported is False
    finally:
        await edge.delete(sb.id)
    cap = edge.capacity()["backends"]
    assert cap["container"]["offered"] is True and cap["container"]["kind"] == "container"
