"""PTY exec against real container sandboxes through the api and the SDKs (async and sync),
with the api over the edge itself and over a RemoteEdge (the cluster's path): the terminal is
the sandbox's own devpts, its size follows resize, interactive programs (a REPL without -i, a
pager) behave as on a terminal, ctrl-C interrupts, the timeout kills, a re-attach replays from
an offset, and bad sizes are typed errors."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

import rollbox
from rollbox import errors
from tests.conftest import BOTH_TRANSPORTS
from tests.helpers.pty import api_sandbox, read_until

pytestmark = pytest.mark.root
BB = "busybox:test"
PY = "python:3.11"


@BOTH_TRANSPORTS
async def test_pty_terminal_resize_ctrl_c_timeout_reattach(api_server) -> None:  # noqa: ANN001
    async with api_sandbox(api_server, "pty") as (url, key, sb):
        r = await sb.exec("tty; stty size; echo $TERM; echo err >&2", pty=True, cols=100,
                          rows=30)
        assert r.exit_code == 0
        assert re.match(r"/dev/pts/\d+\r\n30 100\r\nxterm-256color\r\nerr\r\n$", r.stdout), \
            r.stdout
        assert r.stderr == "" and r.stderr_bytes == 0  # one stream: stderr is the terminal
        # Another user's terminal is its own (it may reopen it by name, e.g. a pager's /dev/tty).
        r = await sb.exec("stat -c %u $(tty); head -c0 /dev/tty && echo reopened", pty=True,
                          user="1000")
        assert r.exit_code == 0 and r.stdout == "1000\r\nreopened\r\n", r.stdout
        # Without a terminal nothing changes: pipes, no tty.
        r = await sb.exec("tty; true")
        assert r.stdout == "not a tty\n"

        sh = await sb.exec_background(["sh"], pty=True, cols=100, rows=30, timeout=60)
        assert any(p.exec_id == sh.exec_id and p.pty for p in await sb.processes())
        await sh.write_stdin(b"stty size\n")
        _, off = await read_until(sh, r"30 100")
        await sh.resize(120, 40)
        await sh.write_stdin(b"stty size; echo mark1\n")
        text, off = await read_until(sh, r"40 120\r\nmark1", off)
        # ctrl-C reaches the foreground job through the terminal's line discipline.
        await sh.write_stdin(b"sleep 100\n")
        await asyncio.sleep(0.3)
        await sh.write_stdin(b"\x03")
        await sh.write_stdin(b"echo rc=$?\n")
        text, off2 = await read_until(sh, r"rc=130", off)
        # Re-attach from an offset replays exactly what came after it.
        again, _ = await read_until(sh, r"rc=130", off)
        assert again == text and "mark1" not in again
        # Bad sizes: typed, in the client and in the server.
        for cols, rows in ((0, 24), (100_000, 24), (80, 0), (80, 100_000)):
            with pytest.raises(errors.BadRequest):
                await sh.resize(cols, rows)
        async with httpx.AsyncClient(base_url=url,
                                     headers={"Authorization": f"Bearer {key}"}) as h:
            base = f"/v1/sandboxes/{sb.id}/exec"
            resp = await h.post(f"{base}/{sh.exec_id}/resize",
                                json={"cols": 100_000, "rows": 24})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_request"
            resp = await h.post(f"{base}/{sh.exec_id}/resize", json={"cols": 0, "rows": 24})
            assert resp.status_code == 400
            resp = await h.post(base, params={"wait": 1}, json={
                "cmd": "true", "pty": {"cols": 100_000, "rows": 24}})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_request"
            # pty_stderr: stdin and stdout are the terminal, stderr its own pipe (what the
            # SWE-ReX door's sessions use: the shell's state channel the terminal can't write)
            resp = await h.post(base, params={"wait": 1}, json={
                "cmd": "[ -t 0 ] && [ -t 1 ] && echo out-tty; [ -t 2 ] || echo err-pipe >&2",
                "pty": {"cols": 80, "rows": 24}, "pty_stderr": True})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert (body["exit_code"], body["stdout"], body["stderr"]) == (
                0, "out-tty\r\n", "err-pipe\n"), body
            resp = await h.post(base, params={"wait": 1}, json={"cmd": "true",
                                                                 "pty_stderr": True})
            assert resp.status_code == 400, resp.text  # pty_stderr needs pty
        with pytest.raises(errors.BadRequest):
            await sb.exec("true", pty=True, cols=0)
        plain = await sb.exec_background("sleep 30", timeout=60)
        with pytest.raises(errors.BadRequest, match="no terminal"):
            await plain.resize(80, 24)
        await plain.kill()
        await sh.write_stdin(b"exit 3\n")
        res = await sh.wait()
        assert res.exit_code == 3 and "rc=130" in res.stdout
        with pytest.raises(errors.BadRequest, match="exited"):
            await sh.resize(80, 24)

        # The timeout kills a terminal's command like any other.
        r = await sb.exec("echo started; sleep 100", pty=True, timeout=1)
        assert r.timed_out and "started" in r.stdout
        # stdin given to exec is typed into the terminal, then ^D ends its input.
        r = await sb.exec(["cat"], pty=True, stdin="typed\n", timeout=20)
        assert r.exit_code == 0 and r.stdout.count("typed\r\n") == 2  # echo + cat


async def test_pty_python_repl_and_pager(api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("pty")) as c:
        py, bb = await asyncio.gather(c.create(PY), c.create(BB))
        try:
            # python3 without -i: stdin is a terminal, so it prompts.
            repl = await py.exec_background(["python3"], pty=True, timeout=60)
            _, off = await read_until(repl, r">>> ")
            await repl.write_stdin(b"print(6 * 7)\r")
            _, off = await read_until(repl, r"42\r\n>>> ", off)
            await repl.write_stdin(b"\x04")  # ^D at the prompt: the REPL ends
            assert (await repl.wait()).exit_code == 0

            # A pager shows one screen and waits for a key (less if the image has it, else
            # busybox's more); q ends it.
            await bb.files.write("/tmp/lines", "".join(f"line{i}\n" for i in range(1, 101)))
            pager = await bb.exec_background(
                "if command -v less >/dev/null; then exec less /tmp/lines; "
                "else exec more /tmp/lines; fi", pty=True, cols=80, rows=10, timeout=60)
            text, off = await read_until(pager, r"line9\b")
            await asyncio.sleep(0.5)
            text2, _ = await read_until(pager, r"line9\b")  # the whole first screen so far
            assert "line50" not in text2 and "line100" not in text2, text2
            await pager.write_stdin(b"q")
            res = await pager.wait()
            assert res.exit_code == 0 and "line100" not in res.stdout, res.stdout
        finally:
            await asyncio.gather(py.delete(), bb.delete())


def _sync_pty(url: str, key: str) -> None:
    with rollbox.Client(url, key) as c, c.create(BB) as sb:
        r = sb.exec("stty size", pty=True, cols=33, rows=11)
        assert r.stdout == "11 33\r\n"
        proc = sb.exec_background(["sh"], pty=True, timeout=60)
        proc.resize(44, 22)
        proc.write_stdin("stty size; exit 0\n")
        res = proc.wait()
        assert res.exit_code == 0 and "22 44\r\n" in res.stdout
        with pytest.raises(errors.BadRequest):
            proc.resize(0, 0)
        chunks = list(proc.attach(stdout_offset=res.stdout_bytes - 7))
        assert b"".join(ch.data for ch in chunks) == res.stdout.encode()[-7:]


async def test_pty_sync_sdk(api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    await asyncio.to_thread(_sync_pty, url, keys.create("pty"))
