"""Placement: route a sandbox id to its edge and choose an edge for a new sandbox.

Sandbox ids are ``<node_id>-<random hex>`` so any api replica can route them without shared
state. Owns no state beyond the list of edges; does not create ids (edges do) nor track health
(the watcher will).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import random
import re
from collections.abc import Mapping, Sequence

from rollbox import errors
from rollbox.edge.interface import EdgeAPI
from rollbox.models import SandboxInfo, SandboxSpec

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^(?P<node>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)-(?P<rand>[0-9a-f]{8,64})$")


def split_sandbox_id(sandbox_id: str) -> tuple[str, str]:
    """``"n0-3fa2..." -> ("n0", "3fa2...")``; BadRequest-free: NotFound for anything malformed."""
    m = _ID_RE.match(sandbox_id) if len(sandbox_id) <= 200 else None
    if m is None:
        raise errors.NotFound(f"no sandbox {sandbox_id[:80]!r}")
    return m["node"], m["rand"]


async def _capacity(edge: EdgeAPI) -> object:
    """What an edge's ``capacity()`` (EdgeAPI; sync, or async for a remote edge) says; None
    when it fails."""
    try:
        cap = edge.capacity()
        if inspect.isawaitable(cap):
            cap = await cap
    except Exception:
        log.warning("capacity() of %s failed", edge.node_id, exc_info=True)
        return None
    return cap


async def _free_capacity(edge: EdgeAPI) -> float | None:
    """An edge's capacity as a number or a mapping with ``free``; higher means more room."""
    cap = await _capacity(edge)
    if isinstance(cap, Mapping):
        cap = cap.get("free")
    if isinstance(cap, (int, float)):
        return float(cap)
    return None


class Placement:
    def __init__(self, edges: Sequence[EdgeAPI]) -> None:
        if not edges:
            raise ValueError("Placement needs at least one edge")
        self.edges: dict[str, EdgeAPI] = {}
        for e in edges:
            if e.node_id in self.edges:
                raise ValueError(f"duplicate node id {e.node_id!r}")
            self.edges[e.node_id] = e
        # Placements started here and not yet answered: counted against an edge's free room so
        # a burst does not pile onto the edge that looked emptiest a moment ago.
        self._inflight: dict[str, int] = {n: 0 for n in self.edges}

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        node, _ = split_sandbox_id(sandbox_id)
        edge = self.edges.get(node)
        if edge is None:
            raise errors.NotFound(f"no sandbox {sandbox_id[:80]!r} (unknown node {node!r})")
        return edge

    async def _score(self, node: str) -> float:
        free = await _free_capacity(self.edges[node])
        if free is None:
            return -float(self._inflight[node])
        return free - self._inflight[node]

    async def _pick(self, candidates: list[str]) -> str:
        if len(candidates) <= 2:
            pair = candidates
        else:
            pair = random.sample(candidates, 2)  # power of two choices
        if len(pair) == 1:
            return pair[0]
        a, b = await asyncio.gather(*(self._score(n) for n in pair))
        if a == b:
            return random.choice(pair)
        return pair[0] if a > b else pair[1]

    async def _offering(self, kind: str) -> list[str]:
        """Nodes whose capacity says they offer backend ``kind`` (an edge that does not list
        its backends stays a candidate: it refuses by itself). BadRequest if none does."""
        if len(self.edges) == 1:
            return list(self.edges)  # the edge's own refusal names its reason
        caps = await asyncio.gather(*(_capacity(e) for e in self.edges.values()))
        out, offered = [], set()
        for node, cap in zip(self.edges, caps):
            backends = cap.get("backends") if isinstance(cap, Mapping) else None
            if not isinstance(backends, Mapping):
                out.append(node)
                continue
            kinds = {k for k, b in backends.items() if isinstance(b, Mapping) and b.get("offered")}
            offered |= kinds
            if kind in kinds:
                out.append(node)
        if not out:
            raise errors.BadRequest(f"backend {kind!r} is not offered by any node; offered: "
                                    f"{', '.join(sorted(offered)) or 'none'}",
                                    backend=kind, offered=sorted(offered))
        return out

    async def create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        """Create on a chosen edge of those offering ``spec.backend``; an edge that refuses
        (capacity / infra) is skipped and another tried. Raises the last retryable error when
        every edge refused."""
        candidates = await self._offering(spec.backend)
        last: errors.InfraError | None = None
        while candidates:
            node = await self._pick(candidates)
            self._inflight[node] += 1
            try:
                return await self.edges[node].create(spec, owner)
            except errors.InfraError as exc:  # CapacityExceeded is an InfraError
                log.info("edge %s refused a sandbox: %s", node, exc)
                last = exc
                candidates.remove(node)
            finally:
                self._inflight[node] -= 1
        assert last is not None
        if isinstance(last, errors.CapacityExceeded):
            raise errors.CapacityExceeded("every node is full; retry later",
                                          nodes=len(self.edges))
        raise last

    async def node_limits(self) -> dict[str, float]:
        """The most any one node can hold, per budget (``capacity()["limits"]`` of the edges:
        sandboxes, cpus, memory_mib, layer_mib); what a project quota may not exceed."""
        out: dict[str, float] = {}
        for cap in await asyncio.gather(*(_capacity(e) for e in self.edges.values())):
            limits = cap.get("limits") if isinstance(cap, Mapping) else None
            if isinstance(limits, Mapping):
                for k, v in limits.items():
                    if isinstance(v, (int, float)):
                        out[k] = max(out.get(k, 0.0), float(v))
        return out

    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        results = await asyncio.gather(
            *(e.list(owner, labels) for e in self.edges.values()), return_exceptions=True
        )
        out: list[SandboxInfo] = []
        for node, res in zip(self.edges, results):
            if isinstance(res, BaseException):
                # A dead node must not hide the others' sandboxes; the watcher reports it.
                log.warning("listing node %s failed: %r", node, res)
                continue
            out.extend(res)
        out.sort(key=lambda i: i.created_at)
        return out
