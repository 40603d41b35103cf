"""SWE-ReX bash sessions on top of the edge's exec with stdin.

A session is one long-lived ``bash -i`` exec in the sandbox (the user's shell, from the image)
fed through stdin. All the framing is done here, on the host: each command is sent as one line
``eval $'<command>'; printf '<marker><exit code>'`` and the output is everything the shell
wrote before the marker, so exit codes and output are exact without a prompt to parse. The shell
runs with ``--noediting`` (no echo), ``set +H`` (no history expansion) and stderr joined to
stdout (one ordered stream, as on a terminal). Interactive mode makes Ctrl-C behave as on a
terminal: SIGINT to the process group stops the running command and abandons the rest of its
line, and the shell itself survives SIGINT and SIGTERM. Its prompt (PS1) is a per-session token
that is cut out of the output and counted: a new prompt after an interrupt means the shell is
back even when the stopped program had swallowed the resync line sent after the signal.

Owns the sessions' framing and state only; the sandbox's lifetime belongs to the edge.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import signal
from collections.abc import Callable
from typing import TypeVar

from rollbox import errors
from rollbox.compat.swerex import wire
from rollbox.edge.interface import EdgeAPI
from rollbox.models import ExecSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

SHELL_ARGV = ["bash", "--noprofile", "--norc", "--noediting", "-i"]
SETUP = "exec 2>&1; set +H; unset PROMPT_COMMAND HISTFILE; HISTSIZE=0"
MAX_PENDING = 32 << 20  # unread output kept per session; older bytes are dropped beyond it
STARTUP_TIMEOUT_MIN_S = 10.0  # exec start + sourcing on a loaded node; SWE-ReX's 1 s is tight
INTERRUPT_TIMEOUT_MIN_S = 0.5
SYNTAX_CHECK_TIMEOUT_S = 10.0
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")
_ANY_MARKER = re.compile(rb"__RBX[0-9a-f]{16}__-?\d+__\n")
MARKER_MAX = 64  # longest marker, for resuming a search where the last one stopped
PROMPT_GRACE_S = 0.2  # after the prompt came back, time for the resync marker to follow

OnExecStarted = Callable[[str, ExecSpec], None]


def ansi_c_quote(text: str) -> str:
    """``text`` as one bash ``$'...'`` word on a single line (newlines and controls escaped)."""
    out = ["$'"]
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    out.append("'")
    return "".join(out)


def clean_output(raw: bytes) -> str:
    """Decode like SWE-ReX (backslashreplace) and drop ANSI escapes and CRs before newlines."""
    text = raw.decode("utf-8", errors="backslashreplace")
    return _ANSI.sub("", text).replace("\r\n", "\n")


async def check_syntax(command: str) -> None:
    """Raise BashIncorrectSyntaxError if ``bash -n`` rejects ``command``.

    Runs the host's bash in parse-only mode (no expansion, nothing executed): the platform's own
    work never runs a binary from the sandbox."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-n", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(command.encode()),
                                          SYNTAX_CHECK_TIMEOUT_S)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode == 0:
        return
    stdout = out.decode(errors="backslashreplace")
    stderr = err.decode(errors="backslashreplace")
    raise wire.RemoteError(
        wire.BashIncorrectSyntaxError,
        f"Error (exit code {proc.returncode}) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}",
        bash_stdout=stdout, bash_stderr=stderr)


class SessionGone(Exception):
    """The session's shell exited (``exit``, killed, sandbox deleted)."""


