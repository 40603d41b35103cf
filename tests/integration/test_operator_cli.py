"""The operator CLI (`rollbox sandbox ...`, `rollbox key ...`) against a running server: select
by id, label, project and job; exec's exit code; logs and exec with control bytes escaped;
rm of many asks (on a terminal), is refused without one, or goes with --yes; keys listed and
revoked."""
from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import rollbox
from rollbox import errors
from rollbox.cli import app as cli

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
NASTY = r"printf 'a\033[2J\033]0;pwned\007b\rc\302\233m\n'"  # ESC CSI OSC BEL CR C1-CSI


async def _run(url: str, key: str, *args: str, stdin: str | None = None):  # noqa: ANN202
    """The CLI in a thread (the server runs on this loop), not on a terminal."""
    runner = CliRunner()
    group, *rest = args
    return await asyncio.to_thread(runner.invoke, cli, [group, "--url", url, "--api-key", key,
                                                         *rest], input=stdin)


def _on_a_terminal(url: str, key: str, args: list[str], answer: bytes) -> tuple[int, str]:
    """The CLI as a process whose stdin and stdout are a terminal; ``answer`` is typed."""
    leader, follower = pty.openpty()
    env = {**os.environ, "ROLLBOX_URL": url, "ROLLBOX_API_KEY": key, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "rollbox.cli", *args], stdin=follower,
                            stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    seen = b""
    answered = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"[y/N]" in seen:
                os.write(leader, answer)
                answered = True
        return proc.wait(30), seen.decode("utf-8", "replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_sandbox_commands_select_exec_logs_rm(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    admin = keys.create("ops", admin=True)
    async with rollbox.AsyncClient(url, keys.create("proj-a")) as a, \
            rollbox.AsyncClient(url, keys.create("proj-b")) as b:
        job = await a.job("cli-job", heartbeat_s=30).open()
        in_job = await job.create(BB)
        tagged = await a.create_many(2, BB, labels={"grp": "x"})
        other = await b.create(BB, labels={"grp": "x"})
        try:
            res = await _run(url, admin, "sandbox", "ls", "--json")
            assert res.exit_code == 0, res.output
            assert {i["id"] for i in json.loads(res.output)} == \
                {in_job.id, other.id, *(s.id for s in tagged)}
            res = await _run(url, admin, "sandbox", "ls", "-l", "grp=x", "--project", "proj-a",
                             "--json")
            assert sorted(i["id"] for i in json.loads(res.output)) == sorted(s.id for s in tagged)
            res = await _run(url, admin, "sandbox", "ls", "--job", "cli-job", "--json")
            assert [i["id"] for i in json.loads(res.output)] == [in_job.id]
            res = await _run(url, admin, "sandbox", "ls")
            assert res.exit_code == 0 and in_job.id in res.output and "cli-job" in res.output
            res = await _run(url, admin, "sandbox", "inspect", other.id)
            assert json.loads(res.output)["owner"] == "proj-b"

            res = await _run(url, admin, "sandbox", "exec", in_job.id, "--", "sh", "-c",
                             "echo out; echo err >&2; exit 7")
            assert res.exit_code == 7 and "out\n" in res.output and "err\n" in res.output
            res = await _run(url, admin, "sandbox", "exec", in_job.id, "-c", "exit 0")
            assert res.exit_code == 0
            res = await _run(url, admin, "sandbox", "exec", in_job.id, "-c", "kill -9 $$")
            assert res.exit_code == 128 + 9
            res = await _run(url, admin, "sandbox", "exec", in_job.id, "-c", NASTY)
            assert res.exit_code == 0 and "\x1b[2J" in res.output  # not a terminal: bytes as-is
            res = await _run(url, admin, "sandbox", "logs", in_job.id)
            assert res.exit_code == 0, res.output
            assert "exec.started" in res.output and "| out" in res.output
            for raw in ("\x1b", "\r", "\x07", "\x9b"):
                assert raw not in res.output
            assert "a\\e[2J\\e]0;pwned\\ab\\rc\\x9bm" in res.output

            # A project key sees only its project: another's sandbox is not found.
            res = await _run(url, keys.create("proj-b"), "sandbox", "inspect", in_job.id)
            assert res.exit_code == 2 and "not_found" in res.output

            # rm of many without a terminal and without --yes: refused, nothing deleted.
            res = await _run(url, admin, "sandbox", "rm", "-l", "grp=x")
            assert res.exit_code == 2 and "--yes" in res.output
            assert all(s.id in edge.live for s in (*tagged, other))
            res = await _run(url, admin, "sandbox", "rm")
            assert res.exit_code != 0 and all(s.id in edge.live for s in tagged)
            # On a terminal it asks: "n" keeps them, "y" deletes exactly the selection.
            code, text = await asyncio.to_thread(
                _on_a_terminal, url, admin,
                ["sandbox", "rm", "-l", "grp=x", "--project", "proj-a"], b"n\n")
            assert code == 1 and "delete these 2 sandboxes?" in text, text
            assert all(s.id in edge.live for s in tagged)
            code, text = await asyncio.to_thread(
                _on_a_terminal, url, admin,
                ["sandbox", "rm", "-l", "grp=x", "--project", "proj-a"], b"y\n")
            assert code == 0, text
            assert all(s.id not in edge.live for s in tagged) and other.id in edge.live
            # exec on a terminal: the sandbox's control bytes arrive escaped.
            code, text = await asyncio.to_thread(
                _on_a_terminal, url, admin, ["sandbox", "exec", in_job.id, "-c", NASTY], b"")
            assert code == 0 and "\x1b" not in text and "\\e]0;pwned" in text, repr(text)
            res = await _run(url, admin, "sandbox", "rm", "--job", "cli-job", "--yes")
            assert res.exit_code == 0 and in_job.id in res.output
            res = await _run(url, admin, "sandbox", "rm", other.id)  # one: no question
            assert res.exit_code == 0 and not edge.live
            res = await _run(url, admin, "sandbox", "inspect", other.id)
            assert json.loads(res.output)["state"] == "deleted"
        finally:
            await job.end()
            for sb in (other, *tagged):
                try:
                    await sb.delete()
                except errors.RollboxError:
                    pass


async def test_key_ls_and_revoke(api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    admin = keys.create("ops", admin=True)
    team = keys.create("team")
    async with rollbox.AsyncClient(url, team) as c:
        await c.jobs()
    res = await _run(url, admin, "key", "ls", "--project", "team", "--json")
    assert res.exit_code == 0, res.output
    (info,) = json.loads(res.output)
    assert info["project"] == "team" and info["last_used_at"] and team[12:] not in res.output
    res = await _run(url, admin, "key", "ls")
    assert res.exit_code == 0 and info["key_id"] in res.output and team[12:] not in res.output
    res = await _run(url, team, "key", "ls")
    assert res.exit_code == 2 and "forbidden" in res.output
    res = await _run(url, admin, "key", "revoke", info["key_id"])
    assert res.exit_code == 0
    async with rollbox.AsyncClient(url, team) as c:
        with pytest.raises(errors.Unauthorized):
            await c.jobs()
    res = await _run(url, admin, "key", "revoke", info["key_id"])
    assert res.exit_code == 2 and "not_found" in res.output
