"""The unmodified ``e2b`` SDK (pinned in requirements.lock) against rollbox's E2B front door:
a real edge, the real api app on a real port, E2B_API_URL / E2B_SANDBOX_URL pointed at it.

One module-wide server and event loop (the SDK keeps one connection pool per process); the
sync SDK runs in a worker thread so it never blocks the loop that serves it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node

e2b = pytest.importorskip("e2b")

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not have_image("debian:bookworm"), reason="debian:bookworm not built"),
]


class Env:
    def __init__(self, url: str, key: str, edge: Any) -> None:
        self.url, self.key, self.edge = url, key, edge


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[Env]:
    async with e2b_node("e2b-proj") as (url, key, edge):
        yield Env(url, key, edge)


async def test_async_commands(env: Env) -> None:
    from e2b import AsyncSandbox, CommandExitException, TimeoutException

    sbx = await AsyncSandbox.create("base", timeout=120, metadata={"job": "t1"},
                                    envs={"GREETING": "hi"})
    try:
        assert await sbx.is_running()
        out: list[str] = []
        err: list[str] = []
        res = await sbx.commands.run("echo $GREETING; echo oops >&2; echo two",
                                     on_stdout=out.append, on_stderr=err.append)
        assert res.exit_code == 0
        assert res.stdout == "hi\ntwo\n" and res.stderr == "oops\n"
        assert "".join(out) == "hi\ntwo\n" and "".join(err) == "oops\n"

        res = await sbx.commands.run("pwd; echo $X", cwd="/tmp", envs={"X": "y"})
        assert res.stdout == "/tmp\ny\n"

        with pytest.raises(CommandExitException) as ex:
            await sbx.commands.run("echo bad; exit 3")
        assert ex.value.exit_code == 3 and ex.value.stdout == "bad\n"

        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 30", timeout=1)
        assert time.monotonic() - t0 < 10

        # Background command, list, connect, stdin, kill.
        h = await sbx.commands.run("cat", background=True, stdin=True)
        procs = await sbx.commands.list()
        assert h.pid in [p.pid for p in procs]
        await sbx.commands.send_stdin(h.pid, "line one\n")
        seen: list[str] = []
        h2 = await sbx.commands.connect(h.pid, on_stdout=seen.append)
        for _ in range(100):
            if "line one\n" in "".join(seen):
                break
            await asyncio.sleep(0.05)
        assert "line one\n" in "".join(seen)
        assert await sbx.commands.kill(h.pid)
        with pytest.raises(CommandExitException):
            await h2.wait()
        assert h.pid not in [p.pid for p in await sbx.commands.list()]
        assert not await sbx.commands.kill(h.pid)  # gone: False, not an error

        bg = await sbx.commands.run("sleep 0.3; echo done", background=True)
        assert (await bg.wait()).stdout == "done\n"
    finally:
        assert await sbx.kill()
    assert not await sbx.is_running()


async def test_async_files(env: Env) -> None:
    from e2b import AsyncSandbox, FileType, NotFoundException

    sbx = await AsyncSandbox.create(timeout=120)
    try:
        info = await sbx.files.write("/tmp/a/b.txt", "hello")
        assert info.path == "/tmp/a/b.txt"
        assert await sbx.files.read("/tmp/a/b.txt") == "hello"
        blob = bytes(range(256)) * 4000
        await sbx.files.write("/tmp/a/blob.bin", blob)
        assert bytes(await sbx.files.read("/tmp/a/blob.bin", format="bytes")) == blob
        assert (await sbx.commands.run("cat /tmp/a/b.txt")).stdout == "hello"
        await sbx.files.write("rel.txt", "home")  # relative: the user's home
        assert (await sbx.commands.run("cat /home/user/rel.txt")).stdout == "home"
        # Parents a write or make_dir makes on the way are the user's, as envd (running as
        # the user) makes them; parents that were there keep their owner.
        await sbx.files.write("made/on/way.txt", "x")
        assert await sbx.files.make_dir("/home/user/dirs/made/here")
        h = "/home/user"
        made = [f"{h}/made", f"{h}/made/on", f"{h}/dirs", f"{h}/dirs/made", f"{h}/dirs/made/here"]
        r = await sbx.commands.run(" && ".join(f"touch {d}/new" for d in made)
                                   + " && stat -c %U " + " ".join(made) + " /tmp")
        assert r.stdout.split() == ["user"] * 5 + ["root"]

        assert await sbx.files.exists("/tmp/a/b.txt")
        assert not await sbx.files.exists("/tmp/nope")
        assert await sbx.files.make_dir("/tmp/a/sub/deeper")
        assert not await sbx.files.make_dir("/tmp/a/sub")  # exists: False
        entries = await sbx.files.list("/tmp/a")
        kinds = {e.name: e.type for e in entries}
        assert kinds == {"b.txt": FileType.FILE, "blob.bin": FileType.FILE, "sub": FileType.DIR}
        assert {e.path for e in await sbx.files.list("/tmp/a", depth=3)} >= {
            "/tmp/a/sub/deeper"}
        moved = await sbx.files.rename("/tmp/a/b.txt", "/tmp/a/c.txt")
        assert moved.path == "/tmp/a/c.txt" and moved.type == FileType.FILE
        assert not await sbx.files.exists("/tmp/a/b.txt")
        st = await sbx.files.get_info("/tmp/a/c.txt")
        assert st.size == 5 and st.name == "c.txt"
        await sbx.files.remove("/tmp/a/sub")
        assert not await sbx.files.exists("/tmp/a/sub/deeper")
        with pytest.raises(NotFoundException):
            await sbx.files.read("/tmp/no/such")
        with pytest.raises(NotFoundException):
            await sbx.files.list("/tmp/no/such")
        with pytest.raises(NotFoundException):
            await sbx.files.rename("/tmp/no/such", "/tmp/x")

        # Directory watch (polled): a write and a removal are reported.
        got: list[Any] = []
        handle = await sbx.files.watch_dir("/tmp/a", on_event=got.append)
        await sbx.files.write("/tmp/a/new.txt", "x")
        await sbx.files.remove("/tmp/a/c.txt")
        for _ in range(60):
            names = {(e.name, e.type.value) for e in got}
            if ("new.txt", "create") in names and ("c.txt", "remove") in names:
                break
            await asyncio.sleep(0.1)
        await handle.stop()
        names = {(e.name, e.type.value) for e in got}
        assert ("new.txt", "create") in names and ("c.txt", "remove") in names, names
    finally:
        await sbx.kill()


async def _counter(env: Env, sid: str, moving: bool = False) -> int:
    """The background counter's value, read host-side through the edge (works while paused);
    with moving=True, wait until it has advanced."""
    first = None
    for _ in range(200):
        text = (await env.edge.file_read(sid, "/tmp/count", 64)
                if await _exists(env, sid) else b"").strip()
        if text:
            value = int(text)
            if not moving or (first is not None and value > first):
                return value
            first = value if first is None else first
        await asyncio.sleep(0.05)
    raise AssertionError("counter did not advance")


async def _exists(env: Env, sid: str) -> bool:
    from rollbox import errors

    try:
        await env.edge.file_stat(sid, "/tmp/count")
        return True
    except errors.NotFound:
        return False


async def test_lifecycle_list_connect_pause(env: Env) -> None:
    from e2b import AsyncSandbox, NotFoundException, SandboxQuery, SandboxState

    tag = f"life-{time.monotonic_ns()}"
    a = await AsyncSandbox.create(timeout=60, metadata={"tag": tag, "role": "a"})
    b = await AsyncSandbox.create(timeout=60, metadata={"tag": tag, "role": "b"})
    try:
        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()
        assert {s.sandbox_id for s in found} == {a.sandbox_id, b.sandbox_id}
        only_b = await AsyncSandbox.list(
            query=SandboxQuery(metadata={"tag": tag, "role": "b"})).next_items()
        assert [s.sandbox_id for s in only_b] == [b.sandbox_id]
        assert only_b[0].metadata == {"tag": tag, "role": "b"}

        info = await a.get_info()
        assert info.metadata == {"tag": tag, "role": "a"} and info.template_id == "base"
        await a.set_timeout(600)
        assert (await a.get_info()).end_at.timestamp() > time.time() + 500

        # connect by id (fresh object, token from the control plane) sees the same sandbox.
        await a.files.write("/tmp/mark", "A")
        a2 = await AsyncSandbox.connect(a.sandbox_id)
        assert await a2.files.read("/tmp/mark") == "A"
        assert (await a2.commands.run("cat /tmp/mark")).stdout == "A"

        # pause: really frozen (a background counter stops), listed as paused, envd refuses;
        # connect resumes with state intact and the same process counting on.
        counter = await a.commands.run(
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.02; done",
            background=True)
        count = await _counter(env, a.sandbox_id, moving=True)
        await a.beta_pause()
        assert (await env.edge.get(a.sandbox_id)).state == "paused"
        frozen_at = await _counter(env, a.sandbox_id)
        await asyncio.sleep(0.5)
        assert await _counter(env, a.sandbox_id) == frozen_at >= count
        paused = await AsyncSandbox.list(query=SandboxQuery(
            metadata={"tag": tag}, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [a.sandbox_id]
        running = await AsyncSandbox.list(query=SandboxQuery(
            metadata={"tag": tag}, state=[SandboxState.RUNNING])).next_items()
        assert [s.sandbox_id for s in running] == [b.sandbox_id]
        assert not await a.is_running()
        a3 = await AsyncSandbox.connect(a.sandbox_id, timeout=120)
        assert (await env.edge.get(a.sandbox_id)).state == "running"
        assert await a3.is_running()
        assert await a3.files.read("/tmp/mark") == "A"
        assert await _counter(env, a.sandbox_id, moving=True) > frozen_at
        assert counter.pid in [p.pid for p in await a3.commands.list()]
        await a3.commands.kill(counter.pid)

        # pagination
        pager = AsyncSandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=1)
        seen = []
        while pager.has_next:
            seen += [s.sandbox_id for s in await pager.next_items()]
        assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id])
    finally:
        await a.kill()
        await b.kill()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(a.sandbox_id)


async def test_bad_input_and_unsupported(env: Env) -> None:
    from e2b import (
        AsyncSandbox,
        AuthenticationException,
        NotFoundException,
        SandboxException,
    )

    ghost = f"{env.edge.node_id}-0123456789ab"
    assert not await AsyncSandbox.kill(ghost)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(ghost)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info("not-a-sandbox-id")
    with pytest.raises(NotFoundException):
        await AsyncSandbox.set_timeout(ghost, 30)
    with pytest.raises(SandboxException):
        await AsyncSandbox.create("no-such-template", timeout=30)
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(timeout=30, api_key="e2b_wrong")
    with pytest.raises(SandboxException, match="MCP"):
        await AsyncSandbox.create(timeout=30, mcp={"exa": {"apiKey": "x"}})

    async with httpx.AsyncClient(base_url=env.url, timeout=10,
                                 headers={"X-API-KEY": env.key}) as c:
        for method, path in [("POST", "/e2b/v3/templates"), ("GET", "/e2b/templates"),
                             ("POST", "/e2b/volumes"), ("GET", f"/e2b/sandboxes/{ghost}/logs")]:
            r = await c.request(method, path, json={})
            assert r.status_code == 501 and "not supported" in r.json()["message"], path
        # envd without or with a forged token: 401, never a 500 or a hang.
        r = await c.post("/e2b/envd/process.Process/List", json={})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        r = await c.post("/e2b/envd/process.Process/List", json={},
                         headers={"X-Access-Token": f"{ghost}.deadbeef"})
        assert r.status_code == 401

    sbx = await AsyncSandbox.create(timeout=60)
    try:
        with pytest.raises(SandboxException):
            await sbx.commands.run("true", user="no-such-user")
        with pytest.raises(NotFoundException):
            await sbx.commands.connect(999_999)
        assert (await sbx.commands.run("exit 0")).exit_code == 0  # still healthy
    finally:
        await sbx.kill()
    # A killed sandbox's envd answers "not running", its commands fail fast.
    with pytest.raises(Exception):  # noqa: B017 - the SDK raises its timeout/not-found type
        await sbx.commands.run("true", request_timeout=10)


def _sync_scenario() -> None:
    from e2b import CommandExitException, Sandbox

    sbx = Sandbox.create("base", timeout=60, metadata={"kind": "sync"}, envs={"V": "1"})
    try:
        out: list[str] = []
        res = sbx.commands.run("echo $V; echo e >&2", on_stdout=out.append)
        assert res.stdout == "1\n" and res.stderr == "e\n" and out == ["1\n"]
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 2")
        sbx.files.write("/tmp/s.txt", "sync")
        assert sbx.files.read("/tmp/s.txt") == "sync"
        assert [e.name for e in sbx.files.list("/tmp") if e.name == "s.txt"] == ["s.txt"]
        h = sbx.commands.run("sleep 30", background=True)
        assert h.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(h.pid)
        sbx.set_timeout(120)
        ids = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sbx.sandbox_id in ids
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.exists("/tmp/s.txt")
        # The sync SDK watches through CreateWatcher / GetWatcherEvents / RemoveWatcher.
        sbx.files.make_dir("/tmp/w")
        watch = sbx.files.watch_dir("/tmp/w")
        sbx.files.write("/tmp/w/f", "1")
        got = {(e.name, e.type.value) for e in watch.get_new_events()}
        assert ("f", "create") in got, got
        sbx.files.remove("/tmp/w/f")
        assert ("f", "remove") in {(e.name, e.type.value) for e in watch.get_new_events()}
        watch.stop()
    finally:
        assert sbx.kill()


async def test_sync_sdk(env: Env) -> None:
    await asyncio.to_thread(_sync_scenario)


async def _cycle(i: int) -> str:
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(timeout=120, metadata={"i": str(i)})
    try:
        return (await sbx.commands.run(f"echo {i}")).stdout
    finally:
        await sbx.kill()


async def test_concurrent_64(env: Env) -> None:
    # ~11 s on the 2-core dev machine: kept in the default tier (budget 60 s).
    outs = await asyncio.gather(*(_cycle(i) for i in range(64)))
    assert outs == [f"{i}\n" for i in range(64)]


# ---- wire level: Connect framing, keepalives, bad input the SDK never sends ---------------
def _frames(body: bytes) -> list[tuple[int, Any]]:
    import json
    import struct

    out = []
    while body:
        flags, size = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5:5 + size])))
        body = body[5 + size:]
    return out


def _env(msg: dict[str, Any]) -> bytes:
    import json
    import struct

    data = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(data)) + data


async def test_wire_connect_rpc(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as c:
        r = await c.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 60},
                         headers={"X-API-KEY": env.key})
        assert r.status_code == 201
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        h = {"X-Access-Token": token, "Content-Type": "application/connect+json",
             "Connect-Protocol-Version": "1"}
        try:
            # Framing: start, data, end, then the end-stream envelope {}.
            r = await c.post("/e2b/envd/process.Process/Start", headers=h, content=_env(
                {"process": {"cmd": "/bin/sh", "args": ["-c", "printf hi; exit 4"]}}))
            frames = _frames(r.content)
            assert r.headers["content-type"] == "application/connect+json"
            assert "start" in frames[0][1]["event"] and frames[-1] == (2, {})
            assert {"data": {"stdout": "aGk="}} in [f[1]["event"] for f in frames[1:-1]]
            assert frames[-2][1]["event"]["end"]["exitCode"] == 4
            # A missing binary ends like envd: a non-zero exit, not a transport error.
            r = await c.post("/e2b/envd/process.Process/Start", headers=h, content=_env(
                {"process": {"cmd": "/no/such/bin"}}))
            assert _frames(r.content)[-2][1]["event"]["end"]["exitCode"] == 127
            # Keepalives on a silent stream.
            r = await c.post("/e2b/envd/process.Process/Start",
                             headers={**h, "Keepalive-Ping-Interval": "1"},
                             content=_env({"process": {"cmd": "sleep", "args": ["2.5"]}}))
            kinds = [next(iter(f[1]["event"])) for f in _frames(r.content)[:-1]]
            assert kinds[0] == "start" and kinds.count("keepalive") >= 2 and kinds[-1] == "end"
            # Bad input: clear Connect errors, never a 500 or a hang.
            bad = [
                ("process.Process/Start", {**h, "Content-Type": "application/connect+proto"},
                 b"\0\0\0\0\0", 501, "unimplemented"),
                ("process.Process/Start", h, b"\0\0\0\0\5{bad}", 400, "invalid_argument"),
                ("process.Process/Start", h, _env({"process": {"cmd": "sh"}, "pty": {
                    "size": {"cols": 100_000, "rows": 24}}}), 400, "invalid_argument"),
                ("process.Process/Update", {**h, "Content-Type": "application/json"}, b"{}",
                 400, "invalid_argument"),
                ("process.Process/SendSignal", {**h, "Content-Type": "application/json"},
                 b'{"process": {"pid": 5}}', 404, "not_found"),
                ("filesystem.Filesystem/Stat", {**h, "Content-Type": "application/json"},
                 b"[1]", 400, "invalid_argument"),
                ("nope.Service/Call", {**h, "Content-Type": "application/json"}, b"{}",
                 501, "unimplemented"),
            ]
            for path, hdrs, body, status, code in bad:
                r = await c.post(f"/e2b/envd/{path}", headers=hdrs, content=body)
                assert (r.status_code, r.json()["code"]) == (status, code), (path, r.text)
            # /files: several files in one multipart upload land at their own paths.
            r = await c.post("/e2b/envd/files", headers={"X-Access-Token": token},
                             files=[("file", ("/tmp/m1", b"one")), ("file", ("/tmp/m2", b"2"))])
            assert [e["path"] for e in r.json()] == ["/tmp/m1", "/tmp/m2"]
            r = await c.get("/e2b/envd/files", params={"path": "/tmp/m2"},
                            headers={"X-Access-Token": token})
            assert r.content == b"2"
            r = await c.post("/e2b/envd/files", headers={
                "X-Access-Token": token, "Content-Type": "multipart/form-data; boundary=zz"},
                content=b"--zz\r\nnot a part")
            assert 400 <= r.status_code < 500, r.text
            assert (await c.get("/e2b/envd/health", headers={"X-Access-Token": token})
                    ).status_code == 204
        finally:
            r = await c.delete(f"/e2b/sandboxes/{sid}", headers={"X-API-KEY": env.key})
            assert r.status_code == 204
        r = await c.get("/e2b/envd/health", headers={"X-Access-Token": token})
        assert r.status_code == 502
        r = await c.delete(f"/e2b/sandboxes/{sid}", headers={"X-API-KEY": env.key})
        assert r.status_code == 404


async def test_envd_token_ends_with_its_key(env: Env) -> None:
    """An envd access token is the key's: once the key that got it is revoked, envd refuses
    the token at once (the sandbox lives on for its project's other keys)."""
    from rollbox.iam import KeyStore

    keys = KeyStore(env.edge.settings.data_dir.parent / "keys.db")  # the node's key store
    try:
        key = keys.create("e2b-proj")
        async with httpx.AsyncClient(base_url=env.url, timeout=30) as c:
            r = await c.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 60},
                             headers={"X-API-KEY": key})
            sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
            try:
                health = {"X-Access-Token": token}
                assert (await c.get("/e2b/envd/health", headers=health)).status_code == 204
                keys.revoke(keys.verify(key).key_id)
                r = await c.get("/e2b/envd/health", headers=health)
                assert r.status_code == 401
                # Another key of the project gets its own token for the same sandbox.
                r = await c.get(f"/e2b/sandboxes/{sid}", headers={"X-API-KEY": env.key})
                other = {"X-Access-Token": r.json()["envdAccessToken"]}
                assert (await c.get("/e2b/envd/health", headers=other)).status_code == 204
            finally:
                await c.delete(f"/e2b/sandboxes/{sid}", headers={"X-API-KEY": env.key})
    finally:
        keys.close()


