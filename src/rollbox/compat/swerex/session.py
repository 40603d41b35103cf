"""SWE-ReX bash sessions on top of the edge's exec.

Each command of a session is its own exec of the platform shell (bash-static, exec'd by the
agent from an fd: never a shell of the sandbox's tree), and its exit code and the end of its
output are the agent's: the exit status of the process it waited on, and the end of that
process's pipes. Nothing the session's shell prints is parsed for them, so no process of the
sandbox can forge a command's end or status (a marker printed by a long-lived shell can be:
by redefining ``printf``, or by a background process that reads the marker's token from the
shell's stdin pipe or memory, both of the sandbox's uid, and writes it to the shell's stdout).

The session's state is carried from one command to the next by the platform shell: at exit
(an EXIT trap) it writes its variables (``declare -p``), functions, aliases, ``set``/``shopt``
options, cwd and umask to its stderr, which carries nothing else (the command's own stderr is
joined to its stdout, in order, as on a terminal; what a command writes to the inherited fd
only changes the session's own state); the next command's shell evals that first.
The state stays on the host, in this object; no file is left in the sandbox. The script (state,
framing, command) goes to the shell's stdin, read with ``read -N <byte count>``; what follows on
that pipe is the command's stdin (``is_interactive_command`` lines for a program it started).
The state is the session's own: what earlier commands defined (a function named like a tool,
an alias, a changed PATH) applies to later ones, as in any shell session, so a session an agent
used is the agent's; grade in a fresh sandbox.

A program started by an ``is_interactive_command`` line while no command runs (``python``,
``gdb``, a pager) gets a terminal instead: a PTY exec of the platform shell given the session's
state in its argv (its stdin would be the terminal, which echoes and edits), with no framing,
so what it changes is not carried back; the lines that follow go to its terminal.

Differences from a long-lived ``bash -i``: the shell is not interactive (``$-`` has no ``i``;
aliases are expanded anyway); traps, jobs and open file descriptors do not outlive a command
(background processes keep running, but their stdout/stderr end with the command: redirect
them); ``exit`` ends the session; an interrupted or failed command (``set -e``, ``set -u``)
does not.

Owns the sessions' framing and state only; the sandbox's lifetime belongs to the edge.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import Callable
from typing import TypeVar

from rollbox import errors
from rollbox.compat.swerex import wire
from rollbox.edge.interface import EdgeAPI
from rollbox.models import ExecResult, ExecSpec, PtySize

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PENDING = 32 << 20  # unread output kept per command; older bytes are dropped beyond it
MAX_STATE = 1 << 20  # a larger state dump is not carried over (the previous one is kept)
# A program on a terminal gets the state in its argv: below the kernel's 128 KiB per argument.
MAX_PTY_SCRIPT = 120_000
PTY_COLS, PTY_ROWS = 80, 24  # pexpect's default, as SWE-ReX's own sessions
STARTUP_TIMEOUT_MIN_S = 10.0  # exec start + sourcing on a loaded node; SWE-ReX's 1 s is tight
INTERRUPT_TIMEOUT_MIN_S = 0.5
SYNTAX_CHECK_TIMEOUT_S = 10.0
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")

STATE_HEADER = b"rollbox-session-state 1 "
# Runs first in a fresh platform shell (nothing of the session is defined yet): reads exactly
# the script's bytes from stdin, leaving the rest of the pipe to the command.
BOOT = 'LC_ALL=C read -r -N {n} __rbx_src || exit 125; eval "$__rbx_src"'
# Before the state: keep the exec's stderr (the state channel) on a private fd; errors of
# restoring the state (readonly variables...) go nowhere.
PRE = "exec {__rbx_err}>&2 2>/dev/null\n"
# After the state, before the command. The EXIT trap writes the new state; how the shell ended
# heads it: "ran", "sig" (interrupted), "error" (`set -e`, `set -u`...), "exit" (the exit
# builtin: the session ends). The command's processes inherit the channel's fd (closing it
# around the command would let bash reuse its number for a saved fd by the time the trap
# runs): writing to it only changes the session's own state.
_NAMES = " ".join(f'"${{!{c}@}}"' for c in "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Variables of bash itself, not of the session (read-only, dynamic or per-process).
_SKIP = ("__rbx_*|BASH*|EUID|PPID|UID|SHELLOPTS|SHLVL|RANDOM|SRANDOM|SECONDS|EPOCH*|LINENO|"
         "HISTCMD|FUNCNAME|GROUPS|PIPESTATUS|DIRSTACK|COMP_WORDBREAKS|_")
# No subshell anywhere (a fork per command costs more than the rest): names come from ${!x@}.
_FRAME = r"""exec 2>&1
unset __rbx_ran __rbx_sig __rbx_exit __rbx_x
exit() { __rbx_exit=1; builtin exit "$@"; }
__rbx_end() {
  if [[ -n ${__rbx_exit-} ]]; then __rbx_how=exit
  elif [[ -n ${__rbx_sig-} ]]; then __rbx_how=sig
  else __rbx_how=${__rbx_ran:-error}; fi
  {
    builtin printf 'rollbox-session-state 1 %s\n__rbx_restore() {\n' "$__rbx_how"
    set +o
    shopt -p
    [[ $__rbx_x != *x* ]] || builtin printf 'set -x\n'
    builtin printf ':\n}\n'
    set +eu +o pipefail
    __rbx_known=' '
    for __rbx_v in NAMES; do
      case $__rbx_v in SKIP) continue;; esac
      declare -p "$__rbx_v"
      __rbx_known+="$__rbx_v "
    done
    declare -f
    alias -p
    builtin printf '__rbx_known=%q\nbuiltin cd -- %q\n' "$__rbx_known" "$PWD"
    umask -p
  } 2>/dev/null >&"$__rbx_err"
  builtin exit "$__rbx_rc"
}
trap '{ __rbx_rc=$? __rbx_x=${__rbx_x-$-}; set +x; } 2>/dev/null; __rbx_end' EXIT
trap '__rbx_sig=1; builtin exit 130' INT
trap '__rbx_sig=1; builtin exit 143' TERM
"""
# Restores the state the shell was given (after it, before the command).
_RESTORE = r"""if [[ -n ${__rbx_known-} ]]; then  # exported variables the session had unset stay unset
  for __rbx_v in NAMES; do
    case $__rbx_v in SKIP) continue;; esac
    [[ ${!__rbx_v@a} != *x* || $__rbx_known == *" $__rbx_v "* ]] || unset "$__rbx_v"
  done
