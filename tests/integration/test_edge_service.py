"""The edge served over HTTP (``edge.service``) and its client (``edge.remote.RemoteEdge``), on a
real edge with real sandboxes: the cluster token is checked before any work, bad bodies are
typed 4xx answers, the edge's errors come back as their own classes, a stopped edge is a typed
retryable error at once, and a stream whose edge dies or goes silent mid-way ends with a typed
error item (never a hang). Faults are made by a real TCP proxy between client and edge."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest

from rollbox import errors
from rollbox.edge import wire
from rollbox.edge.remote import RemoteEdge
from rollbox.edge.server import BackgroundServer
from rollbox.edge.service import create_edge_app
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.conftest import CLUSTER_TOKEN, served_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
BOUND_S = 20  # a hang fails the test after this; nothing here is a timing assertion


class Proxy:
    """TCP between a client and the edge, that can cut every connection (an edge that died:
    the client reads EOF) or freeze them (a node that went silent: nothing more arrives)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.frozen = False
        self._conns: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        self._conns += [writer, up_w]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    while self.frozen:
                        await asyncio.sleep(3600)  # the bytes are never delivered
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))

    def cut(self) -> None:
        for w in self._conns:
            w.transport.abort()
        self._conns.clear()


@contextlib.asynccontextmanager
async def fast_edge(edge, heartbeat_s: float = 0.2) -> AsyncIterator[BackgroundServer]:  # noqa: ANN001
    """The edge served with frequent heartbeats (a client may then time out quickly)."""
    async with BackgroundServer(create_edge_app(edge, CLUSTER_TOKEN,
                                                heartbeat_s=heartbeat_s)) as srv:
        yield srv


async def _raw(url: str, method: str, route: str, token: str | None = CLUSTER_TOKEN,
               **kw: object) -> tuple[int, dict]:
    headers = dict(kw.pop("headers", {}) or {})  # type: ignore[call-overload]
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as s, \
            s.request(method, url + wire.PREFIX + route, headers=headers, **kw) as r:
        body = await r.read()
        return r.status, (json.loads(body) if r.status != 200 else {})


async def test_the_cluster_token_is_checked_before_any_work(edge) -> None:  # noqa: ANN001
    spec = {"spec": SandboxSpec(image=BB).model_dump(mode="json"), "owner": "p"}
    async with served_edge(edge) as remote:
        url = remote.url
        for token in (None, "", "x" * len(CLUSTER_TOKEN), CLUSTER_TOKEN[:-1],
                      CLUSTER_TOKEN + "x", CLUSTER_TOKEN.upper()):
            for method, route, kw in (
                    ("POST", "/call/create", {"json": spec}),
                    ("POST", "/stream/events", {"json": {"sandbox_id": "n-0123456789",
                                                         "after_seq": 0, "follow": True}}),
                    ("PUT", "/upload/image_upload", {"data": b"x" * 1000}),
                    ("POST", "/platform_exec", {"json": {}}),
                    ("POST", "/proc/" + "a" * 32 + "/kill", {})):
                status, body = await _raw(url, method, route, token, **kw)
                assert status == 401 and body["error"]["code"] == "unauthorized", (token, route)
        # Without "Bearer " the right token is refused too.
        async with aiohttp.ClientSession() as s, s.post(
                url + wire.PREFIX + "/call/capacity", json={},
                headers={"Authorization": CLUSTER_TOKEN}) as r:
            assert r.status == 401
        assert edge.live == {} and edge.journal.live() == []  # nothing was created
        bad = RemoteEdge(edge.node_id, url, "y" * 32)
        try:
            with pytest.raises(errors.Unauthorized):
                await bad.create(SandboxSpec(image=BB), "p")
            with pytest.raises(errors.Unauthorized):
                [x async for x in bad.events("n-0123456789", 0, False)]
        finally:
            await bad.close()
        assert edge.live == {}
        # ... and the right one works.
        info = await remote.create(SandboxSpec(image=BB), "p")
        await remote.delete(info.id)
    for short in ("", "short", "x" * 15, "tab\tin" * 4):
        with pytest.raises(errors.BadRequest):
            create_edge_app(edge, short)


