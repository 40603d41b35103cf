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


PY = "python:3.11"


@pytest.mark.microvm_slow
async def test_pty_repl_and_pager_on_a_microvm(edge, api_server) -> None:  # noqa: ANN001
    """The heavier interactive cases in a guest: python3 without -i prompts, a pager pages."""
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        sb = await client.create(PY, backend="microvm", memory_mib=512, disk_mib=256)
        try:
            repl = await sb.exec_background(["python3"], pty=True, timeout=120)
            _, off = await read_until(repl, r">>> ", timeout=90)
            await repl.write_stdin(b"print(6 * 7)\r")
            await read_until(repl, r"42\r\n>>> ", off, timeout=60)
            await repl.write_stdin(b"\x04")
            assert (await repl.wait()).exit_code == 0
            await sb.files.write("/tmp/lines", "".join(f"line{i}\n" for i in range(1, 101)))
            pager = await sb.exec_background(
                "if command -v less >/dev/null; then exec less /tmp/lines; "
                "else exec more /tmp/lines; fi", pty=True, cols=80, rows=10, timeout=120)
            await read_until(pager, r"line9\b", timeout=60)
            await pager.write_stdin(b"q")
            res = await pager.wait()
            assert res.exit_code == 0 and "line100" not in res.stdout, res.stdout
        finally:
            await sb.delete()
        assert edge.leftovers(sb.id) == []
