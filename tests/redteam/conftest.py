"""Red-team helpers: real sandboxes through the `edge` fixture, hardened or (for the twin tests
that prove an attack works without hardening) deliberately unhardened. The unhardened twin is
reached only by wrapping the backend's create here; the HTTP API has no way to ask for it.

Every test that takes the ``boxes`` fixture runs once per backend (``[container]``,
``[microvm]``). An attack that only makes sense for containers says so with
``@container_only("why")``: its microVM run is reported as skipped with that reason, never as a
pass. The microVM runs are behind the ``microvm_slow`` marker (VMs under TCG are slow) except
the few marked ``@microvm_default``, which the default tier runs.

``[container]`` runs start their sandboxes with the node's runtime (``ROLLBOX_RUNTIME``, the
native launcher by default); the container attacks also run on runc (``[runc]``: the same
container backend, its sandboxes started by ``runc run -d``), behind the ``slow`` marker (the
container red team takes ~2 min here), and on warm-pool sandboxes (``[pooled]``: an edge
with ``ROLLBOX_POOL`` on, each sandbox made ahead into the pool for its key and handed out by
the create, rollbox.edge.pool), also behind ``slow``. Tests that take the ``edge`` fixture
without ``boxes`` run on the node's runtime: ``ROLLBOX_RUNTIME=runc`` runs all of them on
runc."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from rollbox.models import ExecResult, ExecSpec, NetworkPolicy, Resources, SandboxSpec

BB = "busybox:test"
PY = "python:3.11"


# "vm": the full-VM backend (backends/vm) is the microVM's lifecycle on a q35 machine: it runs
# every attack the microVM runs do, with the same marks (container_only skips it, microvm_open
# is an expected failure, and every vm run is behind microvm_slow: one TCG boot each).
BACKENDS = ("container", "runc", "pooled", "microvm", "vm")
# The kind of sandbox each run makes ("runc": a container, started by runc; "pooled": a
# container made ahead into the edge's warm pool, then handed out by the create).
KIND = {"runc": "container", "pooled": "container"}


def container_only(reason: str) -> pytest.MarkDecorator:
    """The attack targets a container-only layer (seccomp, Landlock, the user namespace, runc's
    fd passing...): on a microVM the guest's root owns the guest, so it is not an attack there."""
    return pytest.mark.container_only(reason=reason)


def microvm_open(reason: str) -> pytest.MarkDecorator:
    """The attack applies to microVMs and is not (yet) defended or checked there: its microVM
    run is an expected failure with ``reason`` (reported as xfailed, never as a pass; strict,
    so a fix shows up as a failure to update)."""
    return pytest.mark.microvm_open(reason=reason)


def vm_open(reason: str) -> pytest.MarkDecorator:
    """As :func:`microvm_open`, for the full-VM backend's run only (a strict xfail)."""
    return pytest.mark.vm_open(reason=reason)


# Also run on microVMs in the default tier (keep this set small: one VM boot each).
microvm_default = pytest.mark.microvm_default


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "boxes" not in metafunc.fixturenames:
        return
    params = []
    for kind in BACKENDS:
        marks: list[pytest.MarkDecorator] = []
        if kind in ("runc", "pooled"):
            marks.append(pytest.mark.slow)
        if kind in ("microvm", "vm"):
            only = metafunc.definition.get_closest_marker("container_only")
            if only is not None:
                marks.append(pytest.mark.skip(reason=f"container only: {only.kwargs['reason']}"))
            elif kind == "vm" or metafunc.definition.get_closest_marker(
                    "microvm_default") is None:
                marks.append(pytest.mark.microvm_slow)
            open_ = metafunc.definition.get_closest_marker(
                "microvm_open" if kind == "microvm" else "vm_open") or (
                metafunc.definition.get_closest_marker("microvm_open"))
            if open_ is not None and only is None:
                marks.append(pytest.mark.xfail(reason=f"open on microVMs: "
                                               f"{open_.kwargs['reason']}", strict=True))
        params.append(pytest.param(kind, marks=marks, id=kind))
    metafunc.parametrize("backend_kind", params)