async def test_bad_bodies_are_typed_4xx_and_change_nothing(edge) -> None:  # noqa: ANN001
    async with served_edge(edge) as remote:
        url = remote.url
        info = await remote.create(SandboxSpec(image=BB), "p")
        sid = info.id
        cases: list[tuple[str, str, dict, int, str]] = [
            ("POST", "/call/get", {"data": b'{"sandbox_id": "' + b"a" * (2 << 20) + b'"}'},
             413, "payload_too_large"),
            ("POST", "/call/get", {"json": {"sandbox_id": "../../etc"}}, 400, "bad_request"),
            ("POST", "/call/get", {"json": {"sandbox_id": sid, "more": 1}}, 400, "bad_request"),
            ("POST", "/call/get", {"data": b"{not json"}, 400, "bad_request"),
            ("POST", "/call/get", {"json": {}}, 400, "bad_request"),
            ("POST", "/call/file_stat", {"json": {"sandbox_id": sid, "path": "/a\x00b"}},
             400, "bad_request"),
            ("POST", "/call/file_read", {"json": {"sandbox_id": sid, "path": "/x",
                                                  "max_bytes": -1}}, 400, "bad_request"),
            ("POST", "/call/exec_kill", {"json": {"sandbox_id": sid, "exec_id": "e1",
                                                  "signal": 99}}, 400, "bad_request"),
            ("POST", "/call/set_ttl", {"json": {"sandbox_id": sid, "ttl_s": -5}},
             400, "bad_request"),
            ("POST", "/call/file_write", {"data": b'{"sandbox_id": "' + sid.encode() + b'"}'},
             400, "bad_request"),  # no newline before the data
            ("POST", "/call/exec_stdin", {"data": b'{"sandbox_id":"' + sid.encode()
                                          + b'","exec_id":"e1","eof":false}\n'
                                          + b"x" * (17 << 20)}, 413, "payload_too_large"),
            ("POST", "/call/no_such_method", {"json": {}}, 404, "not_found"),
            ("POST", "/call/_live", {"json": {}}, 404, "not_found"),
            ("GET", "/call/get", {}, 405, "bad_request"),
            ("POST", "/stream/exec_stream", {"json": {"sandbox_id": sid, "exec_id": "e1",
                                                      "offsets": [-1, 0]}}, 400, "bad_request"),
            ("POST", "/stream/create", {"json": {}}, 404, "not_found"),
            ("PUT", "/upload/upload_tar", {"data": b"", "headers": {
                wire.ARGS_HEADER: json.dumps({"sandbox_id": sid, "path": "/" * 5000})}},
             400, "bad_request"),
            ("PUT", "/upload/upload_tar", {"data": b"", "headers": {
                wire.ARGS_HEADER: "x" * (20 << 10)}}, 400, "bad_request"),
            ("POST", "/platform_exec", {"json": {"sandbox_id": sid, "req": {"argv": "sh"}}},
             400, "bad_request"),
            ("POST", "/proc/short/stdin", {"data": b"x"}, 404, "not_found"),
            ("POST", "/proc/" + "b" * 32 + "/stdin", {"data": b"x"}, 404, "not_found"),
        ]
        for method, route, kw, status, code in cases:
            got, body = await _raw(url, method, route, **kw)
            assert (got, body.get("error", {}).get("code")) == (status, code), (route, kw, body)
        # A body declared over the upload cap is refused before it is sent.
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        args = json.dumps({"sandbox_id": sid, "path": "/t"})
        writer.write((f"PUT {wire.PREFIX}/upload/upload_tar HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {CLUSTER_TOKEN}\r\n{wire.ARGS_HEADER}: {args}\r\n"
                      f"Content-Length: {3 << 30}\r\n\r\n").encode())
        await writer.drain()
        async with asyncio.timeout(BOUND_S):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head
        writer.close()
        assert list(edge.live) == [sid]
        with pytest.raises(errors.NotFound):
            await remote.file_stat(sid, "/t")
        await remote.delete(sid)


