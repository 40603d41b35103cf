"""The SDK fails over between real API replicas: two (or three) uvicorn servers on their own
ports, each a create_app of its own (a stateless replica) over the same real edge, placement,
keys and leases of one node, real sandboxes. A replica is killed the way a crashed process
looks to its clients (listening socket closed, every connection reset at once); its handlers
run on in this process, as the edge's work does when a remote replica dies.

(a) a URL list whose first entry is dead works and pays that URL one connect attempt;
(b) a replica killed mid-stream of a long exec (and of an attach): the SDK re-attaches on
    another at its offsets, the output complete, in order, exactly once;
(c) a replica killed mid-create: the SDK sends it again with its idempotency key, exactly one
    sandbox exists afterwards;
(d) every replica dead: typed errors (ServerUnreachable naming how many URLs were tried);
(e) a replica killed mid-transfer: bytes and tar uploads sent again whole, a tar download
    downloaded again, an upload from a one-shot stream a retryable ConnectionLost.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore
from rollbox.watcher import placement_over
from rollbox.sdk import AsyncClient, Client
from rollbox.sdk._failover import FailoverTransport
from tests.conftest import have_image

BB = "busybox:test"
pytestmark = pytest.mark.skipif(not have_image(BB), reason=f"{BB} not built (make images)")
# 2000 numbered lines, a pause every 100: ~2 s, long enough to kill a replica mid-way.
LONG = 'for i in $(seq 1 2000); do echo $i; [ $((i % 100)) = 0 ] && sleep 0.1; done; echo done'
LONG_OUT = "".join(f"{i}\n" for i in range(1, 2001)) + "done\n"


def dead_url() -> str:
    """A loopback port nothing listens on (connects are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class Replicas:
    """API replicas over one node: ``start()`` another, ``kill(url)`` one (clients see a
    crash: refused connects, reset connections), all stopped at the end."""

    def __init__(self, edge, keys: KeyStore) -> None:  # noqa: ANN001
        self.edge = edge
        self.keys = keys
        self.servers: dict[str, BackgroundServer] = {}

    async def start(self) -> str:
        app = create_app(placement_over([self.edge]), self.keys,
                         leases=self.edge.leases)
        srv = BackgroundServer(app)
        url = await srv.start()
        self.servers[url] = srv
        return url

    def kill(self, url: str) -> None:
        server = self.servers[url].server
        for listener in server.servers:
            listener.close()  # new connects refused from now on
        for conn in list(server.server_state.connections):
            conn.transport.abort()  # RST: open requests and streams break mid-way

    async def stop(self) -> None:
        for srv in self.servers.values():
            await srv.stop()
        self.servers.clear()


@pytest.fixture
async def replicas(edge, tmp_path: Path) -> AsyncIterator[Replicas]:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    r = Replicas(edge, keys)
    try:
        yield r
    finally:
        await r.stop()
        keys.close()


def count_attempts(client: AsyncClient, i: int) -> list[str]:
    """The requests handed to URL ``i``'s transport (each a connect attempt when it is down)."""
    pool = client._t.transport
    assert isinstance(pool, FailoverTransport)
    transport = pool.places[i].transport
    seen: list[str] = []
    handle = transport.handle

    async def counted(request):  # noqa: ANN001, ANN202
        seen.append(request.target)
        return await handle(request)

    transport.handle = counted  # type: ignore[method-assign]
    return seen


def creating(edge) -> list[str]:  # noqa: ANN001
    return [info.id for info, _, _ in edge.journal.live() if info.state == "creating"]


async def test_a_dead_first_url_costs_one_connect_attempt(
        replicas: Replicas, edge) -> None:  # noqa: ANN001
    a = await replicas.start()
    key = replicas.keys.create("fo")
    dead = dead_url()
    async with AsyncClient([dead, a], key, url_backoff_s=0.2) as client:
        to_dead = count_attempts(client, 0)
        sb = await client.create(BB)
        try:
            r = await sb.exec("echo hi")
            assert (r.exit_code, r.stdout) == (0, "hi\n")
            await sb.files.write("/tmp/f", b"data")
            assert await sb.files.read("/tmp/f") == b"data"
            await asyncio.sleep(0.3)  # the dead URL's back-off is over: order stays sticky
            assert [x.id for x in await client.list()] == [sb.id]
            out: list[str] = []
            await sb.exec("echo a; echo b", on_stdout=out.append)
            assert "".join(out) == "a\nb\n"
            assert to_dead == ["/v1/sandboxes"] and client.base_url == a
        finally:
            await sb.delete()

    def sync_face() -> tuple[str, str]:  # the blocking Client, on a thread of its own
        with Client(f"{dead},{a}", key) as c:
            with c.create(BB) as box:
                return box.exec("echo sync").stdout, c.base_url

    assert await asyncio.to_thread(sync_face) == ("sync\n", a)
    assert edge.live == {}


async def test_a_replica_killed_mid_stream_the_sdk_reattaches_on_another(
        replicas: Replicas, edge) -> None:  # noqa: ANN001
    urls = [await replicas.start(), await replicas.start(), await replicas.start()]
    key = replicas.keys.create("fo")
    async with AsyncClient(urls, key, reconnect_s=20) as client:
        sb = await client.create(BB)
        try:
            # exec, streamed to a callback: kill the replica it streams from at line ~300
            got: list[str] = []
            seen = asyncio.Event()

            def on_stdout(text: str) -> None:
                got.append(text)
                if "300\n" in "".join(got[-3:]):
                    seen.set()

            run = asyncio.ensure_future(sb.exec(LONG, on_stdout=on_stdout))
            async with asyncio.timeout(30):
                await seen.wait()
            first = client.base_url
            replicas.kill(first)
            async with asyncio.timeout(60):
                result = await run
            assert result.exit_code == 0 and result.stdout_truncated_bytes == 0
            text = "".join(got)
            assert text == LONG_OUT, (len(text), text[:80])  # complete, in order, once
            assert client.base_url != first

            # attach() to a background command: the same on the replica it moved to
            proc = await sb.exec_background(LONG)
            chunks: list[bytes] = []
            second = client.base_url
            killed = False
            async with asyncio.timeout(60):
                async for chunk in proc.attach():
                    chunks.append(chunk.data)
                    if not killed and b"500\n" in b"".join(chunks[-3:]):
                        replicas.kill(second)
                        killed = True
            assert killed and b"".join(chunks).decode() == LONG_OUT
            assert proc.truncated == {"stdout": 0, "stderr": 0}
            assert (await proc.wait()).exit_code == 0
            assert client.base_url not in (first, second)
        finally:
            await sb.delete()
    assert edge.live == {}


async def test_a_replica_killed_mid_create_leaves_exactly_one_sandbox(
        replicas: Replicas, edge) -> None:  # noqa: ANN001
    a, b = await replicas.start(), await replicas.start()
    key = replicas.keys.create("fo")
    async with AsyncClient([a, b], key) as client:
        create = asyncio.ensure_future(client.create(BB, labels={"t": "mid-create"}))
        async with asyncio.timeout(30):
            while not creating(edge):
                assert not create.done(), "the create ended before it was seen under way"
                await asyncio.sleep(0.001)
        replicas.kill(a)  # the create runs on in the edge; the SDK sends it again to b
        async with asyncio.timeout(60):
            sb = await create
        try:
            listed = await client.list()
            assert [x.id for x in listed] == [sb.id] and list(edge.live) == [sb.id]
            assert sb.info.idempotency_key is not None and client.base_url == b
            r = await sb.exec("echo whole")
            assert r.stdout == "whole\n"
            # the key's sandbox lives: the same key and spec is that sandbox, another spec
            # is a conflict; neither makes one
            again = await client.create(BB, labels={"t": "mid-create"},
                                        idempotency_key=sb.info.idempotency_key)
            assert again.id == sb.id
            with pytest.raises(errors.IdempotencyConflict):
                await client.create(BB, idempotency_key=sb.info.idempotency_key)
            assert list(edge.live) == [sb.id]
        finally:
            await sb.delete()
    assert edge.live == {}


async def test_every_replica_dead_is_a_typed_error(
        replicas: Replicas, edge) -> None:  # noqa: ANN001
    a, b = await replicas.start(), await replicas.start()
    key = replicas.keys.create("fo")
    async with AsyncClient([a, b], key, reconnect_s=0.5) as client:
        sb = await client.create(BB)
        try:
            replicas.kill(a)
            replicas.kill(b)
            async with asyncio.timeout(20):  # bounded: refused connects, no hang
                with pytest.raises(errors.ServerUnreachable) as exc:
                    await client.list()
                assert exc.value.details["tried"] == 2
                with pytest.raises(errors.ServerUnreachable) as exc:
                    await sb.exec("true")  # retried for reconnect_s, never reached a replica
                assert exc.value.details["tried"] == 2 and exc.value.retryable
        finally:
            c = await replicas.start()  # a replica again, to delete through the API
            async with AsyncClient([a, b, c], key) as again:
                with contextlib.suppress(errors.NotFound):
                    await (await again.get(sb.id)).delete()
    assert edge.live == {}


async def test_the_edge_keeps_create_keys_per_project_and_across_its_restart(
        restarts) -> None:  # noqa: ANN001
    """Edge.create's side of a retried create: concurrent creates with one key are one
    sandbox, the key is per project, another spec is a conflict, the key survives an edge
    restart (journaled in the SandboxInfo) and is free again once its sandbox is deleted."""
    from rollbox.models import Resources, SandboxSpec

    edge = await restarts.start()
    spec = SandboxSpec(image=BB, resources=Resources(cpus=1, memory_mib=128, disk_mib=64),
                       idempotency_key="k-1")
    made = await asyncio.gather(*(edge.create(spec, "p") for _ in range(3)))
    assert len({i.id for i in made}) == 1 and list(edge.live) == [made[0].id]
    other = await edge.create(spec, "q")  # another project's key space
    assert other.id != made[0].id
    with pytest.raises(errors.IdempotencyConflict):
        await edge.create(spec.model_copy(update={"labels": {"x": "y"}}), "p")
    await restarts.stop()
    edge = await restarts.start()
    assert (await edge.create(spec, "p")).id == made[0].id  # re-adopted with its key
    assert sorted(edge.live) == sorted([made[0].id, other.id])
    await edge.delete(made[0].id)
    fresh = await edge.create(spec, "p")
    assert fresh.id not in (made[0].id, other.id)
    for sid in (fresh.id, other.id):
        await edge.delete(sid)
    assert edge.live == {}


async def test_a_replica_killed_mid_transfer_uploads_and_tar_are_sent_again(
        replicas: Replicas, edge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Each transfer's replica is killed once its first chunk reached the edge: a bytes
    upload and a tar upload are sent again whole on the next replica, a tar download is
    downloaded again whole; an upload from a stream of chunks (which the SDK can not send
    again) raises ConnectionLost, retryable, and the file is left as it was."""
    import hashlib
    import os

    urls = [await replicas.start() for _ in range(5)]
    key = replicas.keys.create("fo")
    armed: set[str] = set()  # edge methods whose next first chunk kills the replica in use

    def tapped(name: str, client: AsyncClient) -> None:
        orig = getattr(edge, name)

        async def chunks_then_kill(chunks):  # noqa: ANN001, ANN202
            async for chunk in chunks:
                if name in armed:
                    armed.discard(name)
                    replicas.kill(client.base_url)
                yield chunk

        if name == "download_tar":
            monkeypatch.setattr(edge, name, lambda *a, **kw: chunks_then_kill(orig(*a, **kw)))
        else:  # (sandbox_id, path, chunks, ...)
            monkeypatch.setattr(edge, name, lambda sid, path, chunks, *a, **kw: orig(
                sid, path, chunks_then_kill(chunks), *a, **kw))

    async with AsyncClient(urls, key, reconnect_s=20) as client:
        for name in ("file_write_stream", "upload_tar", "download_tar"):
            tapped(name, client)
        sb = await client.create(BB)
        try:
            async def sha(path: str) -> str:
                return (await sb.exec(f"sha256sum {path}")).stdout.split()[0]

            data = os.urandom(24 << 20)
            armed.add("file_write_stream")
            first = client.base_url
            async with asyncio.timeout(60):
                await sb.files.write("/up.bin", data)
            assert not armed and client.base_url != first  # killed, then sent again
            assert await sha("/up.bin") == hashlib.sha256(data).hexdigest()

            async def stream():  # noqa: ANN202
                for i in range(0, len(data), 1 << 20):
                    yield data[i:i + (1 << 20)][::-1]

            armed.add("file_write_stream")
            with pytest.raises(errors.ConnectionLost) as exc:
                await sb.files.write("/up.bin", stream())
            assert exc.value.retryable and not armed
            assert await sha("/up.bin") == hashlib.sha256(data).hexdigest()  # as it was

            src = tmp_path / "src"
            (src / "d").mkdir(parents=True)
            (src / "d" / "big").write_bytes(data)
            (src / "small").write_text("small\n")
            armed.add("upload_tar")
            async with asyncio.timeout(60):
                await sb.files.upload_dir(src, "/tree")
            assert not armed
            assert await sha("/tree/d/big") == hashlib.sha256(data).hexdigest()
            assert await sb.files.read_text("/tree/small") == "small\n"

            armed.add("download_tar")
            async with asyncio.timeout(60):
                await sb.files.download_dir("/tree", tmp_path / "back")
            assert not armed
            assert (tmp_path / "back" / "d" / "big").read_bytes() == data
            assert (tmp_path / "back" / "small").read_text() == "small\n"
        finally:
            monkeypatch.undo()
            await sb.delete()
    assert edge.live == {}
