"""Trainer jobs against a real ``rollbox serve`` process: a training step that blocks the
trainer's event loop keeps its job (heartbeats come from their own thread), and a trainer
killed mid-``create_many(16)`` leaves nothing once 3 heartbeats are missed."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollbox
from rollbox.embedded import server_process
from tests.conftest import TEST_RUN, node_settings

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, str]]:
    """A ``rollbox serve`` child on a test node, shared by this module's tests (it starts in
    seconds); every sandbox is deleted before it stops."""
    root = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-"))
    root.chmod(0o711)  # as tmp_node_dir: runc resolves the rootfs as the sandbox's host uid
    try:
        with server_process(settings=node_settings(root)) as (url, key):
            try:
                yield url, key
            finally:
                with rollbox.Client(url, key) as c:
                    for sb in c.list():
                        sb.delete()
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_blocked_event_loop_keeps_the_job(server: tuple[str, str]) -> None:
    url, key = server
    async with rollbox.AsyncClient(url, key) as c:
        # 1.5 s, not less: a heartbeat must not miss its deadline on a loaded test machine
        async with c.job("blocked-step", heartbeat_s=1.5) as job:
            sb = await job.create(BB)
            time.sleep(5.0)  # a training step holding the loop for > 3 heartbeats
            assert job.lost is None
            assert [s.id for s in await job.list()] == [sb.id]
            assert (await sb.exec("echo alive")).stdout == "alive\n"
        assert await c.list() == []  # leaving the block ended the job and deleted it

        # The sync face: same job semantics; a client closed with its job still open stops
        # heartbeating, so the job expires and takes its sandbox along.
        with rollbox.Client(url, key) as sync:
            with sync.job("sync-ended", heartbeat_s=1.0) as ended:
                assert ended.create(BB).info.job == "sync-ended"
                assert len(ended.list()) == 1
            assert sync.list() == [] and ended.info is not None and ended.info.state == "ended"
            left_open = sync.job("sync-left-open", heartbeat_s=0.5).open()
            orphan = left_open.create(BB)
        deadline = time.monotonic() + 15
        while ((await c.get(orphan.id)).info.state in ("running", "stopping")
               and time.monotonic() < deadline):
            await asyncio.sleep(0.1)
        assert (await c.get(orphan.id)).info.state == "deleted"


TRAINER = textwrap.dedent("""
    import asyncio, sys, rollbox

    async def main():
        async with rollbox.AsyncClient(sys.argv[1], sys.argv[2]) as c:
            job = await c.job("killed", heartbeat_s=1.0).open()
            await job.create_many(16, "busybox:test")  # all 16 requests in flight at once
            print("all created", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_killed_trainer_leaves_no_sandboxes(server: tuple[str, str]) -> None:
    url, key = server
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, url, key],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async with rollbox.AsyncClient(url, key) as c:
            deadline = time.monotonic() + 60
            seen: set[str] = set()
            while not seen and time.monotonic() < deadline:
                assert trainer.poll() is None, trainer.stderr.read() if trainer.stderr else ""
                seen |= {s.id for s in await c.list(job="killed")}
                await asyncio.sleep(0.01)
            assert seen
            trainer.send_signal(signal.SIGKILL)  # at the first sandbox: mid-create_many
            trainer.wait()
            # Creates still in flight finish on the server; all of them go with the job.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = await c.list(job="killed")
                seen |= {s.id for s in left}
                job = [j for j in await c.jobs() if j.name == "killed"][0]
                if not left and job.state == "expired":
                    break
                await asyncio.sleep(0.2)
            assert await c.list() == [], "the killed trainer's sandboxes outlived its lease"
            assert job.state == "expired" and "heartbeats missed" in (job.reason or "")
            for sid in seen:
                info = (await c.get(sid)).info
                assert info.state == "deleted" and "killed" in (info.dead_reason or ""), info
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