async def test_the_edges_errors_come_back_as_their_own_class(edge, monkeypatch) -> None:  # noqa: ANN001
    async with served_edge(edge) as remote:
        with pytest.raises(errors.NotFound):
            await remote.get(f"{edge.node_id}-0123456789ab")
        with pytest.raises(errors.BadRequest):
            await remote.get("not an id")
        with pytest.raises(errors.NotFound):
            await remote.create(SandboxSpec(image="no/such:image"), "p")
        info = await remote.create(SandboxSpec(image=BB, resources=Resources(disk_mib=16)), "p")
        sid = info.id
        try:
            with pytest.raises(errors.NotFound):
                [x async for x in remote.exec_stream(sid, "e999")]
            with pytest.raises(errors.NotFound):
                [x async for x in remote.file_read_stream(sid, "/nope", 10)]
            big = b"\0" * (24 << 20)
            with pytest.raises(errors.DiskFull) as full:
                await remote.file_write(sid, "/root/big", big, 0o644)
            assert full.value.details["reason"] == "disk_full"
            await remote.pause(sid)
            with pytest.raises(errors.SandboxPaused) as paused:
                await remote.exec_start(sid, ExecSpec(cmd=["true"]))
            assert paused.value.details == {"state": "paused"}
            await remote.resume(sid)

            async def bug(owner: str) -> None:
                raise ValueError("a bug in the edge")

            monkeypatch.setattr(edge, "image_usage", bug)
            with pytest.raises(errors.RollboxError) as internal:
                await remote.image_usage("p")
            assert type(internal.value) is errors.RollboxError
            assert internal.value.code == "internal" and "bug" not in internal.value.message
        finally:
            await remote.delete(sid)
        with pytest.raises(errors.SandboxDead):
            await remote.exec_start(sid, ExecSpec(cmd=["true"]))


async def test_a_stopped_edge_is_a_typed_retryable_error_at_once(edge) -> None:  # noqa: ANN001
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    nobody = RemoteEdge("n9", f"http://127.0.0.1:{free}", CLUSTER_TOKEN)
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(errors.EdgeUnreachable) as exc:
                await nobody.capacity()
        assert exc.value.retryable and exc.value.details["node"] == "n9"
    finally:
        await nobody.close()
    srv = BackgroundServer(create_edge_app(edge, CLUSTER_TOKEN))
    url = await srv.start()
    remote = RemoteEdge(edge.node_id, url, CLUSTER_TOKEN)
    try:
        assert (await remote.capacity())["sandboxes"] == 0
        await srv.stop()
        async with asyncio.timeout(BOUND_S):
            for call in (remote.capacity(), remote.list(None, {}),
                         remote.file_write(f"{edge.node_id}-0123456789ab", "/x", b"y", 0o644)):
                with pytest.raises(errors.EdgeUnreachable):
                    await call
            with pytest.raises(errors.EdgeUnreachable):
                [x async for x in remote.exec_stream(f"{edge.node_id}-0123456789ab", "e1")]
    finally:
        await srv.stop()
        await remote.close()


LINES = 60
COUNT = f"i=0; while [ $i -lt {LINES} ]; do i=$((i+1)); echo line$i; sleep 0.03; done"


async def test_a_stream_whose_edge_dies_ends_with_a_typed_error_item(edge) -> None:  # noqa: ANN001
    async with fast_edge(edge) as srv, served_edge(edge) as direct:
        sid = (await direct.create(SandboxSpec(image=BB), "p")).id
        try:
            for fault in ("cut", "freeze"):
                exec_id = await direct.exec_start(sid, ExecSpec(cmd=COUNT))
                async with Proxy(srv.port) as proxy:
                    remote = RemoteEdge(edge.node_id, proxy.url, CLUSTER_TOKEN,
                                        idle_timeout_s=1.0)
                    try:
                        items = []
                        async with asyncio.timeout(BOUND_S):
                            async for item in remote.exec_stream(sid, exec_id):
                                items.append(item)
                                if item.kind == "stdout" and len(items) == 3:
                                    proxy.cut() if fault == "cut" else setattr(
                                        proxy, "frozen", True)
                        assert items[-1].kind == "error", (fault, items[-1])
                        assert isinstance(items[-1].error, errors.ConnectionLost)
                        assert items[-1].error.retryable
                        assert [i.kind for i in items[:-1]].count("error") == 0
                        got = b"".join(i.data for i in items if i.kind == "stdout")
                    finally:
                        await remote.close()
                # The command ran on; a re-attach from the bytes the client has gets the rest.
                rest = [i async for i in direct.exec_stream(sid, exec_id, (len(got), 0))]
                out = got + b"".join(i.data for i in rest if i.kind == "stdout")
                assert rest[-1].kind == "exit" and rest[-1].result.exit_code == 0
                assert out == b"".join(b"line%d\n" % n for n in range(1, LINES + 1))
            # An event follower is cut the same way, and raises a typed error.
            async with Proxy(srv.port) as proxy:
                remote = RemoteEdge(edge.node_id, proxy.url, CLUSTER_TOKEN, idle_timeout_s=1.0)
                try:
                    async with asyncio.timeout(BOUND_S):
                        with pytest.raises(errors.ConnectionLost):
                            async for _ in remote.events(sid, 0, True):
                                proxy.frozen = True
                finally:
                    await remote.close()
        finally:
            await direct.delete(sid)