async def test_fork_snapshot_metrics_network_and_list_order(env: Env) -> None:
    """The 2.51+ SDK's other routes on rollbox's own features: fork (POST /v1/.../fork),
    snapshots (pack_diff into a project image, usable as a template), metrics (the native
    usage history, also GET /v1/sandboxes/{id}/usage), update_network / allow_out (network
    policy), list newest first with started_after and template filters."""
    import datetime as dt
    import ipaddress

    from e2b import AsyncSandbox, SandboxException, SandboxQuery

    from rollbox import AsyncClient

    sbx = await AsyncSandbox.create(timeout=120, metadata={"t": "fork"},
                                    network={"allow_out": ["10.255.255.1"]})
    made: list[Any] = [sbx]
    try:
        info = await env.edge.get(sbx.sandbox_id)
        assert info.network is not None and info.network.allow == [
            "10.255.255.1:80/tcp", "10.255.255.1:443/tcp"]
        await sbx.update_network({"allow_out": ["10.255.255.2/32"]})
        assert (await env.edge.get(sbx.sandbox_id)).network.allow[0] == "10.255.255.2/32:80/tcp"

        # denyOut: everything else (the IPv4 space minus the denied ranges) on 80 and 443,
        # allowOut besides it (E2B: allowed entries win); 0.0.0.0/0 leaves allowOut alone
        await sbx.update_network({"allow_out": ["10.1.2.3"],
                                  "deny_out": ["8.8.8.8", "10.0.0.0/8"]})
        rules = (await env.edge.get(sbx.sandbox_id)).network.allow
        assert rules[:2] == ["10.1.2.3:80/tcp", "10.1.2.3:443/tcp"]
        opened = [ipaddress.IPv4Network(r.split(":")[0]) for r in rules[2::2]]
        assert all(r.endswith(":80/tcp") for r in rules[2::2]) and len(rules) == 2 + 2 * 32
        assert sum(n.num_addresses for n in opened) == 2**32 - 2**24 - 1
        assert not any(n.overlaps(ipaddress.IPv4Network("10.0.0.0/8"))
                       or ipaddress.IPv4Address("8.8.8.8") in n for n in opened)
        await sbx.update_network({"allow_out": ["10.255.255.2/32"], "deny_out": ["0.0.0.0/0"]})
        assert (await env.edge.get(sbx.sandbox_id)).network.allow == [
            "10.255.255.2/32:80/tcp", "10.255.255.2/32:443/tcp"]
        with pytest.raises(SandboxException, match="not supported"):
            await AsyncSandbox.create(timeout=30, network={"deny_out": ["example.com"]})
        denied = await AsyncSandbox.create(timeout=30, network={"deny_out": ["1.2.3.0/24"]})
        try:
            assert len((await env.edge.get(denied.sandbox_id)).network.allow) == 2 * 24
            assert (await denied.commands.run("echo up")).stdout == "up\n"
        finally:
            await denied.kill()

        await sbx.files.write("state.txt", "before")
        kids = await sbx.fork(count=2, timeout=60)
        assert all(isinstance(k, AsyncSandbox) for k in kids), kids
        made += kids
        await sbx.files.write("state.txt", "after")  # no child sees the source's later write
        for k in kids:
            assert await k.files.read("state.txt") == "before"
            assert (await k.commands.run("whoami")).stdout == "user\n"
            ki = await env.edge.get(k.sandbox_id)
            assert ki.labels["fork_of"] == sbx.sandbox_id and ki.expires_at < info.expires_at

        snap = await sbx.create_snapshot()
        assert snap.snapshot_id.startswith("e2b-proj/") and snap.names == [snap.snapshot_id]
        from_snap = await AsyncSandbox.create(snap.snapshot_id, timeout=60)
        made.append(from_snap)
        assert await from_snap.files.read("/home/user/state.txt") == "after"

        await sbx.commands.run("head -c 20000000 /dev/zero | sha256sum >/dev/null")
        metrics = await sbx.get_metrics()
        assert metrics and metrics[-1].mem_used > 0 and metrics[-1].cpu_count >= 1
        assert metrics[-1].mem_total == info.resources.memory_mib << 20
        async with AsyncClient(env.url, api_key=env.key) as c:
            native = await (await c.get(sbx.sandbox_id)).usage()
        assert native[-1].memory_bytes and native[-1].cpu_usage_us
        # the writable layer's qgroup (its files and metadata): never 0 once written to
        assert native[-1].disk_bytes and native[-1].disk_bytes > 0
        assert metrics[-1].disk_used > 0
        assert [s.at for s in native] == sorted(s.at for s in native)

        # newest first by default; started_after and template narrow it
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"t": "fork"})).next_items()
        starts = [s.started_at for s in listed]
        assert starts == sorted(starts, reverse=True) and len(listed) == 3  # sbx + 2 kids
        after = await AsyncSandbox.list(query=SandboxQuery(
            metadata={"t": "fork"}, started_after=listed[-1].started_at + dt.timedelta(
                microseconds=1))).next_items()
        assert {s.sandbox_id for s in after} == {k.sandbox_id for k in kids}, (
            [(s.sandbox_id, s.started_at) for s in listed], sbx.sandbox_id)
        by_template = await AsyncSandbox.list(
            query=SandboxQuery(template=snap.snapshot_id)).next_items()
        assert [s.sandbox_id for s in by_template] == [from_snap.sandbox_id]
        page = AsyncSandbox.list(query=SandboxQuery(metadata={"t": "fork"}), limit=2)
        first, rest = await page.next_items(), await page.next_items()
        assert [s.sandbox_id for s in first + rest] == [s.sandbox_id for s in listed]
        assert not page.has_next

        async with httpx.AsyncClient(base_url=env.url, timeout=10,
                                     headers={"X-API-KEY": env.key}) as c:
            for body in ({"denyOut": ["example.com"]}, {"rules": {"a.com": {}}},
                         {"egressProxy": {"address": "p:1080"}}):
                r = await c.put(f"/e2b/sandboxes/{sbx.sandbox_id}/network", json=body)
                assert r.status_code == 501 and "not supported" in r.json()["message"], body
            for body in ({"denyOut": ["10.0.0.1/8"]}, {"denyOut": ["nope nope"]},
                         {"allowOut": ["a.com"], "dnsServers": ["x"]}):
                r = await c.put(f"/e2b/sandboxes/{sbx.sandbox_id}/network", json=body)
                assert r.status_code == 400, (body, r.text)
            r = await c.post(f"/e2b/sandboxes/{sbx.sandbox_id}/fork", json={"count": 0})
            assert r.status_code == 400
            r = await c.get("/e2b/v2/sandboxes", params={"order": "up"})
            assert r.status_code == 400
            r = await c.get("/e2b/v2/sandboxes", params={"startedAfter": "yesterday"})
            assert r.status_code == 400
    finally:
        await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
        for img in await env.edge.image_list(None):
            if img.name.startswith("e2b-proj/e2b-snap-"):
                await env.edge.image_delete(img.name, None)


