"""File metadata (envd 0.6.2) with the unmodified ``e2b`` SDK: ``files.write(metadata=)`` sends
``X-Metadata-*`` headers, rollbox stores them as the file's ``user.e2b.*`` extended attributes
on the sandbox's writable layer (hostfs, in-root, set before the file appears), and stat, list,
rename and watch entries carry them back; they survive fork and snapshot; a sandbox's own
``setxattr`` shows too. Bad keys and values are typed 400s, nothing written. On a microVM the
same attributes go through the agent's ``rollbox-xattr`` in the guest (the edge calls envd
makes, as E2B's front door creates no microVMs).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from rollbox.compat.e2b import envd
from rollbox.models import ExecSpec
from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node, microvm_sandbox

e2b = pytest.importorskip("e2b")

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not have_image("debian:bookworm"), reason="debian:bookworm not built"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[tuple[str, str, Any]]:
    async with e2b_node("e2b-meta") as node:
        yield node


async def test_metadata_round_trip_fork_snapshot(env: tuple[str, str, Any]) -> None:
    from e2b import AsyncSandbox
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    url, key, edge = env
    sbx = await AsyncSandbox.create(timeout=120)
    made: list[Any] = [sbx]
    try:
        info = await sbx.files.write("m.txt", "x", metadata={"author": "mish", "Purpose": "up"})
        assert info.metadata == {"author": "mish", "purpose": "up"}  # keys lowercased
        assert (await sbx.files.get_info("m.txt")).metadata == {"author": "mish",
                                                                "purpose": "up"}
        octet = await sbx.files.write("o.txt", "x", metadata={"k": "v"}, use_octet_stream=True)
        assert octet.metadata == {"k": "v"}
        many = await sbx.files.write_files([WriteEntry(path="d/a", data="1"),
                                            WriteEntry(path="d/b", data="2")],
                                           metadata={"src": "suite"})
        assert [i.metadata for i in many] == [{"src": "suite"}] * 2
        listed = {e.name: e.metadata for e in await sbx.files.list("d")}
        assert listed == {"a": {"src": "suite"}, "b": {"src": "suite"}}
        renamed = await sbx.files.rename("m.txt", "n.txt")
        assert renamed.metadata == {"author": "mish", "purpose": "up"}
        # overwriting without metadata: the new file has none
        assert (await sbx.files.write("o.txt", "y")).metadata is None
        assert (await sbx.files.get_info("o.txt")).metadata is None
        # set inside the sandbox by its own user: surfaces as metadata (prefix stripped)
        await sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/o.txt', "
                               "'user.e2b.author', b'in'); os.setxattr('/home/user/o.txt', "
                               "'user.other', b'hidden')\"")
        assert (await sbx.files.get_info("o.txt")).metadata == {"author": "in"}
        # the sandbox sees what the upload set (the attribute is the file's)
        got = await sbx.commands.run("python3 -c \"import os; print(os.getxattr("
                                     "'/home/user/n.txt', 'user.e2b.author').decode())\"")
        assert got.stdout == "mish\n"
        # a watch event's entry carries it too (envd 0.6.3 include_entry)
        events: list[Any] = []
        handle = await sbx.files.watch_dir("d", on_event=events.append, include_entry=True)
        try:
            await sbx.files.write("d/c", "3", metadata={"w": "1"})
            for _ in range(50):
                if any(e.entry is not None and e.entry.metadata == {"w": "1"} for e in events):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"no watch event with the metadata: {events}")
        finally:
            await handle.stop()

        kids = await sbx.fork(count=1, timeout=60)
        made += kids
        assert (await kids[0].files.get_info("n.txt")).metadata == {"author": "mish",
                                                                   "purpose": "up"}
        snap = await sbx.create_snapshot()
        from_snap = await AsyncSandbox.create(snap.snapshot_id, timeout=60)
        made.append(from_snap)
        assert (await from_snap.files.get_info("/home/user/d/a")).metadata == {"src": "suite"}

        # bad input on the wire (the SDK validates first): typed 400, nothing written
        async with httpx.AsyncClient(timeout=10) as c:
            for headers in ({"X-Metadata-k": b"caf\xe9"}, {"X-Metadata-k": "a\tb"},
                            {"X-Metadata-big": "v" * 5000}):
                r = await c.post(f"{url}/e2b/envd/files", params={"path": "/home/user/bad"},
                                 content=b"x", headers={
                                     "X-Access-Token": sbx._envd_access_token or "",
                                     "Content-Type": "application/octet-stream", **headers})
                assert r.status_code == 400, (headers, r.status_code, r.text)
        assert not await sbx.files.exists("bad")
    finally:
        await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
        for img in await edge.image_list(None):
            if img.name.startswith("e2b-meta/e2b-snap-"):
                await edge.image_delete(img.name, None)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


@pytest.mark.skipif(not have_image("busybox:test"), reason="busybox:test not built")
async def test_metadata_on_a_microvm(env: tuple[str, str, Any]) -> None:
    url, key, edge = env
    sb = await microvm_sandbox(edge, "e2b-meta")
    try:
        meta = {"user.e2b.author": "mish", "user.e2b.purpose": "up"}
        want = {"author": "mish", "purpose": "up"}
        await edge.file_write_stream(sb.id, "/d/m.txt", _once(b"x"), 0o644, 1 << 20,
                                     xattrs=meta)
        assert envd.metadata_of_stat(await edge.file_stat(sb.id, "/d/m.txt")) == want
        assert [envd.metadata_of_stat(f) for f in await edge.file_list(sb.id, "/d")] == [want]
        # rename as envd's Move does it (mv in the sandbox): the attributes are the file's
        r = await edge.exec_wait(sb.id, await edge.exec_start(
            sb.id, ExecSpec(cmd=["mv", "-f", "--", "/d/m.txt", "/d/n.txt"])))
        assert r.exit_code == 0, r
        entry = envd.entry_info(await edge.file_stat(sb.id, "/d/n.txt"), "/d/n.txt")
        assert entry["metadata"] == want
        # a watch event's entry (include_entry)
        (ev,) = await envd.with_entries(edge, sb.id, "/d", [
            {"type": "EVENT_TYPE_CREATE", "name": "n.txt"}])
        assert ev["entry"]["metadata"] == want
        # overwritten without metadata: none
        await edge.file_write_stream(sb.id, "/d/n.txt", _once(b"y"), 0o644, 1 << 20)
        assert envd.metadata_of_stat(await edge.file_stat(sb.id, "/d/n.txt")) is None
    finally:
        await edge.delete(sb.id)
