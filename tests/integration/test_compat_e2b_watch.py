"""E2B's directory watch on an inotify watch inside the sandbox (rollbox.compat.e2b.watch, the
agent's built-in ``rollbox-watch``), with the unmodified ``e2b`` SDK: what the sandbox's own
commands do arrives as envd reports it (create, write, chmod, rename, remove; recursive into new
directories), a write through envd is the file's create and write (its temp file never shows),
a sync poll returns every event of what returned before it, the watch ends with the sandbox, a
path the sandbox points elsewhere by a symlink resolves inside the sandbox, the event queue is
bounded; and the same tool on a microVM, through the edge.
"""
from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from rollbox import errors
from rollbox.compat.e2b import connectrpc as rpc
from rollbox.compat.e2b import watch as W
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node, microvm_sandbox

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[tuple[str, str, Any]]:
    async with e2b_node("e2b-watch") as node:
        yield node


async def _until(pred: Any, got: list[Any], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred(got):
            await asyncio.sleep(0.02)


def _pairs(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.name, e.type.value) for e in events]


async def test_watch_reports_inotify_events_and_ends_with_the_sandbox(
        env: tuple[str, str, Any]) -> None:
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(timeout=120)
    try:
        await sbx.commands.run("mkdir -p w/old")
        got: list[Any] = []
        ended: list[Any] = []
        handle = await sbx.files.watch_dir("w", on_event=got.append, recursive=True,
                                           on_exit=ended.append)
        # the sandbox's own commands, one kind of change each
        await sbx.commands.run("echo x > w/a")
        await sbx.commands.run("chmod 600 w/a")
        await sbx.commands.run("mv w/a w/b")
        await sbx.commands.run("rm w/b")
        await sbx.commands.run("mkdir w/new")
        await sbx.commands.run("echo y > w/new/f; echo z > w/old/g")
        want = [("a", "create"), ("a", "write"), ("a", "chmod"), ("a", "rename"),
                ("b", "create"), ("b", "remove"), ("new", "create"), ("new/f", "create"),
                ("new/f", "write"), ("old/g", "create"), ("old/g", "write")]
        await _until(lambda g: all(p in _pairs(g) for p in want), got)
        assert [p for p in _pairs(got) if p in want] == want  # in order
        # a write through envd: the file's create and write (and the chown's chmod to user);
        # the temp file it is written as and renamed from never shows
        got.clear()
        await sbx.files.write("w/up.txt", "hello")
        await _until(lambda g: ("up.txt", "write") in _pairs(g), got)
        await asyncio.sleep(0.3)
        assert not [n for n, _ in _pairs(got) if W.TMP_PREFIX in n], _pairs(got)
        assert _pairs(got)[:2] == [("up.txt", "create"), ("up.txt", "write")]
        # the watch ends with the sandbox (its tool is one of the sandbox's processes)
        await sbx.kill()
        await _until(lambda e: len(e) > 0, ended, timeout=30)
        await handle.stop()
    finally:
        await sbx.kill()


async def test_sync_poll_barrier_and_symlink_in_sandbox(env: tuple[str, str, Any]) -> None:
    from e2b import Sandbox

    url, key, edge = env
    host_dir = Path(tempfile.mkdtemp(prefix="rollbox-watch-host-"))

    def sync_part() -> str:
        sbx = Sandbox.create(timeout=120)
        try:
            sbx.files.make_dir("s")
            h = sbx.files.watch_dir("s")
            sbx.files.write("s/f.txt", "one")
            # every event of the write that returned, in this one poll (no sleep)
            assert [(e.name, e.type.value) for e in h.get_new_events()] == [
                ("f.txt", "create"), ("f.txt", "write"), ("f.txt", "chmod")]
            sbx.commands.run("rm s/f.txt")
            assert [(e.name, e.type.value) for e in h.get_new_events()] == [
                ("f.txt", "remove")]
            assert h.get_new_events() == []
            h.stop()
            # a symlink to a host path: resolved in the sandbox, where it names nothing
            sbx.commands.run(f"ln -s {host_dir} /tmp/l")
            with pytest.raises(e2b.SandboxException):
                sbx.files.watch_dir("/tmp/l")
            return sbx.sandbox_id
        finally:
            sbx.kill()

    sid = await asyncio.to_thread(sync_part)
    assert sid
    host_dir.rmdir()


