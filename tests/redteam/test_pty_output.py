"""Red-team class 45: a PTY used to inject input into a platform process, or escape sequences
the operator's terminal runs. Output a sandbox's terminal produced is escaped (or, attached to
the operator's own terminal, filtered) wherever the platform prints it: ``rollbox sandbox exec
--pty`` interactive and not, ``rollbox sandbox logs``. Each place is checked twice: the attack
bytes really come out of the sandbox (the ``--raw`` twin, or the api's own record, shows them)
and the hardened printing never passes them. TIOCSTI from a pty command is refused in a
container (its unhardened twin injects, and only into its own terminal)."""
from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from errno import EPERM

import pytest
from typer.testing import CliRunner

from rollbox.cli import app as cli
from rollbox.errors import BadRequest
from rollbox.models import ExecSpec, PtySize
from tests.helpers.pty import api_sandbox, drain, read_chunk
from tests.redteam.conftest import Boxes, container_only, needs_root

pytestmark = [pytest.mark.root, needs_root]
# OSC 52 set and query (the operator's clipboard), a title (kept), DCS (DECRQSS), an 8-bit CSI
# as UTF-8 (U+009B), CSI 2J (a screen program's own: kept).
ATTACK = (r"printf 'A\033]52;c;cHduZWQ=\007B\033]52;c;?\007C\033]0;title\007D"
          r"\033P$qm\033\\E\302\233F\033[2JG\n'")
BAD = (b"\x1b]52;", b"\x1bP", b"\xc2\x9b")


def _winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _interactive(url: str, key: str, args: list[str], steps: list[tuple[bytes, bytes | None,
                 tuple[int, int] | None]]) -> tuple[int, bytes]:
    """The CLI as a session leader on a local terminal of 100x30 (its controlling terminal, so
    a resize of it signals the CLI). ``steps``: (wait for these bytes, then type this, then
    resize to this)."""
    leader, follower = pty.openpty()
    _winsize(follower, 100, 30)
    env = {**os.environ, "ROLLBOX_URL": url, "ROLLBOX_API_KEY": key}

    def ctty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "rollbox.cli", *args], stdin=follower,
                            stdout=follower, stderr=follower, env=env, close_fds=True,
                            start_new_session=True, preexec_fn=ctty)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if steps and steps[0][0] in seen:
                _, typed, size = steps.pop(0)
                if size is not None:
                    _winsize(leader, *size)
                    time.sleep(1.0)  # SIGWINCH -> the CLI's resize request
                if typed is not None:
                    os.write(leader, typed)
            ready, _, _ = select.select([leader], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            chunk = read_chunk(leader)
            if not chunk:  # EOF or EIO: the CLI closed the terminal
                break
            seen += chunk
        return proc.wait(30), seen
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SCRIPT = ATTACK + "; stty size; read x; stty size; echo got=$x"


@pytest.mark.parametrize("raw", [False, True], ids=["hardened", "raw-twin"])
async def test_c45_interactive_cli_terminal_filters_what_acts_beyond_the_screen(
        api_server, raw: bool) -> None:  # noqa: ANN001
    async with api_sandbox(api_server, "rt45") as (url, key, sb):
        args = ["sandbox", "exec", sb.id, "--pty", *(["--raw"] if raw else []), "-c", SCRIPT]
        steps = [(b"30 100", None, (120, 40)), (b"30 100", b"hello\r", None)]
        code, seen = await asyncio.to_thread(_interactive, url, key, args, steps)
    assert code == 0, seen
    # interactive: the local size went in, followed a resize, and typed keys arrived
    assert b"30 100" in seen and b"40 120" in seen and b"got=hello" in seen, seen
    assert b"\x1b]0;title\x07" in seen and b"\x1b[2J" in seen  # what screens need passes
    if raw:  # the twin: the attack's bytes do reach an unfiltered terminal
        assert all(bad in seen for bad in BAD), seen
    else:
        assert not any(bad in seen for bad in BAD), seen


async def test_c45_cli_pty_output_on_a_terminal_is_escaped(api_server) -> None:  # noqa: ANN001
    """Not interactive (stdin a pipe), stdout a terminal: shown escaped; --raw: as is."""
    shown = {}
    async with api_sandbox(api_server, "rt45") as (url, key, sb):
        for raw in (False, True):
            leader, follower = pty.openpty()
            env = {**os.environ, "ROLLBOX_URL": url, "ROLLBOX_API_KEY": key}
            args = ["sandbox", "exec", sb.id, "--pty", *(["--raw"] if raw else []),
                    "-c", ATTACK]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollbox.cli", *args, stdin=subprocess.DEVNULL,
                stdout=follower, stderr=follower, env=env)
            os.close(follower)
            try:
                assert await proc.wait() == 0
                shown[raw] = drain(leader)
            finally:
                os.close(leader)
    assert b"\x1b]52;" in shown[True] and b"\xc2\x9b" in shown[True], shown  # the twin
    assert b"\x1b" not in shown[False] and b"\xc2\x9b" not in shown[False], shown
    assert b"A\\e]52;c;cHduZWQ=\\aB" in shown[False], shown