async def test_auto_pause_at_timeout_then_connect(env: Env) -> None:
    """lifecycle on_timeout=pause (autoPause) is rollbox's on_expiry "pause": the TTL's end
    freezes the sandbox in place (processes and memory kept), connect resumes it; a
    filesystem-only auto-pause is a typed 501."""
    from e2b import AsyncSandbox, SandboxException, SandboxState

    sbx = await AsyncSandbox.create(timeout=60, lifecycle={"on_timeout": "pause"})
    try:
        assert (await env.edge.get(sbx.sandbox_id)).on_expiry == "pause"
        h = await sbx.commands.run("sleep 600", background=True)
        await sbx.files.write("/tmp/kept", "yes")
        boot = (await sbx.files.read("/proc/sys/kernel/random/boot_id")).strip()
        assert len(boot) == 36  # /proc as the sandbox sees it (read inside it)
        await sbx.set_timeout(0)  # E2B: the timeout ends now
        for _ in range(100):
            if (await env.edge.get(sbx.sandbox_id)).state == "paused":
                break
            await asyncio.sleep(0.1)
        info = await sbx.get_info()
        assert info.state == SandboxState.PAUSED and not await sbx.is_running()
        assert info.end_at.timestamp() > time.time() + 3600  # it lives on paused
        again = await AsyncSandbox.connect(sbx.sandbox_id, timeout=60)
        assert (await again.get_info()).state == SandboxState.RUNNING
        assert await again.files.read("/tmp/kept") == "yes"
        assert h.pid in [p.pid for p in await again.commands.list()]  # the process lived on
    finally:
        await sbx.kill()
    # (auto_resume: test_compat_e2b_autoresume.py; the filesystem-only auto-pause below)
    assert SandboxException


