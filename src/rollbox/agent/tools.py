"""The platform's own tools (busybox applets) run in a sandbox's root through its agent.

Where the host can not touch a sandbox's files (a microVM: the host never mounts a filesystem
the guest could write), file operations run the platform's own busybox inside the sandbox's
root, by descriptor (``EXEC_PLATFORM_TOOL``: argv[0] is the applet; never a binary of the
sandbox's tree), as its root. Everything such a tool sends back passed through a guest whose
root may have replaced the agent, so it is hostile input: output is capped (the command is
killed past the cap), memory stays bounded whatever the size (a stream's command is stopped
with SIGSTOP while the consumer is behind and continued after; one that keeps sending while
stopped is killed), every run has a deadline on the host side too (its start included), and
messages are mapped to typed errors without ever trusting them to be well formed. A run can be
cut from outside (:meth:`PlatformTools.interrupt`: a microVM being paused stops its agent, so
what waits on it fails at once instead of waiting out the deadline).

Owns: running one applet and the mapping of its messages to errors. Not: what the applets do
(``rollbox.agent.files``), the channel (``rollbox.agent.channel``).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as errno_mod
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from rollbox import errors
from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel, Session

# A tool's stderr kept for its error message (the rest is dropped by the agent).
MAX_STDERR = 4096
DEFAULT_TIMEOUT_S = 60.0
# Host-side grace past the agent's own deadline before the host gives up on the guest.
HOST_GRACE_S = 10.0
# Flow control of a stream: stop the command past HIGH buffered bytes, continue below LOW;
# past HARD (a command that keeps sending while stopped) it is killed.
HIGH_WATER = 4 << 20
LOW_WATER = 1 << 20
HARD_WATER = 32 << 20
# A stream whose tool sends nothing and does not end for this long is given up (killed).
STREAM_IDLE_S = 120.0
# A tool the agent has not started within this long is given up.
START_TIMEOUT_S = 60.0

# strerror text -> errno, to read busybox's "applet: can't open 'x': No such file or directory".
_STRERRORS = sorted(((os.strerror(e), e) for e in errno_mod.errorcode), key=lambda t: -len(t[0]))

Request = Callable[[list[str], bool, int, int], P.ExecRequest]


def tool_request(argv: list[str], stdin: bool, timeout_ms: int, stream_limit: int
                 ) -> P.ExecRequest:
    """The agent request running busybox applet ``argv[0]`` by descriptor as root."""
    return P.ExecRequest(argv=argv, env=[], cwd="/", uid=0, gid=0, timeout_ms=timeout_ms,
                         stdin=stdin, stream_limit=stream_limit, tail_limit=0,
                         platform_tool=True)


@dataclass
class ToolResult:
    code: int  # exit code (-1: killed by a signal)
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.code == 0

    def message(self) -> str:
        """The tool's first error line, printable and short (it came from the guest)."""
        line = self.stderr.split(b"\n", 1)[0][:300].decode("utf-8", "replace")
        return "".join(c if c.isprintable() else "?" for c in line)


def errno_of(message: str) -> int | None:
    """The errno a busybox message names by its strerror text (None: none recognised)."""
    for text, e in _STRERRORS:
        if message.endswith(text) or f": {text}" in message:
            return e
    return None


def tool_error(res: ToolResult, path: str, what: str) -> errors.RollboxError:
    """The typed error of a failed tool run on sandbox ``path`` (the file API's mapping)."""
    from rollbox.hostfs import _os_error as os_error  # one mapping

    msg = res.message()
    e = errno_of(msg)
    if e is not None:
        return os_error(OSError(e, os.strerror(e)), path)
    return errors.InfraError(f"{what} failed on {path} in the sandbox (exit {res.code}): "
                             f"{msg or 'no message'}", path=path)


