"""SWE-ReX bash sessions on top of the edge's exec, on a terminal.

Each command of a session is its own exec of the platform shell (bash-static, exec'd by the
agent from an fd: never a shell of the sandbox's tree) on a terminal (a PTY exec, 80x24 as
pexpect's, ``TERM=xterm-256color``): its stdin and stdout are the terminal, as under
SWE-ReX's own server (bash under pexpect), so ``python`` without ``-i`` prompts, ``less``
pages, ``ls`` prints columns and ^C goes through the line discipline. Its exit code and the
end of its output are the agent's: the exit status of the process it waited on, and the end
of that process. Nothing the session's shell prints is parsed for them, so no process of the
sandbox can forge a command's end or status (a marker printed by a long-lived shell, as
SWE-ReX's PS1 and ``echo $?``, can be: by redefining ``printf``, a DEBUG trap or a
``PROMPT_COMMAND``, or by a background process that writes to the terminal). The status the
agent waits for is still the one the shell exits with, so the framing's own path must not be
the session's to change: the whole script is one ``{ ... }`` parsed before any of it runs (no
alias of the session reaches the framing); the state defines the session's functions last and
calls nothing after them; the framing enters POSIX mode with ``(( POSIXLY_CORRECT=1 ))`` to
``unset -f builtin`` (a function named ``builtin`` does not outlive its command) and calls
everything else as ``builtin NAME``; its exit function is read-only and called directly at the
end of the command, whose traps are dropped. What a command writes to the state channel itself
is still code the next shell runs (docs/security.md, known gaps).

The session's state is carried from one command to the next by the platform shell: at exit
(an EXIT trap) it writes its variables (``declare -p``), functions, aliases, ``set``/``shopt``
options, cwd and umask to its stderr, which is not the terminal but a pipe of its own
(``pty_stderr``) and carries nothing else (the command's own stderr is joined to the
terminal, in order, as on a terminal; what a command writes to the inherited fd only changes
the session's own state); the next command's shell evals that first. The state stays on the
host, in this object. The script (state, framing, command) is the shell's ``-c`` string; a
state too large for one exec (over ``MAX_INLINE_SCRIPT``) goes in a file of the sandbox's
``/tmp`` that the host removes when the command ends. The state is the session's own: what
earlier commands defined (a function named like a tool, an alias, a changed PATH) applies to
later ones, as in any shell session, so a session an agent used is the agent's; grade in a
fresh sandbox.

``is_interactive_command`` lines go to the terminal of the latest still-running command (its
echo is removed from the output as SWE-ReX does); with none running, the line starts one.
An interrupt types ^C (``n_retry`` times, ``timeout`` each), then kills the command's process
group as SWE-ReX's ``kill -9 %1`` does, and the next command's output starts with bash's job
notice for it (``[1]+  Killed  ...``).

Differences from a long-lived ``bash -i``: the shell is not interactive (``$-`` has no ``i``;
aliases are expanded anyway); traps, jobs and open file descriptors do not outlive a command
(background processes keep running, ignoring SIGHUP as under ``nohup``, but their output
ends with the command: redirect it);
``exit`` ends the session; an interrupted or failed command (``set -e``, ``set -u``) does not;
a function named ``builtin`` is dropped at the end of its command, a read-only or nameref
``POSIXLY_CORRECT`` is not carried, and functions keep their export, read-only and trace
attributes (applied after the framing).

Owns the sessions' framing and state only; the sandbox's lifetime belongs to the edge.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import signal
import subprocess
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
# The script goes in the exec (one argument: below the kernel's 128 KiB per argument and the
# agent's 128 KiB packet with the image's environment); a larger one goes through a file.
MAX_INLINE_SCRIPT = 96 << 10
PTY_COLS, PTY_ROWS = 80, 24  # pexpect's default, as SWE-ReX's own sessions
STARTUP_TIMEOUT_MIN_S = 10.0  # exec start + sourcing on a loaded node; SWE-ReX's 1 s is tight
INTERRUPT_TIMEOUT_MIN_S = 0.5
SYNTAX_CHECK_TIMEOUT_S = 10.0
CTRL_C = b"\x03"
SCRIPT_DIR = "/tmp"
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")

STATE_HEADER = b"rollbox-session-state 1 "
# A script too large for the exec: read from its file (exactly its bytes), then run.
# Before a checked command: wait for the host's go, ^D typed into the terminal (the end of
# file of a canonical-mode read, which the terminal does not echo), sent once the host's
# `bash -n` passed; the exec starts meanwhile (a failed check kills it before it reads on).
GATE = "read -r __rbx_go\n"
CTRL_D = b"\x04"
BOOT_FILE = ('LC_ALL=C read -r -N {n} __rbx_src < {path} || builtin exit 125; '
             'eval "$__rbx_src"')
# Before the state: keep the exec's stderr (the state channel) on a private fd; errors of
# restoring the state (readonly variables...) go nowhere. Then `{`: the rest of the script
# (state, framing, command, tail) is one compound command, parsed before any of it runs, so an
# alias the state defines never reaches the framing (only the command's own `eval` sees it).
PRE = "exec {__rbx_err}>&2 2>/dev/null\n{\n"
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
# SIGHUP ignored (inherited, as under nohup): the shell is its terminal's session leader, and
# its exit hangs the terminal up, which sends SIGHUP to the terminal's process group, the
# command's background jobs included; they outlive the command, as in a long-lived shell.
_FRAME = r"""__rbx_pc= __rbx_pcv=
if [[ -v POSIXLY_CORRECT ]]; then __rbx_pc=1 __rbx_pcv=$POSIXLY_CORRECT; fi
(( POSIXLY_CORRECT=1 ))
unset -f builtin
exec 2>&1
builtin unalias -- '{' '}' 2>/dev/null
builtin unset POSIXLY_CORRECT
builtin unset __rbx_ran __rbx_sig __rbx_exit __rbx_x
exit() { __rbx_exit=1; builtin exit "$@"; }
__rbx_end() {
  __rbx_so=$SHELLOPTS __rbx_bo=$BASHOPTS __rbx_pc= __rbx_pcv= __rbx_pca=
  [[ ! -v POSIXLY_CORRECT ]] || __rbx_pc=1 __rbx_pcv=$POSIXLY_CORRECT
  (( POSIXLY_CORRECT=1 ))
  unset -f builtin enable
  set +eux +o pipefail
  enable builtin printf set shopt declare alias umask exit unset trap enable
  builtin trap - EXIT RETURN DEBUG ERR
  [[ -R POSIXLY_CORRECT ]] && __rbx_pca=n || __rbx_pca=${POSIXLY_CORRECT@a}
  builtin unset POSIXLY_CORRECT
  if [[ -n ${__rbx_exit-} ]]; then __rbx_how=exit
  elif [[ -n ${__rbx_sig-} ]]; then __rbx_how=sig
  else __rbx_how=${__rbx_ran:-error}; fi
  {
    builtin printf 'rollbox-session-state 1 %s\n__rbx_so=%q __rbx_bo=%q __rbx_xt=%q\n' \
      "$__rbx_how" "$__rbx_so" "$__rbx_bo" "${__rbx_x//[!x]}"
    __rbx_known=' '
    for __rbx_v in NAMES; do
      case $__rbx_v in SKIP|POSIXLY_CORRECT) continue;; esac
      builtin declare -p "$__rbx_v"
      __rbx_known+="$__rbx_v "
    done
    builtin alias -p
    builtin printf '__rbx_known=%q\nbuiltin cd -- %q\n' "$__rbx_known" "$PWD"
    builtin umask -p
    builtin unset -f exit
    builtin declare -f
    if [[ -n $__rbx_pc && $__rbx_pca != *[rn]* ]]; then
      builtin printf 'POSIXLY_CORRECT=%q\n' "$__rbx_pcv"
      [[ $__rbx_pca != *x* ]] || builtin printf 'export POSIXLY_CORRECT\n'
    fi
  } >&"$__rbx_err"
  builtin exit "$__rbx_rc"
}
builtin readonly -f __rbx_end
builtin trap '{ __rbx_rc=$? __rbx_x=${__rbx_x-$-}; \__rbx_end; } 2>/dev/null' EXIT
builtin trap '__rbx_sig=1; \builtin exit 130' INT
builtin trap '__rbx_sig=1; \builtin exit 143' TERM
builtin trap '' HUP
if [[ -n $__rbx_pc ]]; then POSIXLY_CORRECT=$__rbx_pcv; fi
"""
# Restores the state the shell was given (after it, before the command).
_RESTORE = r"""if [[ -n ${__rbx_known-} ]]; then  # exported variables the session had unset stay unset
  for __rbx_v in NAMES; do
    case $__rbx_v in SKIP) continue;; esac
    [[ ${!__rbx_v@a} != *x* || $__rbx_known == *" $__rbx_v "* ]] || builtin unset "$__rbx_v"
  done
