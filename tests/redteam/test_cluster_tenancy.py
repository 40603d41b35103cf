"""Red-team class 46: quota bypass by racing creates across API replicas, and cross-tenant reads
through lists and errors. Two api replicas (two create_app instances, each served by its own
uvicorn, each with its own pools to one real PostgreSQL) in front of one real edge."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import Principal
from rollbox.iam.postgres import PostgresIam, PostgresLedger
from rollbox.models import Quota
from rollbox.watcher import placement_over

BB = "busybox:test"


@contextlib.asynccontextmanager
async def replicas(edge, dsn: str, n: int = 2) -> AsyncIterator[list[tuple[str, PostgresIam]]]:  # noqa: ANN001
    """``n`` api replicas over ``edge`` sharing the database at ``dsn``: (url, its IAM)."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            iam = await PostgresIam.open(dsn)
            stack.push_async_callback(iam.close)
            ledger = await PostgresLedger.open(dsn)
            stack.push_async_callback(ledger.close)
            app = create_app(placement_over([edge]), iam, ledger=ledger)
            srv = BackgroundServer(app)
            await srv.start()
            stack.push_async_callback(srv.stop)
            out.append((srv.url, iam))
        yield out


async def test_racing_creates_across_two_replicas_never_exceed_a_quota(edge, pg_dsn) -> None:  # noqa: ANN001
    edge.quotas = None  # the node's own per-node check is off: the ledger alone enforces
    async with replicas(edge, pg_dsn) as reps:
        (url0, iam0), (url1, _) = reps
        op_key = await iam0.create_operator_key()
        async with rollbox.AsyncClient(url0, op_key) as op:
            await op.create_project("team", sandboxes=5, cpus=5, memory_mib=5 * 128)
            await op.create_project("rival")
            team_key = (await op.create_key("team")).key
            rival_key = (await op.create_key("rival")).key
        async with rollbox.AsyncClient(url0, team_key) as t0, \
                rollbox.AsyncClient(url1, team_key) as t1, \
                rollbox.AsyncClient(url1, rival_key) as rival:
            secret = await rival.create(BB, memory_mib=64, labels={"task": "rival-secret-42"})

            async def one(i: int) -> object:
                client = t0 if i % 2 else t1
                try:
                    return await client.create(BB, cpus=0.1, memory_mib=64,
                                               labels={"i": str(i)})
                except errors.QuotaExceeded as exc:
                    return exc

            results = await asyncio.gather(*(one(i) for i in range(40)))
            made = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, errors.QuotaExceeded)]
            assert len(made) == 5 and len(refused) == 35, results
            assert len([s for s in edge.live.values() if s.info.owner == "team"]) == 5
            ledger = PostgresLedger(iam0.pool)
            assert (await ledger.usage("team")).sandboxes == 5
            # Nothing of the rival in what team sees: errors, lists, projects.
            seen = " ".join([str(e) for e in refused] + [
                repr(await c.list()) for c in (t0, t1)] + [
                repr(await t0.projects()), repr(await t1.projects())])
            for leak in (secret.id, "rival-secret-42", "rival"):
                assert leak not in seen, leak
            assert {s.id for s in await t1.list()} == {s.id for s in made}
            for c in (t0, t1):
                try:
                    await c.get(secret.id)
                except errors.NotFound as exc:
                    assert "rival" not in str(exc) and "secret" not in str(exc)
                else:
                    raise AssertionError("another project's sandbox was visible")
            # Deletes through either replica give the room back: the ledger returns to zero.
            for i, s in enumerate(made):
                await (await (t0 if i % 2 else t1).get(s.id)).delete()
            assert (await ledger.usage("team")).sandboxes == 0
            assert (await ledger.usage("rival")).sandboxes == 1
            await secret.delete()
            assert (await ledger.usage("rival")).sandboxes == 0
            sb = await t0.create(BB, cpus=0.1, memory_mib=64)
            await sb.delete()
            assert (await ledger.usage("team")).sandboxes == 0
            assert await iam0.get_quota(Principal("admin", True, "op", ""), "team") == Quota(
                sandboxes=5, cpus=5, memory_mib=640)
