"""The IAM stores and the quota ledger, each test against both backends (SQLite and a real
PostgreSQL server: ``iam_stores``): nested projects, the delegation rule at its edges, who may
administer what, the ledger's reserve/commit/release/reconcile, and racing reserves."""
from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.iam import LiveSandbox, Principal, SQLiteIam, SQLiteLedger, Usage
from rollbox.iam import sql as iam_sql
from rollbox.models import Quota

OPERATOR = Principal(project="admin", admin=True, key_id="op", scope="")
ONE = Usage(1, 1.0, 512)


async def _tree(iam) -> tuple[Principal, Principal]:  # noqa: ANN001
    """a (10 sandboxes, 10 cpus, 10240 MiB) with a/b (6, 6, 6144) and a/c (4, 4, 4096);
    returns the principals of admin keys of a and a/b."""
    await iam.create_project(OPERATOR, "a", Quota(sandboxes=10, cpus=10, memory_mib=10240))
    key_a, _ = await iam.create_key(OPERATOR, "a", admin=True)
    admin_a = await iam.authenticate(key_a)
    await iam.create_project(admin_a, "a/b", Quota(sandboxes=6, cpus=6, memory_mib=6144))
    await iam.create_project(admin_a, "a/c", Quota(sandboxes=4, cpus=4, memory_mib=4096))
    key_b, _ = await iam.create_key(admin_a, "a/b", admin=True)
    return admin_a, await iam.authenticate(key_b)


async def _names(iam) -> list[str]:  # noqa: ANN001
    return sorted(p.name for p in await iam.projects(OPERATOR))


async def test_delegation_never_gives_more_than_the_parent_holds(iam_stores) -> None:  # noqa: ANN001
    iam, ledger = iam_stores
    admin_a, admin_b = await _tree(iam)
    assert admin_a.scope == "a" and not admin_a.admin and admin_b.scope == "a/b"
    before = await _names(iam)
    assert before == ["a", "a/b", "a/c"]
    # a has given all of its 10 away: a fourth child can have nothing of a limited field.
    with pytest.raises(errors.BadRequest) as exc:
        await iam.create_project(admin_a, "a/d", Quota(sandboxes=1, cpus=0, memory_mib=0))
    assert exc.value.details["field"] == "sandboxes"
    d = await iam.create_project(admin_a, "a/d")  # no quota: 0 of what a limits
    assert d.quota == Quota(sandboxes=0, cpus=0, memory_mib=0)
    with pytest.raises(errors.BadRequest):  # a limit on every field a limits
        await iam.create_project(admin_a, "a/e", Quota(sandboxes=0))
    # b carves 6 for its own children: exactly 6 fits, 6.5 cpus does not.
    await iam.create_project(admin_b, "a/b/x", Quota(sandboxes=6, cpus=6, memory_mib=6144))
    with pytest.raises(errors.BadRequest):
        await iam.create_project(admin_b, "a/b/y", Quota(sandboxes=0, cpus=0.5, memory_mib=0))
    # Lowering a limit below what is delegated: refused; raising a child above the parent's
    # room: refused; at the edge: accepted.
    with pytest.raises(errors.BadRequest) as exc:
        await iam.set_quota(admin_a, "a/b", Quota(sandboxes=5, cpus=6, memory_mib=6144))
    assert exc.value.details["field"] == "sandboxes"
    with pytest.raises(errors.BadRequest):
        await iam.set_quota(admin_a, "a/c", Quota(sandboxes=5, cpus=4, memory_mib=4096))
    await iam.set_quota(admin_a, "a/c", Quota(sandboxes=3, cpus=4, memory_mib=4096))
    await iam.set_quota(admin_a, "a/c", Quota(sandboxes=4, cpus=4, memory_mib=4096))
    # The parent's own use counts: a sandbox of a itself leaves a/c less room.
    await iam.set_quota(admin_a, "a/c", Quota(sandboxes=3, cpus=3, memory_mib=3072))
    r = await ledger.reserve("a", ONE)
    with pytest.raises(errors.BadRequest):
        await iam.set_quota(admin_a, "a/c", Quota(sandboxes=4, cpus=3, memory_mib=3072))
    await ledger.cancel(r)
    await iam.set_quota(admin_a, "a/c", Quota(sandboxes=4, cpus=4, memory_mib=4096))
    # Bad input: typed, nothing written.
    for name, quota, error in (
            ("a/b/x/deep", Quota(sandboxes=7, cpus=0, memory_mib=0), errors.BadRequest),
            ("a/nope/x", None, errors.NotFound), ("a/ b", None, errors.BadRequest),
            ("a//b", None, errors.BadRequest), ("a/b/", None, errors.BadRequest),
            ("a/" + "x" * 200, None, errors.BadRequest), ("a/b", None, errors.BadRequest),
            ("z", None, errors.Forbidden), ("b/x", None, errors.Forbidden)):
        with pytest.raises(error):
            await iam.create_project(admin_b if name.startswith("a/b/") else admin_a, name,
                                     quota)
    with pytest.raises(errors.BadRequest):
        await iam.set_quota(admin_a, "a/c", Quota.model_construct(sandboxes=-1, cpus=1,
                                                                  memory_mib=1))
    assert await _names(iam) == ["a", "a/b", "a/b/x", "a/c", "a/d"]
    assert (await iam.get_quota(OPERATOR, "a/c")).sandboxes == 4