fi
builtin shopt -s expand_aliases
if [[ -v __rbx_so ]]; then  # the options: on now and not then: off; then those of then: on
  __rbx_l=$SHELLOPTS:
  while [[ -n $__rbx_l ]]; do
    __rbx_o=${__rbx_l%%:*} __rbx_l=${__rbx_l#*:}
    [[ :$__rbx_so: == *:"$__rbx_o":* ]] || builtin set +o "$__rbx_o"
  done 2>/dev/null
  __rbx_l=$BASHOPTS:
  while [[ -n $__rbx_l ]]; do
    __rbx_o=${__rbx_l%%:*} __rbx_l=${__rbx_l#*:}
    [[ :$__rbx_bo: == *:"$__rbx_o":* ]] || builtin shopt -u "$__rbx_o"
  done 2>/dev/null
  __rbx_l=$__rbx_bo:
  while [[ -n ${__rbx_l#:} ]]; do
    __rbx_o=${__rbx_l%%:*} __rbx_l=${__rbx_l#*:}
    builtin shopt -s "$__rbx_o"
  done 2>/dev/null
  __rbx_l=$__rbx_so:
  while [[ -n ${__rbx_l#:} ]]; do
    __rbx_o=${__rbx_l%%:*} __rbx_l=${__rbx_l#*:}
    builtin set -o "$__rbx_o"
  done 2>/dev/null
  if [[ -n ${__rbx_xt-} ]]; then { builtin set -x; } 2>/dev/null; fi
fi
"""
POST = (_FRAME + _RESTORE).replace("NAMES", _NAMES).replace("SKIP", _SKIP)
# After the command (which runs as `builtin eval $'...'`): the framing's end, called directly
# (the command's own EXIT trap, if it set one, is dropped there, not run).
TAIL = "{ __rbx_ran=ran __rbx_rc=$? __rbx_x=$-; __rbx_end; } 2>/dev/null\n}\n"


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


# What `declare -f` prints after a function with attributes (exported, read-only, traced):
# a command, which would run after the state's own functions are defined (a `declare` or
# `builtin` of the session's). Taken out of the state and applied by the framing instead.
_FUNC_ATTRS = re.compile(rb"^declare -f([a-z]+) (\S+)\n", re.MULTILINE)


def session_script(state: bytes, command: str) -> bytes:
    """What a session command's shell evals: the previous state, the framing, the command."""
    attrs = [(m.group(1).decode(), m.group(2).decode("utf-8", "surrogateescape"))
             for m in _FUNC_ATTRS.finditer(state)]
    state = _FUNC_ATTRS.sub(b"", state)
    apply = "".join(f"builtin declare -f{flags} -- {ansi_c_quote(name)} 2>/dev/null\n"
                    for flags, name in attrs if flags.isalpha())
    tail = f"{apply}builtin eval {ansi_c_quote(command)}\n{TAIL}"
    return PRE.encode() + state + POST.encode() + tail.encode("utf-8", "surrogateescape")


def parse_state(channel: bytes) -> tuple[str, bytes] | None:
    """(how the shell ended, state) from a command's stderr; None if it wrote none (killed)."""
    if not channel.startswith(STATE_HEADER):
        return None
    how, _, state = channel[len(STATE_HEADER):].partition(b"\n")
    return how.decode(errors="replace"), state


class SyntaxChecker:
    """The host's ``bash -n`` (parse only: no expansion, nothing executed; the platform's own
    work never runs a binary from the sandbox), with one process spawned ahead: spawning it and
    reaping it through asyncio's child watcher are most of a check's time. The processes are
    driven from worker threads. Owned by the routes' lifetime (``close``)."""

    def __init__(self) -> None:
        self._spare: subprocess.Popen[bytes] | None = None
        self._refill: asyncio.Future[None] | None = None
        self._closed = False

    @staticmethod
    def _spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(["bash", "-n"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)

    @staticmethod
    def _discard(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.communicate()

    def _fill(self) -> None:
        try:
            proc = self._spawn()
        except OSError as exc:
            log.warning("swe-rex syntax check: spawning bash -n failed: %r", exc)
            return
        if self._closed or self._spare is not None:
            self._discard(proc)
        else:
            self._spare = proc

    @staticmethod
    def _run(proc: subprocess.Popen[bytes], command: str) -> tuple[bytes, bytes]:
        try:
            return proc.communicate(command.encode(), timeout=SYNTAX_CHECK_TIMEOUT_S)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise

    async def check(self, command: str) -> None:
        """Raise BashIncorrectSyntaxError if ``bash -n`` rejects ``command``."""
        if self._closed:
            raise RuntimeError("the syntax checker is closed")
        proc, self._spare = self._spare, None
        if proc is None:
            proc = await asyncio.to_thread(self._spawn)
        try:
            out, err = await asyncio.to_thread(self._run, proc, command)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"bash -n took over {SYNTAX_CHECK_TIMEOUT_S} s") from None
        finally:  # the next one, spawned once this one is done (not competing with it)
            if not self._closed and (self._refill is None or self._refill.done()):
                self._refill = asyncio.ensure_future(asyncio.to_thread(self._fill))
        if proc.returncode == 0:
            return
        stdout = out.decode(errors="backslashreplace")
        stderr = err.decode(errors="backslashreplace")
        raise wire.RemoteError(
            wire.BashIncorrectSyntaxError,
            f"Error (exit code {proc.returncode}) while checking bash command \n{command!r}\n"
            f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}",
            bash_stdout=stdout, bash_stderr=stderr)

    async def close(self) -> None:
        self._closed = True
        if self._refill is not None:
            with contextlib.suppress(BaseException):
                await self._refill
        proc, self._spare = self._spare, None
        if proc is not None:
            await asyncio.to_thread(self._discard, proc)


class SessionGone(Exception):
    """The session ended (``exit``, closed, sandbox deleted)."""


class _Command:
    """One command of a session: one exec of the platform shell, its output and its end."""

    def __init__(self, exec_id: str, command: str, script_file: str | None = None) -> None:
        self.exec_id = exec_id
        self.command = command
        self.script_file = script_file  # a large script's file in the sandbox, removed at end
        self.killed = False  # by an interrupt that ^C did not end
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
    def __init__(self, edge: EdgeAPI, sandbox_id: str, name: str,
                 checker: SyntaxChecker) -> None:
        self.edge = edge
        self.checker = checker
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
        self._notice = ""  # bash's job notice of a killed command, for the next output
        self._cleanup: set[asyncio.Task[None]] = set()
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
            self._remove_script(cmd)
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

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
        # the host's `bash -n` runs while the exec starts; the command runs only if it passes
        syntax = asyncio.ensure_future(self.checker.check(action.command))
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
        output = self._take_notice() + output
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
        """A line typed into the terminal of the latest still-running command (gdb, a
        REPL...); with no command running, the line starts one (with the session's state,
        and carrying back what it changes, like any command). Without ``expect`` strings the
        output of ``timeout`` seconds (0.5 s if unset) is returned; ``is_interactive_quit``
        waits for the command to end. The terminal's echo of the line is removed from the
        output, as SWE-ReX does."""
        async with self._lock:
            cmd = self._foreground()
            if cmd is None:
                cmd = await self._start(action.command)
            else:
                await self._stdin(cmd, (action.command + "\n").encode())
            expect = [e.encode() for e in action.expect]
            if action.is_interactive_quit:
                timeout = action.timeout or 5.0
                if not await self._wait(lambda: cmd.finished or None, timeout):
                    raise wire.RemoteError(wire.CommandTimeoutError,
                                           f"timeout after {timeout} seconds while "
                                           f"running command {action.command!r}")
                if self.exited:
                    raise SessionGone(self.exit_note)
                return wire.BashObservation(output=self._take_notice() + _unecho(
                    cmd.consume(), action.command), exit_code=0)
            if not expect:
                await asyncio.sleep(action.timeout if action.timeout is not None else 0.5)
                return wire.BashObservation(output=self._take_notice() + _unecho(
                    cmd.consume(), action.command), exit_code=0)
            got = await self._wait(lambda: cmd.find(expect), action.timeout)
            if got is None:
                raise wire.RemoteError(wire.CommandTimeoutError,
                                       f"timeout after {action.timeout} seconds while running "
                                       f"command {action.command!r}")
            return wire.BashObservation(output=self._take_notice() + _unecho(
                got[0], action.command), exit_code=0, expect_string=got[1])

    async def interrupt(self, action: wire.BashInterruptAction) -> wire.BashObservation:
        """Ctrl-C for the latest still-running command, as SWE-ReX's server does: ^C typed
        into its terminal (the line discipline signals its foreground process group), up to
        ``n_retry`` times, ``timeout`` each, until the command ended; then its process group
        is killed (SWE-ReX: ``kill -9 %1``; the session keeps the state the last finished
        command left, and the next output starts with bash's ``Killed`` notice)."""
        self._interrupts += 1
        self._changed.set()  # a waiting run gives up and releases the lock
        timeout = max(action.timeout, INTERRUPT_TIMEOUT_MIN_S)
        async with self._lock:
            if self.exited:
                raise SessionGone(self.exit_note)
            cmd = self._foreground()
            if cmd is None:
                return wire.BashObservation(output="", exit_code=0)
            expect = [e.encode() for e in action.expect]
            for attempt in range(max(action.n_retry, 1) + 1):
                if attempt < max(action.n_retry, 1):
                    await self._stdin(cmd, CTRL_C)
                else:
                    cmd.killed = True
                    with contextlib.suppress(errors.BadRequest):  # ended meanwhile
                        await self.edge.exec_kill(self.sandbox_id, cmd.exec_id, signal.SIGKILL)
                def ended_or_expected() -> tuple[str, str] | None:
                    return ("", "") if cmd.finished else cmd.find(expect)

                got = await self._wait(ended_or_expected, timeout)
                if got is not None:
                    if self.exited:
                        raise SessionGone(self.exit_note)
                    if got[1]:  # an expect string seen: the program is still up
                        return wire.BashObservation(output=got[0].strip(), exit_code=0,
                                                    expect_string=got[1])
                    return wire.BashObservation(output=cmd.consume().strip(), exit_code=0)
        tail = clean_output(bytes(cmd.buf[-2000:]))
        raise wire.RemoteError(wire.CommandTimeoutError,
                               f"Failed to interrupt session; last output: {tail!r}")

    def _take_notice(self) -> str:
        notice, self._notice = self._notice, ""
        return notice

    # ---- execs ----
    def _foreground(self) -> _Command | None:
        self._running = [c for c in self._running if not c.finished]
        return self._running[-1] if self._running else None

    async def _start(self, command: str, gate: asyncio.Future[None] | None = None) -> _Command:
        """A new exec of the platform shell on a terminal, running ``command`` after the
        session's state; with ``gate``, the exec starts meanwhile and waits at ``GATE``: it
        goes on once that succeeds, else it is killed and the gate's error raised."""
        if self.exited:
            raise SessionGone(self.exit_note)
        script = session_script(self._state, command)
        text = script.decode("utf-8", "surrogateescape")
        script_file = None
        if len(script) > MAX_INLINE_SCRIPT or not _encodes(text):
            script_file = f"{SCRIPT_DIR}/.rollbox-swerex-{secrets.token_hex(12)}"
            text = BOOT_FILE.format(n=len(script), path=script_file)
        if gate is not None:
            text = GATE + text
        try:
            if script_file is not None:
                await self.edge.file_write(self.sandbox_id, script_file, script, 0o600)
            spec = ExecSpec(cmd=text, pty=PtySize(cols=PTY_COLS, rows=PTY_ROWS),
                            pty_stderr=True)
            exec_id = await self.edge.exec_start(self.sandbox_id, spec)
        except BaseException:
            if script_file is not None:
                with contextlib.suppress(errors.RollboxError):
                    await self.edge.file_remove(self.sandbox_id, script_file, False)
            raise
        self.exec_id = exec_id
        cmd = _Command(exec_id, command, script_file)
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
            await self._stdin(cmd, CTRL_D)
        return cmd

    def _remove_script(self, cmd: _Command) -> None:
        path, cmd.script_file = cmd.script_file, None
        if path is None:
            return

        async def remove() -> None:
            with contextlib.suppress(errors.RollboxError):
                await self.edge.file_remove(self.sandbox_id, path, False)

        task = asyncio.ensure_future(remove())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

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
        self._remove_script(cmd)
        got = None if cmd.channel_over else parse_state(bytes(cmd.channel))
        if cmd.channel_over:
            log.warning("swe-rex session %s: state over %d bytes not carried over", self.name,
                        MAX_STATE)
        if got is not None:
            how, self._state = got
        else:  # a signal (an interrupt's SIGKILL) keeps the session; else `exit` or `exec` left it
            how = "killed" if cmd.result is not None and cmd.result.signal else "exit"
        if cmd.killed and cmd.result is not None and cmd.result.signal == signal.SIGKILL:
            # what bash prints for a job killed by `kill -9 %1` (SWE-ReX's interrupt fallback)
            self._notice = f"[1]+  Killed                  {cmd.command}\n"
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


def _encodes(text: str) -> bool:
    """Whether ``text`` goes to the edge as UTF-8 (a state with bytes that are not UTF-8
    does not: it takes the file)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _unecho(output: str, line: str) -> str:
    """Output after a line typed into a terminal, less the terminal's echo of it (SWE-ReX:
    ``output.lstrip().removeprefix(command).strip()``)."""
    return output.lstrip().removeprefix(line.strip()).strip()
