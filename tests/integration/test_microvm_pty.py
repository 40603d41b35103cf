"""PTY exec on a real microVM (TCG) through the api and the SDK: the guest's agent opens the
terminal on the sandbox's own devpts (the same agent as in containers), its size follows a
resize, ctrl-C interrupts, the timeout kills, a re-attach replays from an offset. One VM (a
template restore when the node has one)."""
from __future__ import annotations

import asyncio
import re

import pytest

import rollbox
from rollbox import errors
from tests.helpers.vm_guest import real_guest_marks
from tests.helpers.pty import read_until

BB = "busybox:test"
pytestmark = real_guest_marks(BB)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}


async def test_pty_on_a_microvm(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        sb = await client.create(BB, backend="microvm", memory_mib=256, disk_mib=64)
        try:
            r = await sb.exec("tty; stty size", pty=True, cols=90, rows=20, timeout=60)
            assert r.exit_code == 0 and r.guest_reported
            assert re.match(r"/dev/pts/\d+\r\n20 90\r\n$", r.stdout), r.stdout
            sh = await sb.exec_background(["sh"], pty=True, cols=90, rows=20, timeout=120)
            await sh.resize(132, 43)
            await sh.write_stdin(b"stty size; echo mark\n")
            _, off = await read_until(sh, r"43 132\r\nmark", timeout=60)
            await sh.write_stdin(b"sleep 100\n")
            await asyncio.sleep(1)
            await sh.write_stdin(b"\x03echo rc=$?\n")
            text, _ = await read_until(sh, r"rc=130", off, timeout=60)
            again, _ = await read_until(sh, r"rc=130", off, timeout=60)
            assert again == text and "mark" not in again
            with pytest.raises(errors.BadRequest):
                await sh.resize(100_000, 24)
            await sh.write_stdin(b"exit 4\n")
            assert (await sh.wait()).exit_code == 4
            r = await sb.exec("sleep 100", pty=True, timeout=1.5)
            assert r.timed_out
        finally:
            await sb.delete()
        assert edge.leftovers(sb.id) == []