async def test_filesystem_only_pause_reboots(env: Env) -> None:
    """pause(keep_memory=False) and autoPauseMemory=false are rollbox's filesystem-only pause:
    processes gone, files kept, a new boot id after connect; pauseMode says which pause it
    was; a filesystem-only auto-pause with auto_resume is a 400 (as on E2B)."""
    from e2b import AsyncSandbox, SandboxState

    sbx = await AsyncSandbox.create(timeout=60)
    try:
        h = await sbx.commands.run("sleep 600", background=True)
        await sbx.files.write("/tmp/kept", "yes")
        boot = (await sbx.files.read("/proc/sys/kernel/random/boot_id")).strip()
        assert await sbx.pause(keep_memory=False)
        info = await env.edge.get(sbx.sandbox_id)
        assert info.state == "paused" and info.memory_kept is False
        async with httpx.AsyncClient(base_url=env.url, timeout=10,
                                     headers={"X-API-Key": env.key}) as c:
            listed = await c.get(f"/e2b/sandboxes/{sbx.sandbox_id}")
        assert listed.json()["pauseMode"] == "filesystem", listed.text
        assert (await sbx.get_info()).state == SandboxState.PAUSED
        again = await AsyncSandbox.connect(sbx.sandbox_id, timeout=60)
        assert await again.files.read("/tmp/kept") == "yes"
        assert (await again.files.read("/proc/sys/kernel/random/boot_id")).strip() != boot
        assert h.pid not in [p.pid for p in await again.commands.list()]
    finally:
        await sbx.kill()
    # connect with memory=false of a frozen (memory-kept) pause: it boots from its files
    frozen = await AsyncSandbox.create(timeout=60)
    try:
        h = await frozen.commands.run("sleep 600", background=True)
        await frozen.pause()
        assert (await env.edge.get(frozen.sandbox_id)).memory_kept is True
        async with httpx.AsyncClient(base_url=env.url, timeout=60,
                                     headers={"X-API-Key": env.key}) as c:
            r = await c.post(f"/e2b/sandboxes/{frozen.sandbox_id}/connect",
                             json={"timeout": 60, "memory": False})
        assert r.status_code == 201, r.text
        assert (await env.edge.get(frozen.sandbox_id)).state == "running"
        assert h.pid not in [p.pid for p in await frozen.commands.list()]
    finally:
        await frozen.kill()
    auto = await AsyncSandbox.create(timeout=30, lifecycle={
        "on_timeout": {"action": "pause", "keep_memory": False}})
    try:
        spec = await env.edge.get(auto.sandbox_id)
        assert spec.on_expiry == "pause" and spec.pause_keep_memory is False
    finally:
        await auto.kill()
    async with httpx.AsyncClient(base_url=env.url, timeout=30,
                                 headers={"X-API-Key": env.key}) as c:
        r = await c.post("/e2b/sandboxes", json={
            "templateID": "base", "autoPause": True, "autoPauseMemory": False,
            "autoResume": {"enabled": True}})
    assert r.status_code == 400, r.text
