"""The platform's own latency-sensitive sandboxes ask for qos "latency": fncall workers (a test
edge that records the spec and refuses). Graders: tests/integration/test_grading.py."""
from __future__ import annotations

from rollbox import errors
from rollbox.fncall.pool import FnCallBackend, PoolConfig
from rollbox.models import SandboxInfo, SandboxSpec


class RecordingEdge:
    node_id = "n0"

    def __init__(self) -> None:
        self.specs: list[SandboxSpec] = []

    async def create(self, spec: SandboxSpec, owner: str, share: str = "new") -> SandboxInfo:
        self.specs.append(spec)
        raise errors.CapacityExceeded("full (test)")


async def test_fncall_workers_are_latency() -> None:
    edge = RecordingEdge()
    backend = FnCallBackend(edge, PoolConfig(max_workers=2))  # type: ignore[arg-type]
    await backend.prewarm("python", 1, image="python:3.11")
    await backend.close()
    assert [s.qos for s in edge.specs] == ["latency"]
    assert SandboxSpec(image="python:3.11").qos == "batch"  # a project's default