async def test_heartbeats_keep_a_silent_call_and_stream_alive(edge) -> None:  # noqa: ANN001
    async with fast_edge(edge, heartbeat_s=0.1) as srv:
        remote = RemoteEdge(edge.node_id, srv.url, CLUSTER_TOKEN, idle_timeout_s=0.5)
        try:  # each call or stream stays silent for 3 idle timeouts
            sid = (await remote.create(SandboxSpec(image=BB), "p")).id
            exec_id = await remote.exec_start(sid, ExecSpec(cmd="sleep 1.5; echo done"))
            kinds = [(i.kind, i.data) async for i in remote.exec_stream(sid, exec_id)]
            assert kinds[-2:] == [("stdout", b"done\n"), ("exit", b"")]
            exec_id = await remote.exec_start(sid, ExecSpec(cmd="sleep 1.5", background=True))
            assert (await remote.exec_wait(sid, exec_id)).exit_code == 0
            code, out = await remote.run_shell(sid, "sleep 1.5; echo ok", {}, 10)
            assert (code, out) == (0, b"ok\n")
            await remote.delete(sid)
        finally:
            await remote.close()


async def test_uploads_stream_and_fail_with_the_callers_error(edge) -> None:  # noqa: ANN001
    async with served_edge(edge) as remote:
        sid = (await remote.create(SandboxSpec(image=BB), "p")).id
        try:
            async def chunks(n: int, fail: BaseException | None = None) -> AsyncIterator[bytes]:
                for i in range(n):
                    yield bytes([i % 256]) * (1 << 20)
                if fail is not None:
                    raise fail

            size = await remote.file_write_stream(sid, "/root/f", chunks(48), 0o600, 1 << 30)
            assert size == 48 << 20
            st = await remote.file_stat(sid, "/root/f")
            assert (st.size, st.mode & 0o777) == (48 << 20, 0o600)
            back = [c async for c in remote.file_read_stream(sid, "/root/f", 1 << 30)]
            assert max(len(c) for c in back) <= wire.CHUNK
            assert b"".join(back) == b"".join([bytes([i]) * (1 << 20) for i in range(48)])
            # The caller's source fails mid-way: that error, and no file (writes are atomic).
            cap = errors.PayloadTooLarge("the api's own cap", limit=1)
            with pytest.raises(errors.PayloadTooLarge) as exc:
                await remote.file_write_stream(sid, "/root/g", chunks(8, cap), 0o644, 1 << 30)
            assert exc.value is cap
            with pytest.raises(errors.NotFound):
                await remote.file_stat(sid, "/root/g")
            with pytest.raises(errors.PayloadTooLarge):  # the edge's own bound
                await remote.file_write_stream(sid, "/root/h", chunks(3), 0o644, 2 << 20)
            with pytest.raises(errors.NotFound):
                await remote.file_stat(sid, "/root/h")
            # An early refusal (unknown sandbox) while the body still streams.
            with pytest.raises(errors.NotFound):
                await remote.upload_tar(f"{edge.node_id}-0123456789ab", "/", chunks(64))
            assert (await remote.exec_list(sid)) == []
        finally:
            await remote.delete(sid)