async def test_a_sub_project_key_never_sees_or_administers_above_or_beside(iam_stores) -> None:  # noqa: ANN001
    iam, _ = iam_stores
    admin_a, admin_b = await _tree(iam)
    await iam.create_project(admin_b, "a/b/x", Quota(sandboxes=1, cpus=1, memory_mib=1))
    plain_key, info = await iam.create_key(admin_b, "a/b/x")
    plain = await iam.authenticate(plain_key)
    assert (plain.project, plain.scope, plain.admin, info.admin) == ("a/b/x", None, False, False)
    assert [p.name for p in await iam.projects(admin_b)] == ["a/b", "a/b/x"]
    assert [p.name for p in await iam.projects(plain)] == ["a/b/x"]
    assert [p.name for p in await iam.projects(admin_a)] == ["a", "a/b", "a/b/x", "a/c"]
    for project in ("a", "a/c", "a/cc", "zzz"):
        with pytest.raises(errors.Forbidden) as exc:
            await iam.get_quota(admin_b, project)
        assert "a/b" not in str(exc.value) or project.startswith("a/b")
        with pytest.raises(errors.Forbidden):
            await iam.create_key(admin_b, project)
        with pytest.raises(errors.Forbidden):
            await iam.set_quota(admin_b, project, Quota())
    with pytest.raises(errors.Forbidden):  # its own limits are its parent's to set
        await iam.set_quota(admin_b, "a/b", Quota(sandboxes=6, cpus=6, memory_mib=6144))
    with pytest.raises(errors.Forbidden):
        await iam.create_key(plain, "a/b/x")  # a plain key administers nothing
    with pytest.raises(errors.Forbidden):
        await iam.list_keys(plain)
    assert await iam.get_quota(plain, "a/b/x") == Quota(sandboxes=1, cpus=1, memory_mib=1)
    keys_b = await iam.list_keys(admin_b)
    assert {k.project for k in keys_b} == {"a/b", "a/b/x"}
    a_keys = [k for k in await iam.list_keys(admin_a) if k.project == "a"]
    with pytest.raises(errors.NotFound):  # a key above looks absent
        await iam.revoke_key(admin_b, a_keys[0].key_id)
    await iam.revoke_key(admin_b, info.key_id)
    await asyncio.sleep(0.1)  # PostgreSQL: the NOTIFY reaches the listener
    with pytest.raises(errors.Unauthorized):
        await iam.authenticate(plain_key)
    with pytest.raises(errors.Unauthorized):
        await iam.key_active(info.key_id)