class _Run:
    """One tool session: its stdout buffered (bounded by flow control), stderr's head kept."""

    def __init__(self, sess: Session, max_stdout: int, flow: bool,
                 cut: asyncio.Future[None]) -> None:
        self.sess = sess
        self.max_stdout = max_stdout
        self.flow = flow
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.total = 0
        self.stderr = bytearray()
        self.exited: P.Exited | None = None
        self.failure: BaseException | None = None
        self.stopped = False
        self.was_cut = False
        self.wake = asyncio.Event()
        self.pump = asyncio.ensure_future(self._pump())
        cut.add_done_callback(self._on_cut)

    def _on_cut(self, cut: asyncio.Future[None]) -> None:
        """Interrupted from outside: fail now, whatever the sandbox does (see close())."""
        if self.pump.done():
            return
        self.failure = cut.exception()
        self.was_cut = True
        self.pump.cancel()
        self.wake.set()

    async def _pump(self) -> None:
        try:
            async for kind, value in self.sess.events():
                if kind == "stdout":
                    self.total += len(value)
                    if self.total > self.max_stdout:
                        raise _Overflow()
                    self.chunks.append(value)
                    self.buffered += len(value)
                    if self.flow and self.buffered > HARD_WATER:
                        raise errors.InfraError("the sandbox kept sending while told to stop")
                    if self.flow and self.buffered > HIGH_WATER and not self.stopped:
                        self.stopped = True
                        await self.sess.signal(signal.SIGSTOP)
                elif kind == "stderr":
                    if len(self.stderr) < MAX_STDERR:
                        self.stderr += value[: MAX_STDERR - len(self.stderr)]
                elif kind == "exited":
                    self.exited = value
                self.wake.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            if self.was_cut:
                return  # close() kills it without waiting
            self.failure = exc
            with contextlib.suppress(errors.RollboxError):
                await self.sess.kill()
        finally:
            self.wake.set()

    async def take(self) -> bytes | None:
        """The next stdout chunk; None at the end (then ``exited`` or ``failure`` is set)."""
        while True:
            if self.failure is not None:
                return None  # failed (flood, overflow, channel): what is buffered is moot
            if self.chunks:
                data = self.chunks.popleft()
                self.buffered -= len(data)
                if self.stopped and self.buffered < LOW_WATER:
                    self.stopped = False
                    await self.sess.signal(signal.SIGCONT)
                return data
            if self.pump.done():
                return None
            self.wake.clear()
            try:  # waiting for the sandbox, not for our consumer: bounded
                async with asyncio.timeout(STREAM_IDLE_S):
                    await self.wake.wait()
            except TimeoutError:
                raise errors.InfraError(f"a platform tool's stream from the sandbox sent nothing "
                                        f"for {STREAM_IDLE_S:.0f}s") from None

    async def close(self) -> None:
        if self.was_cut:
            # The sandbox may not read now (a stopped VM): the kill is queued on the channel,
            # not awaited; it is delivered when the sandbox runs again.
            kill = asyncio.ensure_future(self.sess.kill())
            kill.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.wait({self.pump})
            return
        if not self.pump.done():
            with contextlib.suppress(errors.RollboxError):
                await self.sess.kill()
            # Wait for its end: a command still starting could create files after a clean-up.
            # wait() never raises the pump's end, and a cancellation of the caller still
            # propagates (a suppress(BaseException) here swallowed it)
            try:
                await asyncio.wait({self.pump}, timeout=HOST_GRACE_S)
            finally:
                self.pump.cancel()
            await asyncio.wait({self.pump})


class _Overflow(Exception):
    """The tool's stdout went past its cap."""


