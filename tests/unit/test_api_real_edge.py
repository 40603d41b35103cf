"""End to end: SDK -> api (real uvicorn) -> the real Edge with runc sandboxes (root only); the
same calls with the api app in-process (ASGITransport) over the same real edge."""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi import FastAPI

import rollbox
from rollbox.api import BackgroundServer
from rollbox.iam import KeyStore
from rollbox.sdk import ASGITransport
from tests.conftest import BOTH_TRANSPORTS, api_app

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


@contextlib.asynccontextmanager
async def sdk_client(app: FastAPI, key: str, transport: str) -> AsyncIterator[rollbox.AsyncClient]:
    if transport == "asgi":
        async with rollbox.AsyncClient(api_key=key, transport=ASGITransport(app)) as c:
            yield c
        return
    async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
        yield c


@BOTH_TRANSPORTS
@pytest.mark.parametrize("transport", ["http", "asgi"])
async def test_sdk_over_api_over_real_edge(edge, api_edge, tmp_path: Path,  # noqa: ANN001
                                           transport: str) -> None:
    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys)
    key = keys.create("proj")
    try:
        async with sdk_client(app, key, transport) as c:
            async with await c.create(BB, labels={"e2e": "1"}) as sb:
                assert sb.id.startswith(edge.node_id + "-")
                got: list[str] = []
                res = await sb.exec("echo hi; echo err >&2; exit 4", on_stdout=got.append)
                assert res.exit_code == 4 and "".join(got) == "hi\n" and res.stderr == "err\n"
                res = await sb.exec("sleep 5", timeout=0.5)
                assert res.timed_out
                await sb.files.write("/tmp/f.txt", "data")
                assert (await sb.exec("cat /tmp/f.txt")).stdout == "data"
                proc = await sb.exec_background("cat", stdin=True)
                await proc.write_stdin(b"abc")
                await proc.close_stdin()
                assert (await proc.wait()).stdout == "abc"
                assert [s.id for s in await c.list({"e2e": "1"})] == [sb.id]
            evs = await sb.events()
            kinds = [e.kind for e in evs]
            assert kinds[0] == "sandbox.created" and kinds[-1] == "sandbox.deleted"
            assert kinds.count("sandbox.created") == 1  # the edge records; the api does not
            assert any(e.kind == "exec.stdout" and e.data == "hi\n" for e in evs)
    finally:
        keys.close()


async def test_api_over_remote_edge_shows_each_event_once(edge, tmp_path: Path) -> None:  # noqa: ANN001
    """The cluster's path: the api (with an event log of its own, as a replica has) over a
    RemoteEdge. The trail is the edge's, each event once, and names the right owner; the api
    writes nothing into its own log; another project sees nothing, also after the delete."""
    from rollbox.api import create_app
    from rollbox.events.store import EventLog
    from rollbox.watcher import placement_over
    from tests.conftest import served_edge

    keys = KeyStore(tmp_path / "keys.db")
    own_log = EventLog(tmp_path / "api-events.db")
    key, other_key = keys.create("proj"), keys.create("other")
    key_id = keys.verify(key).key_id
    try:
        async with served_edge(edge) as remote:
            app = create_app(placement_over([remote]), keys)
            async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c, \
                    rollbox.AsyncClient(srv.url, other_key) as o:
                sb = await c.create(BB)
                res = await sb.exec("echo once")
                assert res.stdout == "once\n"
                await sb.pause()
                await sb.resume()
                await sb.set_ttl(600)
                await sb.delete()
                evs = await sb.events()
                with pytest.raises(rollbox.NotFound):
                    await type(sb)(o, sb.info).events()  # the same id, their key
        kinds = [e.kind for e in evs]
        assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
        for kind in ("sandbox.created", "exec.started", "exec.exited", "sandbox.paused",
                     "sandbox.resumed", "sandbox.ttl", "sandbox.deleted"):
            assert kinds.count(kind) == 1, (kind, kinds)
        assert kinds[0] == "sandbox.created" and kinds[-1] == "sandbox.deleted"
        assert json.loads(evs[0].data)["owner"] == "proj"
        out = [e.data for e in evs if e.kind == "exec.stdout"]
        assert out == ["once\n"]
        asked = [json.loads(e.data) for e in evs if e.kind == "sandbox.requested"]
        assert [a["op"] for a in asked] == ["create", "pause", "resume", "delete"]
        assert {a["by"] for a in asked} == {key_id}
        assert await own_log.read(sb.id, 0) == []  # nothing of it in the api's own log
    finally:
        own_log.close()
        keys.close()