async def test_reserve_checks_the_project_and_every_ancestor(iam_stores) -> None:  # noqa: ANN001
    iam, ledger = iam_stores
    admin_a, admin_b = await _tree(iam)
    await iam.create_project(admin_b, "a/b/x", Quota(sandboxes=2, cpus=1.5, memory_mib=2048))
    held = [await ledger.reserve("a/b/x", Usage(1, 0.75, 512)) for _ in range(2)]
    with pytest.raises(errors.QuotaExceeded) as exc:
        await ledger.reserve("a/b/x", Usage(1, 0.01, 1))
    assert exc.value.details == {"project": "a/b/x", "field": "sandboxes", "limit": 2}
    # b itself: 6 - 2 carved for x = 4 of its own.
    for _ in range(4):
        held.append(await ledger.reserve("a/b", Usage(1, 1, 1024)))
    with pytest.raises(errors.QuotaExceeded) as exc:
        await ledger.reserve("a/b", Usage(1, 0.1, 1))
    assert exc.value.details["project"] == "a/b" and "'a'" not in str(exc.value)
    # a holds nothing of its own: everything is delegated.
    with pytest.raises(errors.QuotaExceeded) as exc:
        await ledger.reserve("a", Usage(1, 0.1, 1))
    assert exc.value.details["project"] == "a"
    # Names that share a's prefix but are not below it are not a's (".", "0", "-" sort next
    # to "/").
    for other in ("a.z", "a0", "a-z", "ab"):
        await iam.create_project(OPERATOR, other)
        held.append(await ledger.reserve(other, Usage(1, 1, 1)))
    assert await ledger.usage("a") == Usage(6, 5.5, 5120)
    assert await ledger.usage("a/b", subtree=False) == Usage(4, 4.0, 4096)
    infos = {p.name: p for p in await iam.projects(admin_a)}
    assert infos["a"].used == Usage(6, 5.5, 5120) and infos["a"].delegated.sandboxes == 10
    assert infos["a/b"].own_used.sandboxes == 4
    for r in held:
        await ledger.cancel(r)
    assert await ledger.usage("a") == Usage()


async def test_an_ancestor_limit_binds_even_an_unlimited_descendant(tmp_path: Path) -> None:
    """Migrated data may hold an unlimited child under a limited parent (the host's own key
    making made it so): the ancestor's subtree check still binds, naming only the caller."""
    iam = SQLiteIam(tmp_path / "keys.db")
    ledger = SQLiteLedger(tmp_path / "keys.db")
    try:
        await iam.create_project(OPERATOR, "t", Quota(sandboxes=1))
        iam.create("t/free")  # the host's path: made unlimited
        r = await ledger.reserve("t/free", ONE)
        with pytest.raises(errors.QuotaExceeded) as exc:
            await ledger.reserve("t/free", ONE)
        assert exc.value.details == {"project": "t/free", "field": "sandboxes"}
        assert "'t'" not in str(exc.value)
        await ledger.commit(r, "n1-00000001", "n1")
        assert await ledger.release("n1-00000001")
        await ledger.reserve("t/free", ONE)
    finally:
        ledger.close()
        iam.close()


