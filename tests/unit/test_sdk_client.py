"""SDK (async and sync faces) against the api app with the test-only FakeEdge, called
in-process (ASGITransport: no server); the sync face also over a real uvicorn on loopback, and
a refused connection over HTTP."""
from __future__ import annotations

import asyncio
import time
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.sdk import ASGITransport
from test_api_support import ApiStack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ApiStack]:
    async with ApiStack(tmp_path, serve=False) as s:
        yield s


@pytest.fixture
async def client(stack: ApiStack) -> AsyncIterator[rollbox.AsyncClient]:
    async with stack.client(stack.key_a) as c:
        yield c


async def test_create_exec_stream_and_check(client: rollbox.AsyncClient) -> None:
    async with await client.create("debian", labels={"job": "t"}, cpus=0.5, ttl_s=60) as sb:
        assert sb.info.resources.cpus == 0.5 and sb.info.labels == {"job": "t"}
        out: list[str] = []
        err: list[str] = []
        times: list[float] = []
        loop = asyncio.get_running_loop()

        def on_out(s: str) -> None:
            out.append(s)
            times.append(loop.time())

        t0 = loop.time()
        res = await sb.exec("echo héllo; sleep 0.5; echo bye >&2; exit 2",
                            on_stdout=on_out, on_stderr=err.append)
        assert res.exit_code == 2 and "".join(out) == "héllo\n" and "".join(err) == "bye\n"
        assert times[0] - t0 < 0.4  # streamed before the command ended, not at exit
        with pytest.raises(rollbox.CommandFailed) as ei:
            await sb.exec(["sh", "-c", "exit 5"], check=True)
        assert ei.value.result.exit_code == 5
        res = await sb.exec("cat; echo -n $FOO", stdin=b"in-data ", env={"FOO": "bar"})
        assert res.stdout == "in-data bar"
        res = await sb.exec("sleep 5", timeout=0.3)
        assert res.timed_out
        with pytest.raises(rollbox.CommandTimeout):
            await sb.exec("sleep 5", timeout=0.3, check=True)
        with pytest.raises(rollbox.BadRequest):
            await sb.exec("pwd", cwd="relative")
    with pytest.raises(rollbox.NotFound):
        await client.get(sb.id)  # the context manager deleted it


async def test_background_process_attach_stdin_kill(client: rollbox.AsyncClient) -> None:
    sb = await client.create("debian")
    try:
        proc = await sb.exec_background("cat", stdin=True)
        await proc.write_stdin("abc")
        await proc.close_stdin()
        chunks = [c async for c in proc.attach()]
        assert b"".join(c.data for c in chunks) == b"abc" and chunks[0].stream == "stdout"
        assert (await proc.wait()).stdout == "abc"
        again = [c.text async for c in sb.process(proc.exec_id).attach()]  # re-attach replays
        assert "".join(again) == "abc"

        sleeper = await sb.exec_background("sleep 30")
        running = {p.exec_id: p.state for p in await sb.processes()}
        assert running[sleeper.exec_id] == "running" and running[proc.exec_id] == "exited"
        await sleeper.kill()
        assert (await sleeper.wait()).signal == 9
    finally:
        await sb.delete()


async def test_files_and_dirs(client: rollbox.AsyncClient, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "pkg" / "deep" / "big.bin").write_bytes(b"\x01" * 1_500_000)
    async with await client.create("debian") as sb:
        await sb.files.write("/hello.txt", "hi there", mode=0o600)
        assert await sb.files.read_text("/hello.txt") == "hi there"
        st = await sb.files.stat("/hello.txt")
        assert st.size == 8 and st.mode == 0o600
        await sb.files.mkdir("/a/b/c")
        assert [f.name for f in await sb.files.list("/a")] == ["b"]
        with pytest.raises(rollbox.NotFound):
            await sb.files.read("/nope")
        written = await sb.files.upload_dir(src, "/work")
        assert written > 1_500_000
        assert await sb.files.read("/work/pkg/a.py") == b"print('a')\n"
        dst = tmp_path / "dst"
        await sb.files.download_dir("/work", dst)
        assert (dst / "pkg" / "deep" / "big.bin").read_bytes() == b"\x01" * 1_500_000
        await sb.files.remove("/work", recursive=True)
        with pytest.raises(rollbox.NotFound):
            await sb.files.stat("/work")


async def test_events_after_delete_and_list(client: rollbox.AsyncClient) -> None:
    sb = await client.create("debian", labels={"grp": "g1"})
    other = await client.create("debian", labels={"grp": "g2"})
    try:
        assert [s.id for s in await client.list({"grp": "g1"})] == [sb.id]
        await sb.exec("echo audit-me")
        await sb.set_ttl(10)
        follower = asyncio.create_task(sb.events(follow=True))
        await asyncio.sleep(0.2)
        await sb.delete()
        followed = await asyncio.wait_for(follower, 10)
        evs = await sb.events()
        assert followed == evs
        assert [e.kind for e in evs] == [
            "sandbox.created", "sandbox.requested", "exec.started", "exec.stdout",
            "exec.exited", "sandbox.ttl", "sandbox.requested", "sandbox.deleted"]
        assert evs[3].data == "audit-me\n"
    finally:
        await other.delete()


