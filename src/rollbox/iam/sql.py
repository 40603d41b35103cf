"""The logic of both IAM stores over one small SQL seam: :class:`SqlIam` (projects, keys,
quotas) and :class:`SqlLedger` (the quota ledger), written once for SQLite and PostgreSQL.

A store gives a :class:`Db`: ``run(fn)`` runs ``fn(tx)`` in one write transaction (SQLite:
BEGIN IMMEDIATE, the whole file locked; PostgreSQL: READ COMMITTED with the rows named by
``tx.lock`` taken FOR UPDATE, retried on serialization failures and deadlocks). SQL is written
with ``?`` placeholders and types both accept (CAST(... AS DOUBLE PRECISION), no booleans).
Owns no connection and no schema: ``iam.keys`` (SQLite) and ``iam.postgres`` do.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal, Protocol, TypeVar

from rollbox import errors
from rollbox.iam.model import (
    LIMITED,
    RECONCILE_GRACE_S,
    RESERVATION_TTL_S,
    TOMBSTONE_S,
    ChainLink,
    KeyInfo,
    LiveSandbox,
    Principal,
    ProjectInfo,
    Reservation,
    Usage,
    ancestors,
    check_delegation,
    check_lookup,
    check_name,
    check_reserve,
    charged,
    check_values,
    default_child_quota,
    in_subtree,
    parent_of,
)
from rollbox.models import NodeSandbox, Quota

T = TypeVar("T")
Row = Sequence[object]
QUOTA_COLS = "max_sandboxes, max_cpus, max_memory_mib, max_layer_mib"
KEY_COLS = ("key_id, display, project, admin, created_at, revoked_at, last_used_at, scope")
# A ledger entry counts when committed, or reserved and not expired.
LIVE = "(state = 'committed' OR (state = 'reserved' AND expires_at > ?))"
# An entry made a tombstone: kept (with its sandbox id) for TOMBSTONE_S, under no project so
# the sums of live entries never pass over it.
RELEASED = "state = 'released', released_at = ?, project = '', node = NULL"
USE_COLS = ("COUNT(*), CAST(COALESCE(SUM(cpus), 0) AS DOUBLE PRECISION), "
            "CAST(COALESCE(SUM(memory_mib), 0) AS BIGINT)")


class Tx(Protocol):
    """One transaction. ``lock``: the suffix that locks the rows a SELECT reads
    (" FOR UPDATE" in PostgreSQL; "" in SQLite, whose transaction holds the whole file)."""

    lock: str

    async def fetch(self, sql: str, *args: object) -> list[Row]: ...
    async def execute(self, sql: str, *args: object) -> int: ...


class Db(Protocol):
    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T: ...

    async def execute(self, sql: str, *args: object) -> int:
        """One statement on its own (atomic by itself: no BEGIN/COMMIT round trips around it
        in PostgreSQL), retried like ``run``; the number of rows it changed."""
        ...


def quota_of(row: Row) -> Quota:
    """Quota from the four QUOTA_COLS of a row (constructed, not validated again: a limit
    stored before the model's bounds, say an inf or a 2^60, must not make every reserve and
    read of the project fail; a set validates what it writes)."""
    s, c, m, layer = row
    return Quota.model_construct(
        sandboxes=None if s is None else int(s), cpus=None if c is None else float(c),
        memory_mib=None if m is None else int(m),
        layer_mib=None if layer is None else int(layer))


def quota_args(q: Quota) -> tuple[object, ...]:
    return (q.sandboxes, None if q.cpus is None else float(q.cpus), q.memory_mib, q.layer_mib)


def usage_of(row: Row) -> Usage:
    return Usage(int(row[0]), float(row[1]), int(row[2]))  # type: ignore[call-overload,arg-type]


def key_info(r: Row) -> KeyInfo:
    scope = r[7] if r[7] is not None else ("" if r[3] else None)
    return KeyInfo(key_id=str(r[0]), display=str(r[1]), project=str(r[2]),
                   admin=scope is not None, created_at=float(r[4]),  # type: ignore[arg-type]
                   revoked=r[5] is not None, revoked_at=r[5],  # type: ignore[arg-type]
                   last_used_at=r[6], scope=scope)  # type: ignore[arg-type]


def principal_of(key_id: str, project: str, admin: object, scope: object) -> Principal:
    """A key row's principal: the operator's keys (admin) administer everything."""
    sc = "" if admin else (None if scope is None else str(scope))
    return Principal(project=project, admin=sc == "", key_id=key_id, scope=sc)


def _placeholders(n: int) -> str:
    return ", ".join("?" * n)


def _forbidden(project: str) -> errors.Forbidden:
    return errors.Forbidden(f"project {project[:140]!r} is not one your key administers",
                            project=project[:140])


async def _use(tx: Tx, name: str, subtree: bool, now: float) -> Usage:
    if subtree:
        # Below "a": every name from "a/" up to "a0" ("0" follows "/"), in byte order (the
        # column's collation is binary: "C" in PostgreSQL): an index range, not a scan.
        rows = await tx.fetch(f"SELECT {USE_COLS} FROM ledger WHERE {LIVE} AND (project = ? "
                              "OR (project > ? AND project < ?))", now, name, name + "/",
                              name + "0")
    else:
        rows = await tx.fetch(f"SELECT {USE_COLS} FROM ledger WHERE {LIVE} AND project = ?",
                              now, name)
    return usage_of(rows[0])


async def _use_by_project(tx: Tx, name: str, now: float) -> dict[str, Usage]:
    """What ``name`` and each project below it hold now, by project."""
    rows = await tx.fetch(f"SELECT project, {USE_COLS} FROM ledger WHERE {LIVE} AND "
                          "(project = ? OR (project > ? AND project < ?)) GROUP BY project",
                          now, name, name + "/", name + "0")
    return {str(r[0]): usage_of(r[1:]) for r in rows}


def _total(uses: Iterable[Usage]) -> Usage:
    out = Usage()
    for u in uses:
        out = Usage(out.sandboxes + u.sandboxes, out.cpus + u.cpus,
                    out.memory_mib + u.memory_mib)
    return out


async def _children(tx: Tx, name: str) -> list[Quota]:
    rows = await tx.fetch(f"SELECT {QUOTA_COLS} FROM projects WHERE parent = ?", name)
    return [quota_of(r) for r in rows]


async def _lock_chain(tx: Tx, names: Sequence[str]) -> dict[str, Quota]:
    """The rows of ``names`` (a project and its ancestors), locked in name order (every
    transaction locks in that order: no deadlock), as name -> quota."""
    rows = await tx.fetch(f"SELECT name, {QUOTA_COLS} FROM projects WHERE name IN "
                          f"({_placeholders(len(names))}) ORDER BY name{tx.lock}", *names)
    return {str(r[0]): quota_of(r[1:]) for r in rows}


def _sum(quotas: Sequence[Quota]) -> Usage:
    return Usage(int(sum(q.sandboxes or 0 for q in quotas)), sum(q.cpus or 0.0 for q in quotas),
                 int(sum(q.memory_mib or 0 for q in quotas)))


class SqlIam:
    """The shared part of :class:`rollbox.iam.model.IamStore` (a backend adds
    ``authenticate``, ``key_active``, ``get`` and ``close``, and its caches)."""

    db: Db
    integrity_errors: tuple[type[BaseException], ...] = ()

    def _revoked(self) -> None:
        """Hook: a key was revoked through this store (drop cached principals)."""

    def _quotas_changed(self, project: str) -> None:
        """Hook: a project's limits changed through this store."""

    # ---- projects ----------------------------------------------------------------------
    async def create_project(self, who: Principal, name: str,
                             quota: Quota | None = None) -> ProjectInfo:
        check_name(name)
        parent = parent_of(name)
        if not (who.admin if parent is None else who.administers(parent)):
            raise _forbidden(name)
        if quota is not None:
            check_values(quota)
        now = time.time()

        async def fn(tx: Tx) -> ProjectInfo:
            chain = await _lock_chain(tx, [*ancestors(name), name])
            if name in chain:
                raise errors.BadRequest(f"project {name!r} exists", project=name)
            pq: Quota | None = None
            siblings: list[Quota] = []
            parent_own = Usage()
            if parent is not None:
                if parent not in chain:
                    raise errors.NotFound(f"no project {parent!r} (the parent of {name!r})",
                                          project=parent)
                pq = chain[parent]
                siblings = await _children(tx, parent)
                parent_own = await _use(tx, parent, False, now)
            q = quota if quota is not None else (default_child_quota(pq) if pq else Quota())
            check_delegation(name, q, pq, siblings, parent_own, [], Usage())
            await tx.execute(f"INSERT INTO projects (name, parent, {QUOTA_COLS}, created_at) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", name, parent, *quota_args(q), now)
            return ProjectInfo(name=name, parent=parent, quota=q, created_at=now)

        try:
            return await self.db.run(fn)
        except self.integrity_errors:
            raise errors.BadRequest(f"project {name!r} exists", project=name) from None

    async def projects(self, who: Principal) -> list[ProjectInfo]:
        now = time.time()

        async def fn(tx: Tx) -> list[ProjectInfo]:
            if who.admin or who.scope is not None:
                root = "" if who.admin else str(who.scope)
                rows = await tx.fetch(f"SELECT name, parent, {QUOTA_COLS}, created_at FROM "
                                      "projects ORDER BY name")
                rows = [r for r in rows if in_subtree(str(r[0]), root)]
            else:
                rows = await tx.fetch(f"SELECT name, parent, {QUOTA_COLS}, created_at FROM "
                                      "projects WHERE name = ?", who.project)
            uses = await tx.fetch(f"SELECT project, {USE_COLS} FROM ledger WHERE {LIVE} "
                                  "GROUP BY project", now)
            own = {str(u[0]): usage_of(u[1:]) for u in uses}
            out = []
            for r in rows:
                name = str(r[0])
                sub = [u for p, u in own.items() if in_subtree(p, name)]
                kids = [quota_of(c[2:6]) for c in rows if c[1] == name]
                out.append(ProjectInfo(
                    name=name, parent=None if r[1] is None else str(r[1]),
                    quota=quota_of(r[2:6]), created_at=float(r[6]),  # type: ignore[arg-type]
                    used=_total(sub),
                    own_used=own.get(name, Usage()), delegated=_sum(kids)))
            return out

        return await self.db.run(fn)

    async def project_names(self) -> list[str]:
        async def fn(tx: Tx) -> list[str]:
            return [str(r[0]) for r in await tx.fetch("SELECT name FROM projects")]

        return await self.db.run(fn)

    async def get_quota(self, who: Principal, project: str) -> Quota:
        check_lookup(project)
        if project != who.project and not who.administers(project):
            raise errors.Forbidden("reading another project's quota needs an admin key of a "
                                   "project above it", project=project[:140])

        async def fn(tx: Tx) -> Quota:
            rows = await tx.fetch(f"SELECT {QUOTA_COLS} FROM projects WHERE name = ?", project)
            if not rows:
                raise errors.NotFound(f"no project {project[:140]!r}", project=project[:140])
            return quota_of(rows[0])

        return await self.db.run(fn)

    async def set_quota(self, who: Principal, project: str, quota: Quota) -> Quota:
        check_lookup(project)
        parent = parent_of(project)
        if not (who.admin if parent is None else who.administers(parent)):
            raise errors.Forbidden("a project's quota is set by an admin of a project above "
                                   "it (never its own)", project=project[:140])
        check_values(quota)
        now = time.time()

        async def fn(tx: Tx) -> Quota:
            chain = await _lock_chain(tx, [*ancestors(project), project])
            if project not in chain:
                raise errors.NotFound(f"no project {project[:140]!r}", project=project[:140])
            pq = chain.get(parent) if parent is not None else None
            siblings: list[Quota] = []
            parent_own = Usage()
            if parent is not None and pq is not None:
                rows = await tx.fetch(f"SELECT {QUOTA_COLS} FROM projects WHERE parent = ? "
                                      "AND name <> ?", parent, project)
                siblings = [quota_of(r) for r in rows]
                parent_own = await _use(tx, parent, False, now)
            check_delegation(project, quota, pq, siblings, parent_own,
                             await _children(tx, project), await _use(tx, project, False, now))
            await tx.execute("UPDATE projects SET max_sandboxes = ?, max_cpus = ?, "
                             "max_memory_mib = ?, max_layer_mib = ? WHERE name = ?",
                             *quota_args(quota), project)
            return quota

        out = await self.db.run(fn)
        self._quotas_changed(project)
        return out

    # ---- keys --------------------------------------------------------------------------
    async def create_key(self, who: Principal, project: str, admin: bool = False,
                         fmt: KeyFormat = "rollbox") -> tuple[str, KeyInfo]:
        """(See IamStore.) The operator's key may name a new top-level project: made."""
        check_lookup(project)
        if not who.administers(project):
            raise _forbidden(project)
        key, key_id, key_hash, display = new_key(fmt)
        now = time.time()
        scope = project if admin else None

        async def fn(tx: Tx) -> None:
            if not await tx.fetch("SELECT name FROM projects WHERE name = ?", project):
                if not (who.admin and parent_of(project) is None):
                    raise errors.NotFound(f"no project {project[:140]!r}",
                                          project=project[:140])
                # The operator's key for a new top-level project: made, unlimited.
                await tx.execute("INSERT INTO projects (name, parent, created_at) VALUES "
                                 "(?, NULL, ?)", check_name(project), now)
            await tx.execute("INSERT INTO api_keys (key_id, key_hash, display, project, admin, "
                             "created_at, scope) VALUES (?, ?, ?, ?, 0, ?, ?)",
                             key_id, key_hash, display, project, now, scope)

        await self.db.run(fn)
        return key, KeyInfo(key_id, display, project, admin, now, False, scope=scope)

    async def list_keys(self, who: Principal, project: str | None = None) -> list[KeyInfo]:
        if who.scope is None:
            raise errors.Forbidden("listing keys needs an admin key")
        if project is not None and not who.administers(project):
            raise _forbidden(project)

        async def fn(tx: Tx) -> list[KeyInfo]:
            rows = await tx.fetch(f"SELECT {KEY_COLS} FROM api_keys ORDER BY created_at")
            return [key_info(r) for r in rows if who.administers(str(r[2]))
                    and (project is None or r[2] == project)]

        return await self.db.run(fn)

    async def revoke_key(self, who: Principal, key_id: str) -> None:
        if who.scope is None:
            raise errors.Forbidden("revoking keys needs an admin key")

        async def fn(tx: Tx) -> None:
            rows = await tx.fetch("SELECT project FROM api_keys WHERE key_id = ? AND "
                                  "revoked_at IS NULL", key_id)
            if not rows or not who.administers(str(rows[0][0])):
                raise errors.NotFound(f"no active key {key_id[:80]!r}")
            await tx.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?",
                             time.time(), key_id)

        await self.db.run(fn)
        self._revoked()


