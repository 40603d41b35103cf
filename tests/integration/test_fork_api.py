"""Fork through the HTTP API, the async and sync SDK and the CLI, with the quota ledger on:
``POST /v1/sandboxes/{id}/fork {n}`` -> n sandboxes; all n reserved in the project's quota at
once (one too many: none made, the ledger as before); typed refusals for another project's or
a deleted sandbox, n < 1, n above the API's bound; children on the source's node, deleted
through the api like any sandbox (their ledger entries go)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore, SQLiteLedger
from rollbox.models import MAX_FORK_CHILDREN
from rollbox.watcher import placement_over

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


async def test_fork_over_the_api_sdk_and_cli(edge, tmp_path: Path) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from rollbox.cli import app as cli_app

    keys = KeyStore(tmp_path / "keys.db")
    ledger = SQLiteLedger(tmp_path / "keys.db")
    edge.quotas = keys
    app = create_app(placement_over([edge]), keys, ledger=ledger)
    admin, team, other = keys.create("ops", admin=True), keys.create("team"), keys.create("other")
    async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, admin) as a, \
            rollbox.AsyncClient(srv.url, team) as t, rollbox.AsyncClient(srv.url, other) as o:
        await a.set_project_quota("team", sandboxes=4)
        src = await t.create(BB, labels={"task": "x"}, memory_mib=64)
        try:
            await src.exec("echo state > /s")
            kids = await src.fork(2, labels={"g": "1"})
            assert [k.info.labels for k in kids] == [{"task": "x", "g": "1", "fork_of": src.id}] * 2
            assert all(k.info.node == src.info.node for k in kids)
            assert src.last_fork is not None and src.last_fork.frozen_s > 0
            for k in kids:
                assert (await k.exec("cat /s")).stdout == "state\n"
            # 3 live of 4: a fork of 2 is refused whole, the ledger unchanged.
            with pytest.raises(errors.QuotaExceeded):
                await src.fork(2)
            assert len(await t.list()) == 3
            one = await src.fork(1, idempotency_key="retry-1")
            assert len(await t.list()) == 4
            assert (await ledger.usage("team")).sandboxes == 4
            # The same key again (a retry whose first answer was lost), with the project at
            # its quota: the same child, no second one, the ledger still at 4.
            again = await src.fork(1, idempotency_key="retry-1")
            assert [k.id for k in again] == [one[0].id]
            assert len(await t.list()) == 4 and (await ledger.usage("team")).sandboxes == 4
            with pytest.raises(errors.IdempotencyConflict):
                await src.fork(1, labels={"other": "1"}, idempotency_key="retry-1")
            await one[0].delete()
            assert (await ledger.usage("team")).sandboxes == 3
            for bad in (0, -1, MAX_FORK_CHILDREN + 1):
                with pytest.raises(errors.BadRequest):
                    await src.fork(bad)
                with pytest.raises(errors.BadRequest):  # the raw API's answer too
                    await t._t.request("POST", f"/v1/sandboxes/{src.id}/fork", json={"n": bad})
            with pytest.raises(errors.NotFound):  # another project's sandbox looks absent
                await o.get(src.id)
            with pytest.raises(errors.NotFound):
                await o._t.request("POST", f"/v1/sandboxes/{src.id}/fork", json={"n": 1})
            assert len(await t.list()) == 3
            # The sync SDK and the CLI.
            await asyncio.to_thread(_sync_fork, srv.url, team, src.id)
            runner = CliRunner()
            res = await asyncio.to_thread(runner.invoke, cli_app, [
                "sandbox", "--url", srv.url, "--api-key", team, "fork", src.id, "1",
                "-l", "via=cli"])
            assert res.exit_code == 0, res.output
            cli_kid = res.output.strip()
            assert (await t.get(cli_kid)).info.labels["via"] == "cli"
            await (await t.get(cli_kid)).delete()
            for k in kids:
                await k.delete()
            # A deleted source: typed, nothing made.
            await src.delete()
            with pytest.raises(errors.SandboxDead):
                await src.fork(1)
            assert await t.list() == []
        finally:
            for sb in await a.list():
                await sb.delete()


def _sync_fork(url: str, key: str, sid: str) -> None:
    with rollbox.Client(url, key) as c:
        kids = c.get(sid).fork(1)
        assert len(kids) == 1 and kids[0].exec("cat /s").stdout == "state\n"
        assert kids[0].info.labels["fork_of"] == sid
        kids[0].delete()


async def test_fork_over_a_remote_edge(edge) -> None:  # noqa: ANN001
    """Cluster mode: the api reaches the source's edge over HTTP (edge.service/remote): the
    children come back typed, on that node; refusals keep their type across the wire."""
    from rollbox.models import ForkSpec, SandboxSpec
    from tests.conftest import served_edge

    src = await edge.create(SandboxSpec(image=BB), "proj")
    try:
        async with served_edge(edge) as remote:
            res = await remote.fork(src.id, ForkSpec(n=2), "proj")
            assert [c.node for c in res.children] == [edge.node_id] * 2
            assert all(c.labels["fork_of"] == src.id for c in res.children)
            with pytest.raises(errors.BadRequest):
                await remote.fork(src.id, ForkSpec.model_construct(n=0, labels={}), "proj")
            with pytest.raises(errors.NotFound):
                await remote.fork(f"{edge.node_id}-0123456789ab", ForkSpec(n=1), "proj")
        for c in res.children:
            await edge.delete(c.id)
    finally:
        await edge.delete(src.id)