@contextlib.contextmanager
def create_flags(edge: Any, kind: str, **flags: Any) -> Iterator[None]:
    """The edge's creates of ``kind`` get the backend's test-only ``flags`` (``hardened=False``:
    a container with every capability and no masks, seccomp or Landlock; a microVM whose
    commands keep every capability of the guest's root)."""
    backend = edge.backends[kind]
    backend.create = functools.partial(type(backend).create, backend, **flags)
    try:
        yield
    finally:
        del backend.create


@dataclass
class Boxes:
    edge: Any
    lock: asyncio.Lock
    kind: str = "container"
    pooled: bool = False  # each make() fills the pool for its key, then creates from it

    async def make(self, image: str = BB, *, hardened: bool = True,
                   hidden: tuple[str, ...] = (), network: list[str] | None = None,
                   disk_tier: Literal["disk", "memory"] = "disk",
                   qos: Literal["latency", "batch"] = "batch", **resources: Any) -> str:
        """network: None = loopback only; a list = a network policy with these allow rules."""
        spec = SandboxSpec(image=image, resources=Resources(**resources), backend=self.kind,
                           hidden_paths=list(hidden), disk_tier=disk_tier, qos=qos,
                           network=NetworkPolicy(allow=network) if network is not None else None)
        async with self.lock:  # the wrapper is per call: never mix flags across creations
            with create_flags(self.edge, self.kind, hardened=hardened):
                made = await self.edge.pool_fill(spec, 1) if self.pooled else []
                info = await self.edge.create(spec, "redteam")
        if self.pooled:  # the attack runs on the pooled one, or the test is wrong
            assert made and info.id == made[0], (made, info.id)
        return info.id

    async def run(self, sid: str, cmd: str | list[str], **kw: Any) -> ExecResult:
        kw.setdefault("timeout_s", 30)
        eid = await self.edge.exec_start(sid, ExecSpec(cmd=cmd, **kw))
        return await self.edge.exec_wait(sid, eid)

    async def py(self, sid: str, code: str, **kw: Any) -> ExecResult:
        return await self.run(sid, ["python3", "-c", code], **kw)


async def offered_or_skip(edge: Any, kind: str) -> None:
    """Skip (reported, with the node's reason) when this node does not offer ``kind``."""
    cap = (await edge.capacity())["backends"].get(kind)  # type: ignore[union-attr]
    if cap is None or not cap["offered"]:
        pytest.skip(f"this node does not offer {kind} sandboxes: "
                    f"{cap['reason'] if cap else 'no such backend'}")


@pytest.fixture
def edge_settings(request: pytest.FixtureRequest) -> dict:
    """A ``[runc]`` run's edge starts its containers with runc."""
    callspec = getattr(request.node, "callspec", None)
    kind = callspec.params.get("backend_kind") if callspec is not None else None
    if kind == "pooled":
        return {"pool": True}
    return {"runtime": "runc"} if kind == "runc" else {}


@pytest.fixture
async def boxes(edge, backend_kind: str) -> Boxes:  # noqa: ANN001
    kind = KIND.get(backend_kind, backend_kind)
    await offered_or_skip(edge, kind)
    if backend_kind == "pooled":  # only what make() fills is pooled: no refill in between
        await edge.pool.stop_refill()
    return Boxes(edge, asyncio.Lock(), kind, pooled=backend_kind == "pooled")


@pytest.fixture
async def vms(edge) -> Boxes:  # noqa: ANN001
    """microVM sandboxes only (the F39-F42 attacks that have no container counterpart)."""
    await offered_or_skip(edge, "microvm")
    return Boxes(edge, asyncio.Lock(), "microvm")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc sandboxes)")


def static_helper(name: str) -> bytes:
    """``helpers/<name>.c`` compiled static on the host (skips without gcc): a program the
    test plants in a sandbox."""
    if not shutil.which("gcc"):
        pytest.skip("gcc not on the host")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / name
        subprocess.run(["gcc", "-static", "-O2", "-o", str(out),
                        str(Path(__file__).parent / "helpers" / f"{name}.c")], check=True)
        return out.read_bytes()
