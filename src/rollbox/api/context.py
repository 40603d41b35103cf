"""The api's state and the route logic its routers and front doors share: :class:`ApiContext`.

One per app (``app.state.api``; kept off the modules so several apps can coexist): the
placement, IAM store, quota ledger and lease store the app was made with, the owner cache that
authorises a sandbox id, the audit trail's reads and the api's own entries in it (each edge keeps
its sandboxes' trail, ``EdgeAPI.events``/``record_event``: the api records only what it alone
knows, e.g. who asked), and the one create path (:meth:`ApiContext.create_sandbox`: reserve in the ledger, place,
commit; a fork, :meth:`ApiContext.fork_sandbox`, reserves all its children first and goes to
the source's node). Routes reach it through ``api.deps``; front doors get it as the typed argument of their
``mount``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

from rollbox import errors
from rollbox.edge.interface import EdgeAPI
from rollbox.iam import IamStore, Principal, QuotaLedger, Reservation, Usage
from rollbox.iam.model import RESERVATION_TTL_S
from rollbox.jobs import LeaseStore
from rollbox.models import (
    FORK_OF_LABEL, NODE_LOST, ForkResult, ForkSpec, Resources, SandboxInfo, SandboxSpec,
)
from rollbox.placement import Placement, split_sandbox_id
from rollbox.watcher import Watcher

log = logging.getLogger(__name__)
OWNER_CACHE_SIZE = 65536


class ApiContext:
    """``leases``: None when the server keeps none
    (their routes answer bad_request). ``ledger``: None = no cluster-wide quotas (only the
    edges' per-node admission). ``watcher``: the view of the nodes' health (None: every node
    is taken as alive); a dead node's sandboxes answer SandboxDead (reason node_lost) and are
    listed dead."""

    def __init__(self, placement: Placement, keys: IamStore, leases: LeaseStore | None = None,
                 ledger: QuotaLedger | None = None, watcher: Watcher | None = None) -> None:
        self.placement = placement
        self.watcher = watcher
        self.keys = keys
        self.leases = leases
        self.ledger = ledger
        self._owners: OrderedDict[str, str] = OrderedDict()

    # -- auth and ownership --
    async def principal(self, key: str | None) -> Principal:
        """The caller of a request with ``key`` (Unauthorized if none or not valid)."""
        return await self.keys.authenticate(key)

    def remember_owner(self, sandbox_id: str, owner: str) -> None:
        self._owners[sandbox_id] = owner
        self._owners.move_to_end(sandbox_id)
        while len(self._owners) > OWNER_CACHE_SIZE:
            self._owners.popitem(last=False)

    async def sandbox_edge(self, sandbox_id: str, who: Principal) -> EdgeAPI:
        """The edge of a sandbox the principal may use; others' sandboxes look absent. On a
        node the watcher found dead: SandboxDead with reason node_lost; on one it finds
        suspect (not answering its probes for watch_suspect_s): EdgeUnreachable at once
        (retryable; nothing was sent), not a call that waits for the node's silence to time
        out (RemoteEdge's idle timeout, 10 s)."""
        edge = self.placement.edge_for(sandbox_id)
        if self.watcher is not None:
            self._check_node_lost(sandbox_id, who)
            self._check_node_suspect(sandbox_id, who)
        owner = self._owners.get(sandbox_id)
        if owner is None:
            owner = (await edge.get(sandbox_id)).owner
            self.remember_owner(sandbox_id, owner)
        if not who.admin and owner != who.project:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return edge

    def _check_node_suspect(self, sandbox_id: str, who: Principal) -> None:
        assert self.watcher is not None
        node, _ = split_sandbox_id(sandbox_id)
        if self.watcher.health(node) != "suspect":
            return
        owner = self._owners.get(sandbox_id)
        if owner is not None and not who.admin and owner != who.project:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        raise errors.EdgeUnreachable(f"node {node} is not answering (suspect): not asked; "
                                     "retry later", node=node, reason="suspect")

    def _check_node_lost(self, sandbox_id: str, who: Principal) -> None:
        assert self.watcher is not None
        node, _ = split_sandbox_id(sandbox_id)
        if self.watcher.health(node) != "dead":
            return
        known = self.watcher.lost(sandbox_id, node)
        owner = known.owner if known is not None else self._owners.get(sandbox_id)
        if owner is not None and not who.admin and owner != who.project:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        # An id the last report did not list (created just before) is lost with its node too.
        raise errors.SandboxDead(f"sandbox {sandbox_id} is dead: its node {node} was lost "
                                 "(no answer from it)", state="dead", reason=NODE_LOST,
                                 node=node)

    async def list_sandboxes(self, owner: str | None,
                             labels: dict[str, str]) -> list[SandboxInfo]:
        """Every node's live sandboxes (owner None: all); with a watcher, a dead node's are
        listed dead (node_lost) instead of missing, and a node that does not answer within
        the probe timeout gives its last reported ones."""
        if self.watcher is None:
            return await self.placement.list(owner, labels)
        watcher = self.watcher
        dead = watcher.dead_nodes()
        asked = [(n, e) for n, e in self.placement.edges.items() if n not in dead]

        async def one(node: str, edge: EdgeAPI) -> list[SandboxInfo]:
            try:
                async with asyncio.timeout(watcher.probe_timeout_s):
                    infos = await edge.list(owner, labels)
                watcher.remember(infos)  # for label filters once the node is silent or dead
                return infos
            except Exception as exc:  # noqa: BLE001 - the node's last report instead
                log.warning("listing node %s failed (%r): its last reported sandboxes",
                            node, exc)
                return watcher.last_known_infos(node, owner, labels)

        out = [i for part in await asyncio.gather(*(one(n, e) for n, e in asked))
               for i in part]
        out += watcher.lost_infos(owner, labels)
        out.sort(key=lambda i: i.created_at)
        return out

    async def logged_owner(self, sandbox_id: str) -> str | None:
        """The owner the sandbox's audit trail names, read from its node's edge (the edge's
        log outlives the sandbox): its first event is the edge's sandbox.created with the
        owner, which authorises reading the log of a deleted sandbox. NotFound for an id of
        no known node; a node that does not answer gives its typed error."""
        edge = self.placement.edge_for(sandbox_id)
        async with contextlib.aclosing(edge.events(sandbox_id, 0, False)) as events:
            first = await anext(events, None)
        if first is not None and first.kind == "sandbox.created":
            try:
                return str(json.loads(first.data).get("owner"))
            except (ValueError, AttributeError):
                return None
        return None

    async def check_image_name(self, owner: str, name: str) -> None:
        """An image name under another project's name (``teamA/...``) is that project's: no
        other project may take it (squatting its names, or probing them through the
        name-taken error). Names under no project's name stay node-wide."""
        if name.startswith(f"{owner}/"):
            return
        for project in await self.keys.project_names():
            if project != owner and name.startswith(f"{project}/"):
                raise errors.BadRequest(f"image {name!r}: names under {project + '/'!r} "
                                        f"are that project's; use e.g. '{owner}/...'",
                                        image=name)

    def lease_store(self) -> LeaseStore:
        if self.leases is None:
            raise errors.BadRequest("this server keeps no job leases")
        return self.leases

    # -- the create path: reserve, place, commit --
    async def create_sandbox(self, spec: SandboxSpec, project: str,
                             requested: dict[str, object] | None = None) -> SandboxInfo:
        """Create a sandbox of ``project``: room reserved in the ledger first (QuotaExceeded,
        nothing placed), renewed while the edge creates it, committed once it exists, dropped
        if the create fails. A replica that dies meanwhile stops renewing: the reservation
        expires and reconcile charges the sandbox if the edge made it. ``requested``: the
        data of its sandbox.requested event (who asked), which the edge logs in the create
        call itself (after its sandbox.created)."""
        note = json.dumps(requested) if requested is not None else None
        if self.ledger is None:
            return await self.placement.create(spec, project, note)
        ledger = self.ledger
        res = await ledger.reserve(project, Usage.of(spec.resources))
        try:
            async with self._renewing(res):
                info = await self.placement.create(spec, project, note)
        except BaseException:
            # Shielded: a cancelled request still hands its room back (or it expires).
            with contextlib.suppress(errors.RollboxError):
                await asyncio.shield(ledger.cancel(res))
            raise
        try:
            await asyncio.shield(ledger.commit(res, info.id, info.node))
        except errors.RollboxError as exc:  # the ledger's reconcile charges it from the edge
            log.warning("committing %s to the quota ledger failed: %s", info.id, exc)
        return info

    async def fork_sandbox(self, edge: EdgeAPI, sandbox_id: str, spec: ForkSpec,
                           project: str, resources: Resources) -> ForkResult:
        """Fork ``sandbox_id`` (of ``project``) on its own node: room for all ``spec.n``
        children reserved in the ledger first, in one transaction (QuotaExceeded: nothing
        held, nothing forked; two forks racing for the last room never both get it), renewed
        while the edge forks, committed per child. A keyed fork the edge answers from its
        first attempt commits the children charged already: the reservations are dropped as
        doubles."""
        if self.ledger is None:
            return await edge.fork(sandbox_id, spec, project)
        ledger = self.ledger
        held: list[Reservation] = []
        try:
            try:
                held = await ledger.reserve_many(project, Usage.of(resources), spec.n)
            except errors.QuotaExceeded:
                # A retry of a keyed fork that made its children (charged already) while the
                # project is at its quota: the edge answers it from the first attempt.
                if spec.idempotency_key is None or not await self._forked_under(
                        edge, sandbox_id, project, spec.idempotency_key):
                    raise
            async with self._renewing(*held):
                result = await edge.fork(sandbox_id, spec, project)
        except BaseException:
            with contextlib.suppress(errors.RollboxError):
                await asyncio.shield(asyncio.gather(*(ledger.cancel(r) for r in held)))
            raise
        for res, child in zip(held, result.children):
            try:
                await asyncio.shield(ledger.commit(res, child.id, child.node))
            except errors.RollboxError as exc:  # reconcile charges it from the edge
                log.warning("committing %s to the quota ledger failed: %s", child.id, exc)
        # A keyed fork answered with fewer children (some of its first ones deleted since):
        # the rest of the room goes back.
        with contextlib.suppress(errors.RollboxError):
            await asyncio.shield(asyncio.gather(*(ledger.cancel(r)
                                                  for r in held[len(result.children):])))
        return result

    @staticmethod
    async def _forked_under(edge: EdgeAPI, sandbox_id: str, project: str, key: str) -> bool:
        """Whether ``project`` has live children of ``sandbox_id`` forked under ``key``."""
        kids = await edge.list(project, {FORK_OF_LABEL: sandbox_id})
        return any(k.fork_key == key for k in kids)

    @contextlib.asynccontextmanager
    async def _renewing(self, *held: Reservation) -> AsyncIterator[None]:
        assert self.ledger is not None
        ledger = self.ledger

        async def renew() -> None:
            while True:
                await asyncio.sleep(RESERVATION_TTL_S / 3)
                for res in held:
                    try:
                        await ledger.renew(res)
                    except errors.RollboxError as exc:
                        log.warning("renewing a quota reservation failed: %s", exc)

        task = asyncio.create_task(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def sandbox_ended(self, sandbox_id: str) -> None:
        """A sandbox was deleted through the api: its ledger entry goes (a failure is left
        to reconcile)."""
        if self.ledger is None:
            return
        try:
            await asyncio.shield(self.ledger.release(sandbox_id))
        except errors.RollboxError as exc:
            log.warning("releasing %s from the quota ledger failed: %s", sandbox_id, exc)

    async def delete_sandbox(self, edge: EdgeAPI, sandbox_id: str,
                             requested: dict[str, object]) -> None:
        """Delete a sandbox, its sandbox.requested event (who asked) logged by the edge in the
        same call, before the delete's own; then its ledger entry goes."""
        await edge.delete(sandbox_id, requested=json.dumps(requested))
        await self.sandbox_ended(sandbox_id)

    # -- the api's own entries in the audit trail --
    async def record(self, edge: EdgeAPI, sandbox_id: str, kind: str,
                     data: dict[str, object]) -> None:
        """Add what only the api knows (who asked for an operation, a grade, a job's end) to
        the sandbox's audit trail on its edge. The operation's outcome stands if this fails:
        the failure is logged, not raised (the edge logs the operation itself)."""
        try:
            await edge.record_event(sandbox_id, kind, json.dumps(data))
        except errors.RollboxError as exc:
            log.warning("recording %s of %s failed: %s", kind, sandbox_id, exc)