async def test_commit_release_expiry_and_reconcile(iam_stores, monkeypatch) -> None:  # noqa: ANN001
    iam, ledger = iam_stores
    monkeypatch.setattr(iam_sql, "RECONCILE_GRACE_S", 0.0)
    await iam.create_project(OPERATOR, "p", Quota(sandboxes=3, cpus=3, memory_mib=3000))
    ledger.reservation_ttl_s = 0.5
    r1, r2, r3 = [await ledger.reserve("p", ONE) for _ in range(3)]
    await ledger.commit(r1, "n1-000000a1", "n1")
    await ledger.commit(r2, "n1-000000a2", "n1")
    await asyncio.sleep(0.3)
    await ledger.renew(r3)
    await asyncio.sleep(0.3)
    assert (await ledger.usage("p")).sandboxes == 3  # renewed: still held
    await asyncio.sleep(0.6)
    assert (await ledger.usage("p")).sandboxes == 2  # expired: not counted ...
    # ... and dropped by reconcile, which also releases a2 (gone from complete node n1) and
    # charges a live sandbox the ledger lacks (on n2, not complete: its others stay).
    live = {"n1": [LiveSandbox("n1-000000a1", "p", 1.0, 512)],
            "n2": [LiveSandbox("n2-000000b1", "p", 0.5, 256)]}
    assert await ledger.reconcile(live, ["n1"]) == 3
    assert await ledger.usage("p") == Usage(2, 1.5, 768)
    assert await ledger.reconcile(live, ["n1"]) == 0  # a fixed point
    # A live set read before a delete does not charge the deleted sandbox again.
    assert await ledger.release("n1-000000a1")
    assert not await ledger.release("n1-000000a1")
    assert await ledger.reconcile(live, ["n1", "n2"]) == 0
    assert await ledger.usage("p") == Usage(1, 0.5, 256)
    # A reservation committed after it expired is charged anyway (the sandbox exists).
    r4 = await ledger.reserve("p", ONE)
    await asyncio.sleep(0.6)
    await ledger.reconcile({}, [])
    await ledger.commit(r4, "n2-000000b2", "n2")
    assert (await ledger.usage("p")).sandboxes == 2
    # Reconcile saw it live before the commit: the commit does not double it.
    r5 = await ledger.reserve("p", ONE)
    await ledger.reconcile({"n2": [LiveSandbox("n2-000000b3", "p", 1.0, 512)]}, [])
    await ledger.commit(r5, "n2-000000b3", "n2")
    assert (await ledger.usage("p")).sandboxes == 3
    assert await ledger.reconcile({"n1": [], "n2": []}, ["n1", "n2"]) == 3
    assert await ledger.usage("p") == Usage()
    # The watcher's live sets: its node reports' NodeSandbox; the platform's are not charged.
    from rollbox.models import NodeSandbox

    def report(sid: str, platform: bool) -> NodeSandbox:
        return NodeSandbox(id=sid, owner="p", backend="container", state="running", cpus=0.5,
                           memory_mib=128, created_at=0, expires_at=0, image="x",
                           platform=platform)

    assert await ledger.reconcile({"n3": [report("n3-000000d1", False),
                                          report("n3-000000d2", True)]},
                                  ["n3"]) == 1
    assert await ledger.usage("p") == Usage(1, 0.5, 128)


async def test_racing_reserves_never_exceed_the_quota(iam_stores) -> None:  # noqa: ANN001
    iam, ledger = iam_stores
    admin_a, _ = await _tree(iam)
    await iam.set_quota(admin_a, "a/c", Quota(sandboxes=4, cpus=4, memory_mib=4096))

    async def one(project: str) -> bool:
        try:
            await ledger.reserve(project, Usage(1, 0.5, 256))
            return True
        except errors.QuotaExceeded:
            return False

    got = await asyncio.gather(*(one("a/b" if i % 2 else "a/c") for i in range(40)))
    assert sum(got) == 10
    assert (await ledger.usage("a")).sandboxes == 10