@pytest.mark.parametrize("edge_transport", ["remote"], indirect=True)
async def test_exec_attach_at_offsets_stdin_kill_and_events_through_the_api(  # noqa: ANN001
        edge, api_edge, tmp_path) -> None:
    """SDK -> api -> RemoteEdge -> edge: a background command re-attached at byte offsets,
    stdin, kill, the command list and a following event stream (what the api over a local
    edge answers, test_api_real_edge; here only over HTTP)."""
    import rollbox
    from rollbox.api import BackgroundServer as ApiServer
    from rollbox.iam import KeyStore
    from tests.conftest import api_app

    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys)
    try:
        async with ApiServer(app) as srv, rollbox.AsyncClient(srv.url, keys.create("p")) as c:
            sb = await c.create(BB)
            follow = asyncio.ensure_future(sb.events(follow=True))
            proc = await sb.exec_background("echo one; echo two >&2; cat; echo three",
                                            stdin=True)
            await proc.write_stdin(b"in\n")
            await proc.close_stdin()
            got = [(x.stream, x.data) async for x in proc.attach()]
            assert b"".join(d for s, d in got if s == "stdout") == b"one\nin\nthree\n"
            # Re-attach from the offsets a client has (3 stdout bytes, all of stderr).
            resp = await c._t.stream("GET", f"/v1/sandboxes/{sb.id}/exec/{proc.exec_id}"
                                     "/stream", params={"stdout_offset": 3,
                                                        "stderr_offset": 4})
            lines = [m async for m in c._t.lines(resp)]
            kinds = [m["type"] for m in lines]
            assert kinds[0] == "started" and kinds[-1] == "exit"
            assert set(kinds[1:-1]) == {"stdout"} and lines[1]["offset"] == 3
            assert b"".join(base64.b64decode(m["data"]) for m in lines[1:-1]) == b"\nin\nthree\n"
            long = await sb.exec_background("sleep 60")
            infos = {i.exec_id: i.state for i in await sb.processes()}
            assert infos == {proc.exec_id: "exited", long.exec_id: "running"}
            await long.kill()
            assert (await long.wait()).signal == 9
            await sb.delete()
            async with asyncio.timeout(BOUND_S):
                kinds = [e.kind for e in await follow]
            assert kinds[0] == "sandbox.created" and kinds[-1] == "sandbox.deleted"
            assert kinds.count("exec.exited") == 2
    finally:
        keys.close()


async def test_the_watchers_probe_and_node_loss_over_http(edge) -> None:  # noqa: ANN001
    """report() and declare_lost() (the watcher's) are unary methods of the table like any."""
    async with served_edge(edge) as remote:
        a = await remote.create(SandboxSpec(image=BB, labels={"t": "a"}), "p1")
        b = await remote.create(SandboxSpec(image=BB), "p2")
        r = await remote.report(max_sandboxes=1)
        local = await edge.report(max_sandboxes=1)
        assert type(r) is type(local) and r.node_id == edge.node_id
        assert (r.sandboxes_total, r.truncated, r.by_project) == (2, True, {"p1": 1, "p2": 1})
        with pytest.raises(errors.BadRequest):
            await remote.report(fence_s=0)
        assert await remote.declare_lost([a.id, f"{edge.node_id}-0123456789ab"]) == [a.id]
        assert (await remote.get(a.id)).state in ("dead", "deleted")
        with pytest.raises(errors.BadRequest):
            await remote.declare_lost(["../x"])
        await remote.delete(b.id)


async def test_a_platform_process_whose_stream_closes_is_killed(edge) -> None:  # noqa: ANN001
    from rollbox.agent.protocol import ExecRequest

    async with served_edge(edge) as remote:
        sid = (await remote.create(SandboxSpec(image=BB), "p")).id
        try:
            proc = await remote.platform_exec(sid, ExecRequest(
                argv=["sh", "-c", "echo up; exec sleep 300"], env=["PATH=/bin:/usr/bin"]))
            events = proc.events()
            assert await events.__anext__() == ("stdout", b"up\n")
            count = "ps -o args | grep -c '^sleep 300'"
            # "up" comes before the shell's exec of the sleep: under load a ps can run in
            # between and see the shell (the flake of a clean-clone CI run: 0 sleeps found)
            async with asyncio.timeout(BOUND_S):
                while (await remote.run_shell(sid, count, {}, 10))[1].strip() != b"1":
                    await asyncio.sleep(0.05)
            await events.aclose()  # its client leaves
            async with asyncio.timeout(BOUND_S):
                while (await remote.run_shell(sid, count, {}, 10))[1].strip() != b"0":
                    await asyncio.sleep(0.05)
            with pytest.raises(errors.NotFound):  # and its handle is gone
                await proc.kill()
        finally:
            await remote.delete(sid)