class PlatformTools:
    """Runs platform applets in one sandbox's root. ``channel`` gives the sandbox's current
    agent channel (a handle's channel is replaced when the edge reconnects)."""

    def __init__(self, channel: Callable[[], AgentChannel], *,
                 request: Request = tool_request,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._channel = channel
        self._request = request
        self.timeout_s = timeout_s
        self.peak_buffered = 0  # most stdout bytes a stream held at once (diagnostics, tests)
        self._cut: asyncio.Future[None] | None = None  # failed by interrupt()

    def interrupt(self, exc: errors.RollboxError) -> None:
        """Fail every run in progress with ``exc`` at once (their tools are killed when the
        sandbox reads again); later runs are not affected."""
        if self._cut is not None and not self._cut.done():
            self._cut.set_exception(exc)
        self._cut = None

    def _cut_future(self) -> asyncio.Future[None]:
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
            self._cut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._cut

    async def _start(self, argv: list[str], stdin: bool, timeout_s: float | None,
                     max_stdout: int, cut: asyncio.Future[None]) -> Session:
        """The tool's session once the agent started it: bounded by START_TIMEOUT_S and cut
        by :meth:`interrupt` (a stopped guest never answers)."""
        timeout_ms = 0 if timeout_s is None else max(1, int(timeout_s * 1000))
        req = self._request(argv, stdin, timeout_ms, max_stdout + 1)
        start = asyncio.ensure_future(self._channel().exec(req))
        try:
            await asyncio.wait({start, cut}, timeout=START_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not start.done():
                start.cancel()  # the channel kills a command it may have started
                with contextlib.suppress(asyncio.CancelledError, BaseException):
                    await start
        if start.cancelled():
            if cut.done() and not cut.cancelled() and cut.exception() is not None:
                raise cut.exception()  # type: ignore[misc]
            raise errors.InfraError(f"{argv[0]} was not started in the sandbox within "
                                    f"{START_TIMEOUT_S:.0f}s")
        return start.result()

    async def run(self, argv: list[str], *, stdin: AsyncIterator[bytes] | bytes | None = None,
                  max_stdout: int = 1 << 20, timeout_s: float | None = None,
                  overflow: Callable[[], errors.RollboxError] | None = None) -> ToolResult:
        """Run ``argv`` to its end; its whole stdout (at most ``max_stdout`` bytes: past that
        the command is killed and ``overflow()`` raised, PayloadTooLarge by default)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        cut = self._cut_future()
        sess = await self._start(argv, stdin is not None, timeout, max_stdout, cut)
        run = _Run(sess, max_stdout, flow=False, cut=cut)
        feeder = (asyncio.ensure_future(_feed(sess, stdin)) if stdin is not None else None)
        try:
            deadline = asyncio.get_running_loop().time() + timeout + HOST_GRACE_S
            waiting: set[asyncio.Future[None]] = {run.pump}
            if feeder is not None:
                waiting.add(feeder)
            while not run.pump.done():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise errors.InfraError(f"{argv[0]} did not finish in the sandbox within "
                                            f"{timeout:.0f}s")
                done, waiting = await asyncio.wait(waiting, timeout=left,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if feeder in done and feeder.exception() is not None:
                    raise feeder.exception()  # type: ignore[misc]  # the source failed
            return self._result(run, argv, overflow)
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, BaseException):
                    await feeder
            await run.close()

    async def stream(self, argv: list[str], *, max_stdout: int,
                     on_end: Callable[[ToolResult], None],
                     overflow: Callable[[], errors.RollboxError] | None = None
                     ) -> AsyncIterator[bytes]:
        """``argv``'s stdout as it comes, memory bounded by flow control. At the end
        ``on_end(result)`` (result.stdout empty) may raise the typed error of a failed run.
        Stopping the iteration early kills the command."""
        cut = self._cut_future()
        sess = await self._start(argv, False, None, max_stdout, cut)
        run = _Run(sess, max_stdout, flow=True, cut=cut)
        try:
            while (data := await run.take()) is not None:
                self.peak_buffered = max(self.peak_buffered, run.buffered + len(data))
                yield data
            on_end(self._result(run, argv, overflow))
        finally:
            await run.close()

    @staticmethod
    def _result(run: _Run, argv: list[str],
                overflow: Callable[[], errors.RollboxError] | None) -> ToolResult:
        if isinstance(run.failure, _Overflow):
            raise (overflow() if overflow is not None else errors.PayloadTooLarge(
                f"{argv[0]} output above {run.max_stdout} bytes", limit=run.max_stdout))
        if run.failure is not None:
            if isinstance(run.failure, errors.RollboxError):
                raise run.failure
            raise errors.InfraError(f"{argv[0]} failed in the sandbox: {run.failure!r}")
        if run.exited is None:
            raise errors.InfraError(f"{argv[0]} ended without an exit status")
        out = b"".join(run.chunks)
        run.chunks.clear()
        code = run.exited.exit_code if not run.exited.timed_out else -1
        if run.exited.timed_out:
            raise errors.InfraError(f"{argv[0]} timed out in the sandbox")
        return ToolResult(code, out, bytes(run.stderr))


async def _feed(sess: Session, stdin: AsyncIterator[bytes] | bytes) -> None:
    """Send ``stdin`` to the session (credit-based, see protocol.STDIN_WINDOW), then close it.
    Failures of the source are raised here; the caller kills the session."""
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        if stdin:
            await sess.write_stdin(bytes(stdin))
    else:
        try:
            async for chunk in stdin:
                if chunk:
                    await sess.write_stdin(bytes(chunk))
        finally:  # also when cancelled: the source's own clean-up runs now
            if isinstance(stdin, AsyncGenerator):
                await stdin.aclose()
    await sess.close_stdin()