fi
shopt -s expand_aliases
if declare -F __rbx_restore >/dev/null; then
  { __rbx_restore; unset -f __rbx_restore; } 2>/dev/null  # (an xtrace it turns on: silent)
fi
"""
POST = (_FRAME + _RESTORE).replace("NAMES", _NAMES).replace("SKIP", _SKIP)
RESTORE = _RESTORE.replace("NAMES", _NAMES).replace("SKIP", _SKIP)
# After the command (which runs as `eval $'...'`).
TAIL = "{ __rbx_ran=ran __rbx_rc=$? __rbx_x=$-; set +x; } 2>/dev/null\nbuiltin exit \"$__rbx_rc\"\n"


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


def session_script(state: bytes, command: str) -> bytes:
    """What a session command's shell evals: the previous state, the framing, the command."""
    return (PRE.encode() + state + POST.encode()
            + f"eval {ansi_c_quote(command)}\n{TAIL}".encode())


def pty_script(state: bytes, command: str) -> str:
    """What a command started on a terminal runs: the state restored (its errors silenced),
    then the command; no framing, so nothing it changes is carried back."""
    return ("{ :\n" + state.decode("utf-8", "surrogateescape") + "\n} 2>/dev/null\n" + RESTORE
            + f"eval {ansi_c_quote(command)}\n")


def parse_state(channel: bytes) -> tuple[str, bytes] | None:
    """(how the shell ended, state) from a command's stderr; None if it wrote none (killed)."""
    if not channel.startswith(STATE_HEADER):
        return None
    how, _, state = channel[len(STATE_HEADER):].partition(b"\n")
    return how.decode(errors="replace"), state