async def test_c45_logs_of_pty_output_are_escaped(api_server) -> None:  # noqa: ANN001
    async with api_sandbox(api_server, "rt45") as (url, key, sb):
        r = await sb.exec(ATTACK, pty=True)
        assert "\x1b]52;c;?" in r.stdout  # the api's record has the attack, raw
        res = await asyncio.to_thread(CliRunner().invoke, cli, [
            "sandbox", "--url", url, "--api-key", key, "logs", sb.id])
    assert res.exit_code == 0, res.output
    assert "exec.stdout" in res.output
    assert not any(ch in res.output for ch in ("\x1b", "\x07", "\x9b", "\r")), repr(res.output)
    assert "A\\e]52;c;cHduZWQ=\\aB" in res.output


TIOCSTI = ("import fcntl, sys\ntry:\n    fcntl.ioctl(0, 0x5412, b'Z'); print('injected')\n"
           "except OSError as e:\n    print('errno', e.errno)\nprint('line', sys.stdin.read(1))\n")


@container_only("container seccomp; in a VM the guest's root owns its terminals (and TIOCSTI "
                "reaches only the guest's own pty, like this test's twin)")
async def test_c45_tiocsti_on_the_pty_refused(boxes: Boxes) -> None:
    for hardened in (True, False):
        sid = await boxes.make("python:3.11", hardened=hardened)
        eid = await boxes.edge.exec_start(sid, ExecSpec(
            cmd=["python3", "-c", TIOCSTI], pty=PtySize(), timeout_s=30))
        await asyncio.sleep(1.0)
        await boxes.edge.exec_stdin(sid, eid, b"Y\n", False)
        r = await boxes.edge.exec_wait(sid, eid)
        if hardened:
            assert f"errno {EPERM}" in r.stdout and "line Y" in r.stdout, r
        else:  # the twin injects, and only into its own terminal: it reads its own byte
            assert "injected" in r.stdout and "line Z" in r.stdout, r
        assert boxes.edge.live[sid].info.state == "running"  # the agent kept serving
        await boxes.edge.delete(sid)


PLANT = {"fifo": "mkfifo /dev/pts/ptmx", "symlink": "ln -s /etc/passwd /dev/pts/ptmx",
         "file": "echo x > /dev/pts/ptmx"}


@container_only("a guest's root can not unmount its devpts either (no CAP_SYS_ADMIN); its "
                "agent runs the same checks")
@pytest.mark.parametrize("plant", sorted(PLANT))
async def test_c45_a_planted_ptmx_is_refused_not_waited_on(boxes: Boxes, plant: str) -> None:
    """The agent opens the sandbox's own ptmx for a pty command. Hardened, the sandbox's root
    can not replace it (devpts stays mounted); the unhardened twin can, and then the agent
    refuses what it finds (no terminal: a FIFO, a file, a link it does not follow) with the
    reason, in bounded time, and keeps serving."""
    hard = await boxes.make()
    r = await boxes.run(hard, "umount /dev/pts")
    assert r.exit_code != 0, r
    soft = await boxes.make(hardened=False)
    r = await boxes.run(soft, f"umount /dev/pts && {PLANT[plant]} && ls -l /dev/pts")
    assert r.exit_code == 0, r
    with pytest.raises(BadRequest, match="pty"):
        async with asyncio.timeout(10):
            await boxes.edge.exec_start(soft, ExecSpec(cmd="true", pty=PtySize()))
    r = await boxes.run(soft, "echo still-serving")
    assert r.stdout == "still-serving\n"


def test_c45_image_build_step_output_is_escaped(tmp_node_dir, monkeypatch) -> None:  # noqa: ANN001
    """``rollbox image build --base --run`` prints a failed step's error, which carries the
    step's output (the build sandbox's bytes): shown escaped. The twin is the error itself,
    which holds the raw bytes."""
    import io

    from rich.console import Console

    from rollbox import errors, image_cli
    from rollbox.backends.container.build import build_layer_with_commands
    from rollbox.config import Settings
    from rollbox.images.store import ImageStore
    from tests.conftest import node_settings

    store = ImageStore(tmp_node_dir / "images")  # under tmp_node_dir: the build uid reaches it
    node = ImageStore(Settings().images_dir)
    bb = node.resolve("busybox:test")
    store.tag("bb:1", [store.add_layer_file(node.layer_path(d)) for d in bb.layers], bb.config)
    settings = node_settings(tmp_node_dir)
    settings.images_root = store.root
    with pytest.raises(errors.InfraError) as failed:
        asyncio.run(build_layer_with_commands(store, "bb:1", [ATTACK + "; exit 3"], "bad:1",
                                              settings=settings, network="none",
                                              log=lambda _m: None))
    assert "\x1b]52;c;?" in failed.value.message  # the twin: raw in the error

    shown = io.StringIO()
    monkeypatch.setattr(image_cli, "console", Console(file=shown, width=400))

    def step() -> None:
        raise failed.value

    with pytest.raises(image_cli.typer.Exit):
        image_cli._run(step)
    text = shown.getvalue()
    assert "image build step failed" in text, text
    assert not any(ch in text for ch in ("\x1b", "\x07", "\x9b")), repr(text)
    assert "A\\e]52;c;cHduZWQ=\\aB" in text, text