async def test_tool_resolves_in_the_sandbox_and_queue_is_bounded(
        env: tuple[str, str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    url, key, edge = env
    host_dir = Path(tempfile.mkdtemp(prefix="rollbox-watch-host-"))
    sb = await edge.create(SandboxSpec(image="debian:bookworm"), "e2b-watch")
    try:
        async def sh(cmd: str) -> None:
            r = await edge.exec_wait(sb.id, await edge.exec_start(sb.id, ExecSpec(cmd=cmd)))
            assert r.exit_code == 0, r

        # the path swapped for a symlink after any host-side check: the tool itself resolves
        # it in the sandbox's root (the host directory does not exist there)
        await sh(f"ln -s {host_dir} /tmp/swapped; mkdir /tmp/d; ln -s / /tmp/root")
        with pytest.raises(errors.NotFound):  # a magic link is never followed
            await W.InotifyWatch(sb.id, "/proc/1/root", False, False).start(edge)
        w = W.InotifyWatch(sb.id, "/tmp/swapped", False, False)
        with pytest.raises(errors.NotFound):
            await w.start(edge)
        # a symlink to / watches the sandbox's /, not the host's
        w = W.InotifyWatch(sb.id, "/tmp/root", False, False)
        await w.start(edge)
        (host_dir / "host-only").write_text("x")
        await sh("touch /sandbox-only")
        names = {e["name"] for e in await w.poll()}
        assert "sandbox-only" in names and "host-only" not in names
        await w.close()
        # more unread events than the queue holds: the watch fails, it does not grow
        monkeypatch.setattr(W, "QUEUE_MAX", 50)
        w = W.InotifyWatch(sb.id, "/tmp/d", False, False)
        await w.start(edge)
        await sh("for i in $(seq 100); do : > /tmp/d/f$i; done")
        with pytest.raises(rpc.ConnectError, match="events lost"):
            await w.poll()
        await w.close()
    finally:
        await edge.delete(sb.id)
        (host_dir / "host-only").unlink(missing_ok=True)
        host_dir.rmdir()


async def test_sync_watchers_go_with_their_sandbox(env: tuple[str, str, Any]) -> None:
    """envd's table of sync watchers (CreateWatcher): a deleted sandbox's watchers go from it
    at once, not when the caps push them out; another sandbox's stay, and so does a watcher
    whose tool ended (its directory removed) while its sandbox runs."""
    url, key, edge = env
    table = W.SyncWatchers(lambda sid: edge)
    a = await edge.create(SandboxSpec(image="debian:bookworm"), "e2b-watch")
    b = await edge.create(SandboxSpec(image="debian:bookworm"), "e2b-watch")
    try:
        async def sh(sid: str, cmd: str) -> None:
            r = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd)))
            assert r.exit_code == 0, r

        async def watch(sid: str, path: str) -> str:
            return await table.add(W.InotifyWatch(sid, path, False, False, table.ended), edge)

        await sh(a.id, "mkdir /tmp/x /tmp/y")
        await sh(b.id, "mkdir /tmp/x /tmp/y")
        of_a = {await watch(a.id, "/tmp/x"), await watch(a.id, "/tmp/y")}
        of_b = {await watch(b.id, "/tmp/x"), await watch(b.id, "/tmp/y")}
        assert set(table.ids_of(a.id)) == of_a and set(table.ids_of(b.id)) == of_b
        # the control: b's /tmp/y is removed; its watch's tool ends (the tool holds it open,
        # so by its link count, not inotify's delete-self), b runs: the watcher stays
        y = next(wid for wid in of_b if table.get(b.id, wid).path == "/tmp/y")
        await sh(b.id, "rmdir /tmp/y")
        got: list[tuple[str, str]] = []
        async with asyncio.timeout(10):
            async for events in table.get(b.id, y).stream():
                got += [(e["name"], e["type"]) for e in events]
        assert got == [("", "EVENT_TYPE_REMOVE")]
        await asyncio.sleep(0.5)  # the table's check of b has run by now
        assert set(table.ids_of(b.id)) == of_b
        # a deleted: both its watchers leave the table (a's tools ended with it)
        await edge.delete(a.id)
        async with asyncio.timeout(30):
            while table.ids_of(a.id):
                await asyncio.sleep(0.05)
        assert set(table.ids_of(b.id)) == of_b
        with pytest.raises(rpc.ConnectError, match="not found"):
            table.get(a.id, next(iter(of_a)))
    finally:
        for sid in (a.id, b.id):
            for wid in table.ids_of(sid):
                await table.remove(wid)
            with contextlib.suppress(errors.NotFound):
                await edge.delete(sid)


@pytest.mark.skipif(not have_image("busybox:test"), reason="busybox:test not built")
async def test_watch_tool_on_a_microvm(env: tuple[str, str, Any]) -> None:
    url, key, edge = env
    sb = await microvm_sandbox(edge, "e2b-watch")
    try:
        async def sh(cmd: str) -> None:
            r = await edge.exec_wait(sb.id, await edge.exec_start(sb.id, ExecSpec(cmd=cmd)))
            assert r.exit_code == 0, r

        await sh("mkdir -p /tmp/w/sub; ln -s /proc/1/root /tmp/agent-root")
        # the agent (PID 1) lives in the initramfs: its root is a magic link the tool never
        # follows, named directly or through a symlink
        for path in ("/proc/1/root", "/tmp/agent-root", "/proc/self/root"):
            with pytest.raises(errors.NotFound):
                await W.InotifyWatch(sb.id, path, False, False).start(edge)
        w = W.InotifyWatch(sb.id, "/tmp/w", True, False)
        await w.start(edge)
        await sh("echo x > /tmp/w/a; chmod 600 /tmp/w/a; mv /tmp/w/a /tmp/w/sub/b; rm /tmp/w/sub/b")
        await edge.file_write(sb.id, "/tmp/w/up", b"through the agent", 0o644)
        got = [(e["name"], e["type"]) for e in await w.poll()]
        for p in [("a", "EVENT_TYPE_CREATE"), ("a", "EVENT_TYPE_WRITE"),
                  ("a", "EVENT_TYPE_CHMOD"), ("a", "EVENT_TYPE_RENAME"),
                  ("sub/b", "EVENT_TYPE_CREATE"), ("sub/b", "EVENT_TYPE_REMOVE"),
                  ("up", "EVENT_TYPE_CREATE"), ("up", "EVENT_TYPE_WRITE")]:
            assert p in got, got
        assert not [n for n, _ in got if W.TMP_PREFIX in n], got
        await w.close()
    finally:
        await edge.delete(sb.id)