async def check_syntax(command: str) -> None:
    """Raise BashIncorrectSyntaxError if ``bash -n`` rejects ``command``.

    Runs the host's bash in parse-only mode (no expansion, nothing executed): the platform's own
    work never runs a binary from the sandbox."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-n", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(SYNTAX_CHECK_TIMEOUT_S):
            out, err = await proc.communicate(command.encode())
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
    """The session ended (``exit``, closed, sandbox deleted)."""


class _Command:
    """One command of a session: one exec of the platform shell, its output and its end."""

    def __init__(self, exec_id: str, pty: bool = False) -> None:
        self.exec_id = exec_id
        self.pty = pty  # on a terminal: no state channel, the session's state stays as it was
        self.buf = bytearray()
        self.dropped = 0
        self.channel = bytearray()  # the shell's stderr: the state it leaves
        self.channel_over = False
        self.result: ExecResult | None = None
        self.error = ""
        self.finished = False
        self.reader: asyncio.Task[None] | None = None

    def append(self, data: bytes) -> None:
        self.buf += data
        over = len(self.buf) - MAX_PENDING
        if over > 0:
            del self.buf[:over]
            self.dropped += over

    def consume(self, end: int | None = None, through: int | None = None) -> str:
        end = len(self.buf) if end is None else end
        raw = bytes(self.buf[:end])
        del self.buf[: end if through is None else through]
        text = clean_output(raw)
        if self.dropped:
            text = f"[rollbox: {self.dropped} bytes of output dropped]\n{text}"
            self.dropped = 0
        return text

    def find(self, expect: list[bytes]) -> tuple[str, str] | None:
        """(output through the first expect string found, that string), consumed."""
        for e in expect:
            i = self.buf.find(e)
            if i >= 0:
                return self.consume(i, i + len(e)), e.decode()
        return None


class BashSession:
    def __init__(self, edge: EdgeAPI, sandbox_id: str, name: str) -> None:
        self.edge = edge
        self.sandbox_id = sandbox_id
        self.name = name
        self.exec_id: str | None = None  # the latest command's
        self.exited = False
        self.exit_note = ""
        self._state = b""
        self._running: list[_Command] = []  # commands still running, oldest first
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._interrupts = 0
        self._on_done: list[Callable[[], None]] = []

    # ---- lifetime ----
    async def start(self, request: wire.CreateBashSessionRequest) -> str:
        command = "\n".join(f"source {ansi_c_quote(p)}" for p in request.startup_source)
        timeout = max(request.startup_timeout, STARTUP_TIMEOUT_MIN_S)
        cmd = await self._start(command or ":")
        if not await self._wait(lambda: cmd.finished or None, timeout):
            raise wire.RemoteError(wire.CommandTimeoutError,
                                   f"timeout after {timeout} seconds while starting the session")
        if self.exited:
            raise SessionGone(self.exit_note)
        return cmd.consume()

    async def close(self) -> None:
        self._end("the session was closed")
        running, self._running = self._running, []
        for cmd in running:
            with contextlib.suppress(errors.RollboxError):
                await self.edge.exec_kill(self.sandbox_id, cmd.exec_id, signal.SIGKILL)
            if cmd.reader is not None:
                cmd.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await cmd.reader

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self.exited:
            fn()
        else:
            self._on_done.append(fn)

    def _end(self, note: str) -> None:
        if self.exited:
            return
        self.exited = True
        self.exit_note = note
        self._changed.set()
        callbacks, self._on_done = self._on_done, []
        for fn in callbacks:
            fn()

    # ---- commands ----
    async def run(self, action: wire.BashAction) -> wire.BashObservation:
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._run_interactive(action)
        # the host's `bash -n` runs while the exec starts; the script goes in only if it passes
        syntax = asyncio.ensure_future(check_syntax(action.command))
        interrupts = self._interrupts
        async with self._lock:
            try:
                cmd = await self._start(action.command, syntax)
            finally:
                if not syntax.done():  # _start failed before waiting for it
                    syntax.cancel()
                    with contextlib.suppress(BaseException):
                        await syntax
            expect = [e.encode() for e in action.expect]

            def done() -> tuple[str, int | None, str] | None:
                got = cmd.find(expect)
                if got is not None:
                    return got[0], None, got[1]
                if cmd.finished:
                    if self.exited:
                        raise SessionGone(self.exit_note)
                    return cmd.consume(), self._exit_code(cmd), ""
                if self._interrupts != interrupts:
                    raise wire.RemoteError(wire.CommandTimeoutError,
                                           f"command {action.command!r} was interrupted")
                return None

            found = await self._wait(done, action.timeout)
            if found is None:
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
        """A line for the program the latest still-running command started (gdb, a REPL...),
        on its stdin; with no command running, the line starts one on a terminal (a PTY exec:
        ``python`` prompts, pagers page), with the session's state but without carrying back
        what it changes. Without ``expect`` strings the output of ``timeout`` seconds (0.5 s
        if unset) is returned; ``is_interactive_quit`` waits for the command to end."""
        async with self._lock:
            cmd = self._foreground()
            if cmd is None:
                cmd = await self._start_pty(action.command)
            else:
                await self._stdin(cmd, (action.command + "\n").encode())
            expect = [e.encode() for e in action.expect]
            if action.is_interactive_quit:
                timeout = action.timeout or 5.0
                if not await self._wait(lambda: cmd.finished or None, timeout):
                    raise wire.RemoteError(wire.CommandTimeoutError,
                                           f"timeout after {timeout} seconds while "
                                           f"running command {action.command!r}")
                return wire.BashObservation(output=cmd.consume().strip(), exit_code=0)
            if not expect:
                await asyncio.sleep(action.timeout if action.timeout is not None else 0.5)
                return wire.BashObservation(output=cmd.consume().strip(), exit_code=0)
            got = await self._wait(lambda: cmd.find(expect), action.timeout)
            if got is None:
                raise wire.RemoteError(wire.CommandTimeoutError,
                                       f"timeout after {action.timeout} seconds while running "
                                       f"command {action.command!r}")
            return wire.BashObservation(output=got[0].lstrip().removeprefix(action.command)
                                        .strip(), exit_code=0, expect_string=got[1])

    async def interrupt(self, action: wire.BashInterruptAction) -> wire.BashObservation:
        """Ctrl-C for the latest still-running command: SIGINT to its process group, then wait
        for it to end; after ``n_retry`` tries SIGTERM, then SIGKILL (the session's state is
        what the last finished command left)."""
        self._interrupts += 1
        self._changed.set()  # a waiting run gives up and releases the lock
        timeout = max(action.timeout, INTERRUPT_TIMEOUT_MIN_S)
        async with self._lock:
            if self.exited:
                raise SessionGone(self.exit_note)
            cmd = self._foreground()
            if cmd is None:
                return wire.BashObservation(output="", exit_code=0)
            signals = [signal.SIGINT] * max(action.n_retry, 1) + [signal.SIGTERM, signal.SIGKILL]
            for sig in signals:
                with contextlib.suppress(errors.BadRequest):  # ended meanwhile
                    await self.edge.exec_kill(self.sandbox_id, cmd.exec_id, sig)
                if await self._wait(lambda: cmd.finished or None, timeout):
                    if self.exited:
                        raise SessionGone(self.exit_note)
                    return wire.BashObservation(output=cmd.consume().strip(), exit_code=0)
        tail = clean_output(bytes(cmd.buf[-2000:]))
        raise wire.RemoteError(wire.CommandTimeoutError,
                               f"Failed to interrupt session; last output: {tail!r}")

    # ---- execs ----
    def _foreground(self) -> _Command | None:
        self._running = [c for c in self._running if not c.finished]
        return self._running[-1] if self._running else None

    async def _start(self, command: str, gate: asyncio.Future[None] | None = None) -> _Command:
        """A new exec of the platform shell running ``command``; with ``gate``, the command
        is sent only once that succeeds (else the exec is killed and its error raised)."""
        if self.exited:
            raise SessionGone(self.exit_note)
        script = session_script(self._state, command)
        spec = ExecSpec(cmd=BOOT.format(n=len(script)), stdin=True)
        exec_id = await self.edge.exec_start(self.sandbox_id, spec)
        self.exec_id = exec_id
        cmd = _Command(exec_id)
        cmd.reader = asyncio.ensure_future(self._read(cmd))
        self._running.append(cmd)
        if gate is not None:
            try:
                await gate
            except BaseException:
                self._running.remove(cmd)
                with contextlib.suppress(errors.RollboxError):
                    await self.edge.exec_kill(self.sandbox_id, exec_id, signal.SIGKILL)
                raise
        await self._stdin(cmd, script)
        return cmd

    async def _start_pty(self, command: str) -> _Command:
        """A new exec of the platform shell on a terminal running ``command`` after the
        session's state (passed in its argv: a terminal's input would echo and edit it)."""
        if self.exited:
            raise SessionGone(self.exit_note)
        script = pty_script(self._state, command)
        if len(script.encode("utf-8", "surrogateescape")) > MAX_PTY_SCRIPT:
            raise wire.RemoteError(wire.SwerexException, "the session's state is too large "
                                   f"(over {MAX_PTY_SCRIPT} bytes) to start a program on a "
                                   "terminal")
        spec = ExecSpec(cmd=script, pty=PtySize(cols=PTY_COLS, rows=PTY_ROWS))
        exec_id = await self.edge.exec_start(self.sandbox_id, spec)
        self.exec_id = exec_id
        cmd = _Command(exec_id, pty=True)
        cmd.reader = asyncio.ensure_future(self._read(cmd))
        self._running.append(cmd)
        return cmd

    async def _stdin(self, cmd: _Command, data: bytes) -> None:
        try:
            await self.edge.exec_stdin(self.sandbox_id, cmd.exec_id, data, False)
        except errors.BadRequest:  # "exec has exited": its reader says how
            pass

    @staticmethod
    def _exit_code(cmd: _Command) -> int | None:
        if cmd.result is None:
            return None
        if cmd.result.exit_code is not None:
            return cmd.result.exit_code
        return 128 + cmd.result.signal if cmd.result.signal else None

    async def _read(self, cmd: _Command) -> None:
        try:
            async for item in self.edge.exec_stream(self.sandbox_id, cmd.exec_id):
                if item.kind == "stdout":
                    cmd.append(item.data)
                    self._changed.set()
                elif item.kind == "stderr":
                    if len(cmd.channel) + len(item.data) <= MAX_STATE + len(STATE_HEADER) + 16:
                        cmd.channel += item.data
                    else:
                        cmd.channel_over = True
                elif item.kind == "exit":
                    cmd.result = item.result
                    break
                elif item.kind == "error":
                    cmd.error = f"the session's shell is gone: {item.error}"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the sandbox went away under the session
            cmd.error = f"the session's shell is gone: {exc!r}"
        finally:
            self._settle(cmd)

    def _settle(self, cmd: _Command) -> None:
        """A command ended: take the state it left; end the session on ``exit`` or a lost
        sandbox."""
        cmd.finished = True
        if cmd.pty:  # a program on a terminal: the session goes on with the state it had
            if cmd.error:
                self._end(cmd.error)
            self._changed.set()
            return
        got = None if cmd.channel_over else parse_state(bytes(cmd.channel))
        if cmd.channel_over:
            log.warning("swe-rex session %s: state over %d bytes not carried over", self.name,
                        MAX_STATE)
        if got is not None:
            how, self._state = got
        else:  # a signal (an interrupt's SIGKILL) keeps the session; else `exit` or `exec` left it
            how = "killed" if cmd.result is not None and cmd.result.signal else "exit"
        if how == "exit" and cmd.result is not None:
            self._end(f"the session's shell exited (exit code {self._exit_code(cmd)})")
        if cmd.error:
            self._end(cmd.error)
        elif cmd.result is None and not self.exited:
            self._end("the session's shell is gone")
        self._changed.set()

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
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