def test_flat_data_is_carried_forward(tmp_path: Path) -> None:
    """A keys.db and quotas.db of the flat IAM: keys keep working (the admin key stays the
    operator's), t/x gets the parent t, old quotas become limits."""
    db = sqlite3.connect(tmp_path / "keys.db")
    db.executescript("""
        CREATE TABLE projects (name TEXT PRIMARY KEY, parent TEXT REFERENCES projects(name),
            max_sandboxes INTEGER, max_cpus REAL, max_memory_mib INTEGER,
            created_at REAL NOT NULL);
        CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash BLOB NOT NULL UNIQUE,
            display TEXT NOT NULL, project TEXT NOT NULL REFERENCES projects(name),
            admin INTEGER NOT NULL, created_at REAL NOT NULL, revoked_at REAL,
            last_used_at REAL);
    """)
    db.close()
    import hashlib

    now = time.time()
    db = sqlite3.connect(tmp_path / "keys.db")
    keys = {}
    for i, (project, admin) in enumerate((("admin", 1), ("t/x", 0), ("u", 0))):
        key = "rbx_" + f"{i}" * 43
        keys[project] = key
        db.execute("INSERT OR IGNORE INTO projects (name, created_at) VALUES (?, ?)",
                   (project, now))
        db.execute("INSERT INTO api_keys VALUES (?,?,?,?,?,?,NULL,NULL)",
                   (f"key_{i}", hashlib.sha256(key.encode()).digest(), key[:12] + "...",
                    project, admin, now))
    db.commit()
    db.close()
    q = sqlite3.connect(tmp_path / "quotas.db")
    q.executescript("CREATE TABLE quotas (project TEXT PRIMARY KEY, sandboxes INTEGER, cpus "
                    "REAL, memory_mib INTEGER, layer_mib INTEGER, updated_at REAL NOT NULL);"
                    f"INSERT INTO quotas VALUES ('u', 3, 2.5, NULL, 100, {now});"
                    f"INSERT INTO quotas VALUES ('gone', 1, 1, 1, 1, {now});")
    q.close()
    for _ in range(2):  # a second open imports nothing again
        iam = SQLiteIam(tmp_path / "keys.db", legacy_quotas=tmp_path / "quotas.db")
        try:
            op = iam.verify(keys["admin"])
            assert op.admin and op.scope == ""
            tx = iam.verify(keys["t/x"])
            assert (tx.project, tx.admin, tx.scope) == ("t/x", False, None)
            assert iam.get("u") == Quota(sandboxes=3, cpus=2.5, layer_mib=100)
            names = {p.name: p.parent for p in asyncio.run(iam.projects(op))}
            assert names == {"admin": None, "t": None, "t/x": "t", "u": None}
        finally:
            iam.close()


async def test_a_postgresql_restart_is_retryable_and_leaves_no_drift(postgres, pg_dsn) -> None:  # noqa: ANN001
    """While the server is down every call is InfraError (retryable, never a quota answer);
    once it is back the same pools work and what was held is still held."""
    from rollbox.iam.postgres import PostgresIam, PostgresLedger

    iam = await PostgresIam.open(pg_dsn)
    ledger = await PostgresLedger.open(pg_dsn)
    try:
        await iam.create_project(OPERATOR, "p", Quota(sandboxes=2))
        r = await ledger.reserve("p", ONE)
        await ledger.commit(r, "n1-0000000c1", "n1")
        postgres.stop()
        try:
            for call in (ledger.reserve("p", ONE), ledger.release("n1-0000000c1"),
                         iam.get_quota(OPERATOR, "p")):
                with pytest.raises(errors.InfraError) as exc:
                    await call
                assert exc.value.retryable
        finally:
            postgres.start()
        for _ in range(50):  # the pools' broken connections are replaced on next use
            try:
                await ledger.usage("p")
                break
            except errors.InfraError:
                await asyncio.sleep(0.1)
        assert (await ledger.usage("p")).sandboxes == 1
        await ledger.reserve("p", ONE)
        with pytest.raises(errors.QuotaExceeded):
            await ledger.reserve("p", ONE)
    finally:
        await ledger.close()
        await iam.close()