async def test_errors_are_typed_and_connection_failure_is_infra(
        stack: ApiStack, client: rollbox.AsyncClient) -> None:
    async with stack.client("rbx_wrong") as bad:
        with pytest.raises(rollbox.Unauthorized):
            await bad.list()
    with pytest.raises(rollbox.BadRequest):
        await client.create("debian", cpus=-1)
    sb = await client.create("debian")
    stack.edges[0].inject["get"] = errors.SandboxDead("oom-killed")
    with pytest.raises(rollbox.SandboxDead) as ei:
        await client.get(sb.id)
    assert "oom" in ei.value.message
    del stack.edges[0].inject["get"]
    async with rollbox.AsyncClient("http://127.0.0.1:9", "rbx_x", timeout=2) as dead:
        with pytest.raises(rollbox.InfraError) as ei2:
            await dead.list()
        assert ei2.value.retryable


async def test_qos_class_through_the_sdk(stack: ApiStack, client: rollbox.AsyncClient) -> None:
    """The SDK passes qos on; an unknown class is a typed bad_request and nothing is made."""
    sb = await client.create("debian", qos="latency")
    assert sb.info.qos == "latency"
    assert (await client.create("debian")).info.qos == "batch"  # the default
    made = stack.edges[0].creates
    with pytest.raises(rollbox.BadRequest) as ei:
        await client.create("debian", qos="urgent")
    assert "qos" in ei.value.message and stack.edges[0].creates == made


async def test_create_many_bounded_with_retries(tmp_path: Path) -> None:
    async with ApiStack(tmp_path, nodes=("n0",), max_sandboxes=3, serve=False) as s:
        edge = s.edges[0]
        async with s.client(s.key_a) as c:

            freed_at: list[float] = []

            async def free_later() -> None:
                await asyncio.sleep(0.3)
                edge.max_sandboxes = 8  # capacity comes back while creators back off
                freed_at.append(time.time())

            freer = asyncio.create_task(free_later())
            sbs = await c.create_many(8, "debian", concurrency=4, backoff_s=0.05)
            await freer
            assert len({sb.id for sb in sbs}) == 8
            # 3 fit at first: the others were refused (by placement, from the view) and
            # retried until the room came back
            assert sum(sb.info.created_at > freed_at[0] for sb in sbs) >= 5

            edge.max_sandboxes = 10
            with pytest.raises(rollbox.CapacityExceeded):
                await c.create_many(4, "debian", max_attempts=2, backoff_s=0.01)
            assert len(edge.sandboxes) == 8  # the partial batch was cleaned up


@pytest.fixture(params=["http", "asgi"])
def sync_client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[rollbox.Client]:
    """A blocking client of a stack: over HTTP (the stack on its own loop thread, the client
    on its private one), or in-process (the app then runs on the client's private loop)."""
    if request.param == "asgi":
        s = ApiStack(tmp_path, serve=False)
        try:
            with rollbox.Client(api_key=s.key_a, transport=ASGITransport(s.app)) as c:
                yield c
        finally:
            asyncio.run(s.close())
        return
    ready = threading.Event()
    stop: asyncio.Event | None = None
    holder: dict[str, ApiStack] = {}
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with ApiStack(tmp_path) as s:
            holder["s"] = s
            ready.set()
            await stop.wait()

    t = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    t.start()
    try:
        assert ready.wait(10)
        s = holder["s"]
        with rollbox.Client(s.url, s.key_a) as c:
            yield c
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        t.join(30)
        loop.close()


def test_sync_client_mirrors_async(sync_client: rollbox.Client) -> None:
    c = sync_client
    assert c.health()["status"] == "ok"
    with c.create("debian", labels={"k": "v"}) as sb:
        got: list[str] = []
        res = sb.exec("echo sync", on_stdout=got.append)
        assert res.stdout == "sync\n" and got == ["sync\n"]
        proc = sb.exec_background("echo bg; echo err >&2")
        chunks = list(proc.attach())
        assert {c_.stream for c_ in chunks} == {"stdout", "stderr"}
        assert proc.wait().exit_code == 0
        sb.files.write("/f", b"data")
        assert sb.files.read("/f") == b"data"
        assert [x.id for x in c.list({"k": "v"})] == [sb.id]
        evs: Iterator[rollbox.Event] = sb.stream_events(follow=False)
        assert next(evs).kind == "sandbox.created"
        evs.close()  # type: ignore[attr-defined]
    with pytest.raises(rollbox.NotFound):
        c.get(sb.id)
    many = c.create_many(3, "debian")
    assert len(many) == 3
    for m in many:
        m.delete()