class BashSession:
    def __init__(self, edge: EdgeAPI, sandbox_id: str, name: str) -> None:
        self.edge = edge
        self.sandbox_id = sandbox_id
        self.name = name
        self.exec_id: str | None = None
        self.exited = False
        self.exit_note = ""
        self._buf = bytearray()
        self._dropped = 0
        self._stderr_tail = b""
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._interrupts = 0
        self._stale_markers = 0  # markers of abandoned commands that may still arrive
        self._reader: asyncio.Task[None] | None = None
        self._prompt = f"__RBXPS1{secrets.token_hex(8)}__".encode()
        self._prompts = 0
        self._scan: tuple[str, int] = ("", 0)  # (token, buffer offset searched up to)

    # ---- lifetime ----
    async def start(self, request: wire.CreateBashSessionRequest,
                    on_started: OnExecStarted | None = None) -> str:
        ps1 = self._prompt.decode()
        spec = ExecSpec(cmd=list(SHELL_ARGV), stdin=True, env={"PS1": ps1, "PS2": "", "PS0": ""})
        self.exec_id = await self.edge.exec_start(self.sandbox_id, spec)
        if on_started is not None:
            on_started(self.exec_id, spec)
        self._reader = asyncio.ensure_future(self._read())
        lines = [SETUP]
        lines += [f"source {ansi_c_quote(path)}" for path in request.startup_source]
        # after the sources, which often set their own prompt
        lines.append(f"PS1='{ps1}'; PS2=; PS0=; unset PROMPT_COMMAND")
        await self._write("\n".join(lines) + "\n")
        token = await self._send_marker()
        timeout = max(request.startup_timeout, STARTUP_TIMEOUT_MIN_S)
        found = await self._wait(lambda: self._take(token), timeout)
        if found is None:
            raise wire.RemoteError(wire.CommandTimeoutError,
                                   f"timeout after {timeout} seconds while starting the session")
        return found[0]

    async def close(self) -> None:
        self.exited = True
        if self.exec_id is not None:
            with contextlib.suppress(errors.RollboxError):
                await self.edge.exec_kill(self.sandbox_id, self.exec_id, signal.SIGKILL)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        assert self._reader is not None
        self._reader.add_done_callback(lambda _: fn())

    # ---- commands ----
    async def run(self, action: wire.BashAction) -> wire.BashObservation:
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._run_interactive(action)
        await check_syntax(action.command)
        interrupts = self._interrupts
        async with self._lock:
            token = secrets.token_hex(8)
            await self._write(
                f"eval {ansi_c_quote(action.command)}; __rbx_rc=$?; "
                f"printf '__RBX{token}__%d__\\n' \"$__rbx_rc\"\n")
            expect = [e.encode() for e in action.expect]

            def done() -> tuple[str, int | None, str] | None:
                got = self._take(token)
                if got is not None:
                    return got[0], got[1], ""
                for e in expect:
                    i = self._buf.find(e)
                    if i >= 0:
                        out = self._consume(i, i + len(e))
                        self._stale_markers += 1  # its marker still comes later
                        return out, None, e.decode()
                if self._interrupts != interrupts:
                    raise wire.RemoteError(wire.CommandTimeoutError,
                                           f"command {action.command!r} was interrupted")
                return None

            found = await self._wait(done, action.timeout)
            if found is None:
                self._stale_markers += 1
                raise wire.RemoteError(
                    wire.CommandTimeoutError,
                    f"timeout after {action.timeout} seconds while running command "
                    f"{action.command!r}")
        output, exit_code, expect_string = found
        if action.check == "ignore":
            exit_code = None
        elif action.check == "raise" and exit_code != 0:
            msg = (f"Command {action.command!r} failed with exit code {exit_code}. "
                   f"Here is the output:\n{output!r}")
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise wire.RemoteError(wire.NonZeroExitCodeError, msg)
        return wire.BashObservation(output=output, exit_code=exit_code,
                                    expect_string=expect_string)

    async def _run_interactive(self, action: wire.BashAction) -> wire.BashObservation:
        """A line for a program reading the shell's stdin (gdb, a REPL started with -i...).

        It sees a pipe, not a terminal. Without ``expect`` strings the output of ``timeout``
        seconds (0.5 s if unset) is returned; ``is_interactive_quit`` waits for the shell."""
        async with self._lock:
            await self._write(action.command + "\n")
            expect = [e.encode() for e in action.expect]
            if action.is_interactive_quit:
                token = await self._send_marker()
                found = await self._wait(lambda: self._take(token), action.timeout or 5.0)
                if found is None:
                    self._stale_markers += 1
                    raise wire.RemoteError(wire.CommandTimeoutError,
                                           f"timeout after {action.timeout} seconds while "
                                           f"running command {action.command!r}")
                return wire.BashObservation(output=found[0].strip(), exit_code=0)

            def matched() -> tuple[str, str] | None:
                for e in expect:
                    i = self._buf.find(e)
                    if i >= 0:
                        return self._consume(i, i + len(e)), e.decode()
                return None

            if not expect:
                await asyncio.sleep(action.timeout if action.timeout is not None else 0.5)
                return wire.BashObservation(output=self._consume(len(self._buf)).strip(),
                                            exit_code=0)
            got = await self._wait(matched, action.timeout)
            if got is None:
                raise wire.RemoteError(wire.CommandTimeoutError,
                                       f"timeout after {action.timeout} seconds while running "
                                       f"command {action.command!r}")
            return wire.BashObservation(output=got[0].lstrip().removeprefix(action.command)
                                        .strip(), exit_code=0, expect_string=got[1])

    async def interrupt(self, action: wire.BashInterruptAction) -> wire.BashObservation:
        """Ctrl-C: SIGINT to the shell's process group, then wait for the shell to answer a
        fresh marker; after ``n_retry`` tries SIGTERM (the shell ignores it, commands die)."""
        self._interrupts += 1
        self._changed.set()  # a waiting run gives up and releases the lock
        timeout = max(action.timeout, INTERRUPT_TIMEOUT_MIN_S)
        async with self._lock:
            assert self.exec_id is not None
            signals = [signal.SIGINT] * max(action.n_retry, 1) + [signal.SIGTERM]
            prompts = self._prompts
            for sig in signals:
                if self.exited:
                    raise SessionGone(self.exit_note)
                await self.edge.exec_kill(self.sandbox_id, self.exec_id, sig)
                token = await self._send_marker()

                def back(t: str = token) -> tuple[str, int] | bool | None:
                    return self._take(t) or (self._prompts > prompts) or None

                found = await self._wait(back, timeout)
                if found is True:  # the prompt is back; the resync line may have been eaten
                    found = await self._wait(lambda t=token: self._take(t), PROMPT_GRACE_S)
                    if found is None:
                        self._stale_markers += 1
                        found = (self._consume(len(self._buf)), 0)
                if isinstance(found, tuple):
                    return wire.BashObservation(output=found[0].strip(), exit_code=0)
                self._stale_markers += 1
        tail = clean_output(bytes(self._buf[-2000:]))
        raise wire.RemoteError(wire.CommandTimeoutError,
                               f"Failed to interrupt session; last output: {tail!r}")

    # ---- framing ----
    async def _send_marker(self) -> str:
        token = secrets.token_hex(8)
        await self._write(f"printf '__RBX{token}__%d__\\n' 0\n")
        return token

    async def _write(self, text: str) -> None:
        if self.exited:
            raise SessionGone(self.exit_note)
        assert self.exec_id is not None
        try:
            await self.edge.exec_stdin(self.sandbox_id, self.exec_id, text.encode(), False)
        except errors.BadRequest as exc:  # "exec has exited": the reader will say why
            raise SessionGone(str(exc)) from None

    def _take(self, token: str) -> tuple[str, int] | None:
        """If ``token``'s marker arrived: (output before it, exit code), consumed."""
        start = self._scan[1] if self._scan[0] == token else 0
        m = re.compile(rb"__RBX" + token.encode() + rb"__(-?\d+)__\n").search(self._buf, start)
        if m is None:
            self._scan = (token, max(0, len(self._buf) - MARKER_MAX))
            return None
        self._scan = ("", 0)
        code = int(m.group(1))  # before _consume: the match views the mutable buffer
        return self._consume(m.start(), m.end()), code

    def _consume(self, end: int, through: int | None = None) -> str:
        raw = bytes(self._buf[:end])
        del self._buf[: end if through is None else through]
        self._scan = ("", 0)
        if self._stale_markers:
            raw, n = _ANY_MARKER.subn(b"", raw)
            self._stale_markers = max(0, self._stale_markers - n)
        text = clean_output(raw)
        if self._dropped:
            text = f"[rollbox: {self._dropped} bytes of output dropped]\n{text}"
            self._dropped = 0
        return text

    async def _wait(self, find: Callable[[], T | None], timeout: float | None) -> T | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            got = find()
            if got is not None:
                return got
            if self.exited:
                raise SessionGone(self.exit_note)
            # No await between find() and clear(): a wake-up can not be lost.
            self._changed.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _append(self, data: bytes) -> None:
        start = max(0, len(self._buf) - len(self._prompt) + 1)
        self._buf += data
        while (i := self._buf.find(self._prompt, start)) >= 0:
            del self._buf[i : i + len(self._prompt)]
            self._prompts += 1
            start = i
        over = len(self._buf) - MAX_PENDING
        if over > 0:
            del self._buf[:over]
            self._dropped += over
            self._scan = ("", 0)
        self._changed.set()

    async def _read(self) -> None:
        assert self.exec_id is not None
        try:
            async for item in self.edge.exec_stream(self.sandbox_id, self.exec_id):
                if item.kind == "stdout":
                    self._append(item.data)
                elif item.kind == "stderr":  # only before SETUP joined stderr to stdout
                    self._stderr_tail = (self._stderr_tail + item.data)[-4096:]
                elif item.kind == "exit" and item.result is not None:
                    r = item.result
                    self.exit_note = (f"the session's shell exited (exit code {r.exit_code}, "
                                      f"signal {r.signal})")
                    break
                elif item.kind == "error":
                    self.exit_note = f"the session's shell is gone: {item.error}"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the sandbox went away under the session
            self.exit_note = f"the session's shell is gone: {exc!r}"
        finally:
            if not self.exit_note:
                self.exit_note = "the session's shell is gone"
            self.exited = True
            self._changed.set()