async def test_a_revoke_through_one_replica_is_refused_by_the_other_at_once(pg_dsn) -> None:  # noqa: ANN001
    """Each PostgreSQL replica caches verified keys; a revoke anywhere is NOTIFYed to all."""
    from rollbox.iam.postgres import open_postgres

    (one, l1), (two, l2) = await open_postgres(pg_dsn), await open_postgres(pg_dsn)
    try:
        await one.create_project(OPERATOR, "p")
        key, info = await one.create_key(OPERATOR, "p")
        assert (await two.authenticate(key)).project == "p"  # cached by the other replica
        await one.revoke_key(OPERATOR, info.key_id)
        for _ in range(50):
            try:
                await two.authenticate(key)
            except errors.Unauthorized:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the other replica still took a revoked key after 0.5 s")
    finally:
        for store in (l1, l2, one, two):
            await store.close()


async def test_a_create_and_delete_cost_the_ledger_six_postgresql_round_trips(pg_dsn) -> None:  # noqa: ANN001
    """What a sandbox's create and delete send to PostgreSQL (every replica, every create):
    reserve is one transaction (BEGIN, the chain's row locks, the insert, COMMIT), commit and
    release one statement each, and no session reset after any of them (asyncpg's default
    sends one on every release of a pooled connection: 14 round trips before)."""
    from rollbox.iam.postgres import PostgresLedger

    ledger = await PostgresLedger.open(pg_dsn, max_size=1)
    try:
        sent: list[str] = []
        async with ledger.pool.acquire() as conn:  # the pool's one connection, logged
            conn.add_query_logger(lambda q: sent.append(q.query.split()[0].upper()))
        res = await ledger.reserve("rt", ONE)
        await ledger.commit(res, "n1-000000e1", "n1")
        assert await ledger.release("n1-000000e1")
        assert sent == ["BEGIN;", "SELECT", "INSERT", "COMMIT;", "UPDATE", "UPDATE"], sent
        assert await ledger.usage("rt") == Usage()
    finally:
        await ledger.close()


async def test_reserve_many_holds_all_n_or_none_and_racing_forks_never_exceed(iam_stores) -> None:  # noqa: ANN001
    """A fork's n reservations: checked together and written in one transaction (n times
    the need must fit, else QuotaExceeded and nothing held); two forks racing for the last
    room never both get it, and the sandbox count is bounded as well as cpus and memory."""
    iam, ledger = iam_stores
    admin_a, _ = await _tree(iam)  # a/c: 4 sandboxes, 4 cpus, 4096 MiB
    with pytest.raises(errors.QuotaExceeded):
        await ledger.reserve_many("a/c", Usage(1, 0.25, 128), 5)  # 5 sandboxes > 4
    with pytest.raises(errors.QuotaExceeded):
        await ledger.reserve_many("a/c", Usage(1, 1.5, 128), 3)  # 4.5 cpus > 4
    assert (await ledger.usage("a/c")).sandboxes == 0  # nothing held by the refusals
    held = await ledger.reserve_many("a/c", Usage(1, 1.0, 1024), 3)
    assert len({r.id for r in held}) == 3
    assert await ledger.usage("a/c") == Usage(3, 3.0, 3072)
    with pytest.raises(errors.QuotaExceeded):  # 3 held + 2 > 4: none of the 2
        await ledger.reserve_many("a/c", Usage(1, 0.5, 256), 2)
    assert (await ledger.usage("a/c")).sandboxes == 3
    for r in held:
        await ledger.cancel(r)
    with pytest.raises(errors.BadRequest):
        await ledger.reserve_many("a/c", ONE, 0)

    async def fork(n: int) -> int:
        try:
            return len(await ledger.reserve_many("a/c", Usage(1, 0.5, 256), n))
        except errors.QuotaExceeded:
            return 0

    # a/c holds 4: of forks of 3 racing, one gets room (3), a second can not (3 + 3 > 4)
    got = await asyncio.gather(*(fork(3) for _ in range(6)))
    assert sorted(got) == [0, 0, 0, 0, 0, 3]
    assert (await ledger.usage("a/c")).sandboxes == 3
    assert (await ledger.usage("a")).sandboxes == 3
