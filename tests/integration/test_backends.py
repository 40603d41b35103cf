"""The edge's registry of backends (rollbox.backends.base): SandboxSpec.backend picks one, a kind
the node does not offer is refused before anything is made, node capacity lists each kind."""
from __future__ import annotations

import pytest

from rollbox.backends.base import BackendCapacity
from rollbox.errors import BadRequest, InfraError
from rollbox.models import ExecSpec, Resources, SandboxSpec

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
    cap = (await edge.capacity())["backends"]
    assert cap["container"]["offered"] is True and cap["container"]["kind"] == "container"


class _Unusable:
    """A registered kind the edge must refuse before asking it anything but capacity()."""

    def __init__(self, kind: str, **cap: object) -> None:
        self.kind = kind
        self.cap = cap
        self.created = 0

    def capacity(self) -> BackendCapacity:
        return BackendCapacity(kind=self.kind, **self.cap)  # type: ignore[arg-type]

    async def create(self, *_a: object) -> None:
        self.created += 1
        raise AssertionError("the edge asked a backend it should have refused")


async def test_not_offered_and_above_the_node_are_refused(edge) -> None:  # noqa: ANN001
    off = _Unusable("vmx", offered=False, reason="no guest kernel")
    small = _Unusable("tiny", max_cpus=1.0, max_memory_mib=512, max_disk_mib=64)
    edge.backends.update({"vmx": off, "tiny": small})
    try:
        with pytest.raises(BadRequest) as exc:
            await edge.create(SandboxSpec(image=BB, backend="vmx"), "t")
        assert "no guest kernel" in exc.value.message
        assert "vmx" not in exc.value.details["offered"]
        assert "tiny" in exc.value.details["offered"]
        fits = {"cpus": 1, "memory_mib": 512, "disk_mib": 64}
        for name, above in (("cpus", 2), ("memory_mib", 513), ("disk_mib", 65)):
            with pytest.raises(BadRequest) as exc:
                await edge.create(SandboxSpec(image=BB, backend="tiny", resources=Resources(
                    **{**fits, name: above})), "t")
            assert exc.value.details["resource"] == name, exc.value.message
        assert off.created == small.created == 0
        assert edge.journal.live() == [] and edge.admission.capacity()["sandboxes"] == 0
        cap = (await edge.capacity())["backends"]
        assert cap["vmx"]["offered"] is False and cap["tiny"]["max_cpus"] == 1.0
    finally:
        del edge.backends["vmx"], edge.backends["tiny"]


async def test_backend_refusals_through_the_http_api(api_server) -> None:  # noqa: ANN001
    import httpx

    url, keys = api_server
    headers = {"X-API-Key": keys.create("proj")}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as h:
        r = await h.post("/v1/sandboxes", json={"image": BB, "backend": "firecracker"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "bad_request" and "container" in err["details"]["offered"]
        r = await h.post("/v1/sandboxes", json={"image": BB, "backend": "Not A Kind"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
        assert (await h.get("/v1/sandboxes")).json() == []  # nothing half-created


class _FailsToStart(_Unusable):
    async def start(self) -> None:
        raise InfraError("probe failed")

    def host_sandbox_ids(self, prefix: str = "") -> set[str]:
        return set()

    def release_node_resources(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_a_backend_failing_at_node_start_leaves_the_others_serving(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    sb = await e1.create(SandboxSpec(image=BB), "t")
    await restarts.stop()
    from rollbox.edge.edge import Edge

    e2 = Edge(restarts.settings, restarts.events)
    e2.backends["vmx"] = _FailsToStart("vmx")
    restarts.edge = e2
    await e2.start()
    assert sb.id in e2.live  # the container came back though another kind failed
    eid = await e2.exec_start(sb.id, ExecSpec(cmd=["true"]))
    assert (await e2.exec_wait(sb.id, eid)).exit_code == 0
    await e2.delete(sb.id)


async def test_get_shows_the_backends_live_usage(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=256)), "t")
    try:
        before = (await edge.get(sb.id)).usage
        assert before is not None and before.memory_bytes and before.oom_kills == 0
        eid = await edge.exec_start(sb.id, ExecSpec(
            cmd="i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"))
        assert (await edge.exec_wait(sb.id, eid)).exit_code == 0
        after = (await edge.get(sb.id)).usage
        assert after is not None and after.cpu_usage_us > (before.cpu_usage_us or 0)
        assert all(i.usage is None for i in await edge.list(None, {}))  # GET only
    finally:
        await edge.delete(sb.id)
    assert (await edge.get(sb.id)).usage is None  # a deleted sandbox has none
