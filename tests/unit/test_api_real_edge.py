"""End to end: SDK -> api (real uvicorn) -> the real Edge with runc sandboxes (root only)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import rollbox
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore
from rollbox.placement import Placement

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


async def test_sdk_over_api_over_real_edge(edge, tmp_path: Path) -> None:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    app = create_app(Placement([edge]), edge.event_log, keys)
    key = keys.create("proj")
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
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
