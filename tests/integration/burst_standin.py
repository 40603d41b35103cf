"""A minimal stand-in for the edge actor of a burst node (tests/integration/test_burst_ray.py):
a real Edge started in a Ray actor that holds its node's ``rollbox_burst`` unit, reached
through Ray actor calls (the control path) by :class:`ActorEdge`, an EdgeAPI subset that
placement and the watcher use (report, declare_lost, create, get, delete, list) plus a
command run. It stands in for ``rollbox.cluster.edge_actor`` until that one serves its edge
over HTTP on main (``edge.service``/``edge.remote`` of lane E) and takes the burst resource."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from rollbox.models import NodeReport, SandboxInfo, SandboxSpec


class StandInEdge:
    """The actor (Ray makes it: ``ray.remote(StandInEdge).options(resources=...)``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        import os

        os.environ.update(env)
        self.loop = asyncio.new_event_loop()
        self.edge: Any = None
        self.error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(300)
        if self.edge is None:
            raise RuntimeError(f"the burst edge did not start: {self.error!r}")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            from rollbox.config import Settings
            from rollbox.edge.edge import Edge
            from rollbox.events.store import EventLog

            s = Settings()
            s.data_dir.mkdir(parents=True, exist_ok=True)
            self.events = EventLog(s.data_dir / "events.db")
            edge = Edge(s, self.events)
            await edge.start()
            self.edge = edge

        try:
            self.loop.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            self.error = exc
        finally:
            ready.set()
        self.loop.run_forever()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def node_id(self) -> str:
        return str(self.edge.node_id)

    def report(self, max_sandboxes: int, fence_s: float | None) -> dict[str, Any]:
        return self._call(self.edge.report(max_sandboxes, fence_s)).model_dump(mode="json")

    def declare_lost(self, ids: list[str]) -> list[str]:
        return list(self._call(self.edge.declare_lost(ids)))

    def create(self, spec: dict[str, Any], owner: str) -> dict[str, Any]:
        info = self._call(self.edge.create(SandboxSpec.model_validate(spec), owner))
        return info.model_dump(mode="json")

    def get(self, sid: str) -> dict[str, Any]:
        return self._call(self.edge.get(sid)).model_dump(mode="json")

    def delete(self, sid: str) -> None:
        self._call(self.edge.delete(sid))

    def list(self, owner: str | None, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [i.model_dump(mode="json") for i in self._call(self.edge.list(owner, labels))]

    def run(self, sid: str, cmd: list[str]) -> tuple[int, str]:
        from rollbox.models import ExecSpec

        async def go() -> tuple[int, str]:
            eid = await self.edge.exec_start(sid, ExecSpec(cmd=cmd))
            res = await self.edge.exec_wait(sid, eid)
            return res.exit_code if res.exit_code is not None else -1, res.stdout

        return self._call(go())

    def drain(self) -> int:
        """Refuse creates; the live sandboxes plus creates under way now."""
        self.edge.drain(True)

        async def count() -> int:
            return len(self.edge.live) + self.edge._starting

        return int(self._call(count()))

    def undrain(self) -> None:
        self.edge.drain(False)

    def shutdown(self) -> None:
        self._call(self.edge.close(destroy=True))
        self.events.close()


class ActorEdge:
    """The driver's EdgeAPI subset over a :class:`StandInEdge` actor."""

    def __init__(self, node_id: str, actor: Any) -> None:
        self.node_id = node_id
        self.actor = actor

    async def report(self, max_sandboxes: int = 10000,
                     fence_s: float | None = None) -> NodeReport:
        return NodeReport.model_validate(await self.actor.report.remote(max_sandboxes, fence_s))

    async def declare_lost(self, ids: list[str]) -> list[str]:
        return list(await self.actor.declare_lost.remote(ids))

    async def create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        from ray.exceptions import RayTaskError

        from rollbox.errors import RollboxError

        try:
            raw = await self.actor.create.remote(spec.model_dump(mode="json"), owner)
        except RayTaskError as exc:  # it wraps the edge's typed error
            if isinstance(exc.cause, RollboxError):
                raise exc.cause from None
            raise
        return SandboxInfo.model_validate(raw)

    async def get(self, sid: str) -> SandboxInfo:
        return SandboxInfo.model_validate(await self.actor.get.remote(sid))

    async def delete(self, sid: str) -> None:
        await self.actor.delete.remote(sid)

    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        return [SandboxInfo.model_validate(i) for i in await self.actor.list.remote(owner, labels)]