def new_key(fmt: KeyFormat = "rollbox") -> tuple[str, str, bytes, str]:
    """(plaintext key, key id, sha256 of the key, display prefix). ``fmt`` "e2b": E2B's own
    form, ``e2b_`` + hex (what E2B's SDKs check keys against), 256 random bits like ours."""
    import hashlib

    prefix = E2B_KEY_PREFIX if fmt == "e2b" else KEY_PREFIX
    key = prefix + (secrets.token_hex(32) if fmt == "e2b" else secrets.token_urlsafe(32))
    return (key, "key_" + secrets.token_hex(8), hashlib.sha256(key.encode()).digest(),
            key[: len(prefix) + DISPLAY_CHARS] + "...")


def well_formed(key: str | None) -> bool:
    """Could ``key`` be one we issued (either form)? Checked before any lookup."""
    return bool(key) and len(key) <= 128 and key.startswith((KEY_PREFIX, E2B_KEY_PREFIX))


KEY_PREFIX = "rbx_"
E2B_KEY_PREFIX = "e2b_"
KeyFormat = Literal["rollbox", "e2b"]
DISPLAY_CHARS = 8  # of the random part; 48 bits shown, 208 bits stay secret


class SqlLedger:
    """The shared :class:`rollbox.iam.model.QuotaLedger` (a backend adds ``close``)."""

    db: Db
    reservation_ttl_s: float = RESERVATION_TTL_S

    async def reserve(self, project: str, need: Usage) -> Reservation:
        return (await self.reserve_many(project, need, 1))[0]

    async def reserve_many(self, project: str, need: Usage, n: int) -> list[Reservation]:
        now = time.time()
        entries = ["r_" + secrets.token_hex(10) for _ in range(n)]
        expires = now + self.reservation_ttl_s
        total = Usage(need.sandboxes * n, need.cpus * n, need.memory_mib * n)

        async def fn(tx: Tx) -> list[Reservation]:
            names = [*ancestors(project), project]
            chain = await _lock_chain(tx, names)
            limited = [p for p in names if p in chain
                       and any(getattr(chain[p], f) is not None for f in LIMITED)]
            if limited:
                # One read of what the topmost limited project's subtree holds, by project:
                # every link's sum and the project's own come from it.
                by = await _use_by_project(tx, limited[0], now)
                links = [ChainLink(name, chain[name], _total(u for p, u in by.items()
                                                             if in_subtree(p, name)))
                         for name in limited]
                mine = limited[-1] == project
                own = by.get(project, Usage()) if mine else Usage()
                carved = _sum(await _children(tx, project)) if mine else Usage()
                check_reserve(project, total, links, own, carved)
            for entry in entries:  # in the same transaction as the check: all or none
                await tx.execute("INSERT INTO ledger (entry_id, project, cpus, memory_mib, "
                                 "state, expires_at) VALUES (?, ?, ?, ?, 'reserved', ?)",
                                 entry, project, float(need.cpus), int(need.memory_mib),
                                 expires)
            return [Reservation(e, project, need, expires) for e in entries]

        if n < 1:
            raise errors.BadRequest(f"reserve_many needs n >= 1, got {n}", n=n)
        return await self.db.run(fn)

    async def renew(self, reservation: Reservation) -> None:
        expires = time.time() + self.reservation_ttl_s

        await self.db.execute("UPDATE ledger SET expires_at = ? WHERE entry_id = ? AND "
                              "state = 'reserved'", expires, reservation.id)

    async def commit(self, reservation: Reservation, sandbox_id: str, node: str) -> None:
        now = time.time()
        # The usual case in one statement: the reservation becomes the sandbox's charge, unless
        # something charged that sandbox already (then the transaction below sorts it out).
        if await self.db.execute(
                "UPDATE ledger SET state = 'committed', sandbox_id = ?, node = ?, committed_at "
                "= ? WHERE entry_id = ? AND state = 'reserved' AND NOT EXISTS (SELECT 1 FROM "
                "ledger WHERE sandbox_id = ?)", sandbox_id, node, now, reservation.id,
                sandbox_id):
            return

        async def fn(tx: Tx) -> None:
            if await tx.fetch("SELECT entry_id FROM ledger WHERE sandbox_id = ?", sandbox_id):
                # Charged already (reconcile saw it live first): the reservation is a double.
                await tx.execute("DELETE FROM ledger WHERE entry_id = ? AND state = "
                                 "'reserved'", reservation.id)
                return
            n = await tx.execute("UPDATE ledger SET state = 'committed', sandbox_id = ?, "
                                 "node = ?, committed_at = ? WHERE entry_id = ? AND state = "
                                 "'reserved'", sandbox_id, node, now, reservation.id)
            if n == 0:  # expired meanwhile: the sandbox exists, so it is charged anyway
                await self._charge(tx, LiveSandbox(sandbox_id, reservation.project,
                                                   reservation.need.cpus,
                                                   reservation.need.memory_mib), node, now)

        await self.db.run(fn)

    @staticmethod
    async def _charge(tx: Tx, s: LiveSandbox, node: str, now: float) -> None:
        await tx.execute("INSERT INTO ledger (entry_id, project, cpus, memory_mib, state, "
                         "sandbox_id, node, committed_at) VALUES (?, ?, ?, ?, 'committed', ?, "
                         "?, ?)", "c_" + secrets.token_hex(10), s.project, float(s.cpus),
                         int(s.memory_mib), s.id, node, now)

    async def cancel(self, reservation: Reservation) -> None:
        await self.db.execute("DELETE FROM ledger WHERE entry_id = ? AND state = 'reserved'",
                              reservation.id)

    async def release(self, sandbox_id: str) -> bool:
        now = time.time()
        # The usual case in one statement; the transaction below is for a sandbox the ledger
        # holds no charge of (it leaves a tombstone).
        if await self.db.execute(f"UPDATE ledger SET {RELEASED} WHERE sandbox_id = ? AND "
                                 "state = 'committed'", now, sandbox_id):
            return True

        async def fn(tx: Tx) -> bool:
            n = await tx.execute(f"UPDATE ledger SET {RELEASED} WHERE sandbox_id = ? AND "
                                 "state = 'committed'", now, sandbox_id)
            if n == 0 and not await tx.fetch("SELECT entry_id FROM ledger WHERE "
                                             "sandbox_id = ?", sandbox_id):
                # A tombstone, so a live set read before the delete does not charge it again.
                await tx.execute("INSERT INTO ledger (entry_id, project, cpus, memory_mib, "
                                 "state, sandbox_id, released_at) VALUES (?, '', 0, 0, "
                                 "'released', ?, ?)", "t_" + secrets.token_hex(10),
                                 sandbox_id, now)
            return n > 0

        return await self.db.run(fn)

    async def reconcile(self, live: Mapping[str, Collection[LiveSandbox | NodeSandbox]],
                        complete_nodes: Collection[str]) -> int:
        now = time.time()
        complete = sorted(set(complete_nodes))
        sets = {node: charged(sandboxes) for node, sandboxes in live.items()}

        async def fn(tx: Tx) -> int:
            changed = await tx.execute("DELETE FROM ledger WHERE state = 'reserved' AND "
                                       "expires_at <= ?", now)
            await tx.execute("DELETE FROM ledger WHERE state = 'released' AND released_at < ?",
                             now - TOMBSTONE_S)
            if complete:
                rows = await tx.fetch(
                    "SELECT entry_id, sandbox_id, node, committed_at FROM ledger WHERE state = "
                    f"'committed' AND node IN ({_placeholders(len(complete))})", *complete)
                ids = {n: {s.id for s in sets.get(n, ())} for n in complete}
                for entry, sid, node, at in rows:
                    if sid not in ids[str(node)] and float(at) < now - RECONCILE_GRACE_S:  # type: ignore[arg-type]
                        changed += await tx.execute(
                            f"UPDATE ledger SET {RELEASED} WHERE entry_id = ?", now, entry)
            known = {str(r[0]) for r in await tx.fetch(
                "SELECT sandbox_id FROM ledger WHERE sandbox_id IS NOT NULL")}
            for node, sandboxes in sets.items():
                for s in sandboxes:
                    if s.id not in known:
                        await self._charge(tx, s, node, now)
                        known.add(s.id)
                        changed += 1
            return changed

        return await self.db.run(fn)

    async def usage(self, project: str, subtree: bool = True) -> Usage:
        now = time.time()

        async def fn(tx: Tx) -> Usage:
            return await _use(tx, project, subtree, now)

        return await self.db.run(fn)