@pytest.mark.parametrize("interruption", ["delete", "pause_fs"])
async def test_a_platform_process_interrupted_ends_with_the_sandboxs_state(  # noqa: ANN001
        edge, caplog, interruption) -> None:
    """A delete or a filesystem-only pause in the middle of a platform process (local, and over
    the edge service) ends its events with SandboxDead / SandboxPaused, as a journaled exec's,
    not the closed channel's infrastructure error. After a delete the service logs the 410 it
    is, not a 503 fault; after a pause the sandbox resumes and answers."""
    import logging

    from rollbox.agent.protocol import ExecRequest

    caplog.set_level(logging.INFO, logger="rollbox")
    req = ExecRequest(argv=["sh", "-c", "echo up; exec sleep 300"], env=["PATH=/bin:/usr/bin"])
    async with served_edge(edge) as remote:
        for face in (edge, remote):
            sid = (await face.create(SandboxSpec(image=BB), "p")).id
            try:
                proc = await face.platform_exec(sid, req)
                events = proc.events()
                assert await events.__anext__() == ("stdout", b"up\n")
                if interruption == "delete":
                    await face.delete(sid)
                    expected, match = errors.SandboxDead, "was deleted"
                else:
                    await face.pause(sid, keep_memory=False)
                    expected, match = errors.SandboxPaused, "filesystem-only"
                with pytest.raises(expected, match=match):
                    async with asyncio.timeout(BOUND_S):
                        await events.__anext__()
                await events.aclose()
                if interruption == "pause_fs":
                    await face.resume(sid)
                    assert (await face.run_shell(sid, "echo back", {}, 10))[1] == b"back\n"
            finally:
                await face.delete(sid)
    if interruption == "delete":
        lines = [r.getMessage() for r in caplog.records if r.name == "rollbox.edge.service"]
        assert any("platform_exec -> 410 sandbox_dead" in m for m in lines), lines
        assert not [m for m in lines if "agent channel closed" in m], lines


async def test_a_failed_call_is_traced_from_the_sdk_error_to_the_edges_log_line(  # noqa: ANN001
        edge, tmp_path, caplog) -> None:
    """SDK -> api -> RemoteEdge -> edge, the edge served over HTTP: the error the trainer gets
    names a request id; the api's log line and the edge service's log line for that call name
    the same id (it crossed the hop in X-Request-Id: the edge's server has no other way to know
    it) and the sandbox."""
    import logging

    import rollbox
    from rollbox import terminal
    from rollbox.api import BackgroundServer as ApiServer
    from rollbox.iam import KeyStore
    from tests.conftest import api_app

    terminal.stamp_trace_ids()
    caplog.set_level(logging.INFO, logger="rollbox")
    keys = KeyStore(tmp_path / "keys.db")
    try:
        async with served_edge(edge) as remote:
            app = api_app(remote, edge, keys)
            async with ApiServer(app) as srv, \
                    rollbox.AsyncClient(srv.url, keys.create("p")) as c:
                sb = await c.create(BB)
                with pytest.raises(errors.NotFound) as ei:
                    await sb.files.read("/no/such/file")
                rid = ei.value.request_id
                await sb.delete()
        assert rid is not None and rid.startswith("req_")
        mine = [r for r in caplog.records if getattr(r, "trace_ids", {}).get("request_id") == rid]
        by = {r.name: r for r in mine}
        assert "rollbox.api.errors" in by and "rollbox.edge.service" in by, [
            (r.name, r.getMessage()) for r in mine]
        for name in ("rollbox.api.errors", "rollbox.edge.service"):
            assert by[name].trace_ids["sandbox_id"] == sb.id
            assert "404 not_found" in by[name].getMessage()
    finally:
        keys.close()
