"""Edge-side client of the in-sandbox agent (``native/agent/agent.c``), over either transport.

One :class:`AgentChannel` per sandbox connection; many concurrent :class:`Session` objects on it.
:meth:`AgentChannel.connect`: the container's SEQPACKET socket (one packet per message,
SCM_RIGHTS for session cgroups); :meth:`AgentChannel.connect_stream`: a byte stream (a microVM's
virtio-serial port behind QEMU's unix socket chardev) with length-prefixed frames and the
HELLO/SYNC handshake. asyncio streams neither keep packet boundaries nor carry SCM_RIGHTS, so
the channel drives a non-blocking socket with ``loop.add_reader``/``add_writer``.

Everything the agent sends is parsed as hostile (a guest's root owns its agent): a frame that is
too short or too long, a message that does not decode, output past the ``stream_limit`` the edge
asked for (or past the tail/replay bounds), or more unclaimed exits than an agent can hold closes
the channel with :class:`~rollbox.errors.AgentProtocolError`; memory is bounded by one partial
frame plus one read, and each session's queue by the limits its exec asked for (each session
has its own queue so one slow consumer never stalls the others or the socket).

Wire format: :mod:`rollbox.agent.protocol`.
"""
from __future__ import annotations

import asyncio
import collections
import errno as errno_mod
import itertools
import random
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollbox.agent import protocol as P
from rollbox.errors import AgentProtocolError, BadRequest, InfraError, RollboxError, SandboxDead

# "stdout" | "stderr" | "replay_stdout" | "replay_stderr" (an adopted session's retained
# output, from ``start_offsets``) | "tail_stdout" | "tail_stderr" (just before "exited", the
# last bytes of the stream ending at the exit's total, may overlap what was yielded; only when
# this Session missed bytes) | "exited"
EventKind = str
Event = tuple[EventKind, Any]  # (kind, bytes) or ("exited", protocol.Exited)

_STREAM_KINDS = {
    P.STDOUT: "stdout",
    P.STDERR: "stderr",
    P.TAIL_STDOUT: "tail_stdout",
    P.TAIL_STDERR: "tail_stderr",
}

# Bounds on what an agent may send (beyond them: AgentProtocolError).
TAIL_MAX = 64 << 10            # TAIL_* per stream at exit (the agent's TAIL_SEND_MAX)
REPLAY_MAX = 16 << 20          # REPLAY_* per stream (the agent's TAIL_LIMIT_MAX)
UNCLAIMED_EXITS_MAX = 4096     # EXITED of sessions this channel does not know (PENDING_EXITED_MAX)
HUNT_MAX = 16 << 20            # stream: bytes skipped looking for SYNC (an earlier connection's)
RECV_CHUNK = 256 << 10         # stream: one read
# Bytes read per wakeup of the socket: an agent that keeps the socket full as fast as it is
# read (2 cores) made one wakeup read up to 16 MiB before a consumer ran, and a tool stream
# stopped at 4 MiB buffered held 6-12 MiB (test_agent_files' stream, 4 of 15 runs under load).
READ_BUDGET = 1 << 20
HELLO_RESEND_S = 1.0           # stream: HELLO again until SYNC (a misaligned agent missed it)


class SpawnError(BadRequest):
    """The agent could not start the command (bad cwd, missing binary, bad user...)."""

    def __init__(self, err: int, message: str) -> None:
        super().__init__(message, errno=err)
        self.errno = err


class Session:
    """One command running in the sandbox. Created by :meth:`AgentChannel.exec`."""

    def __init__(self, channel: "AgentChannel", session_id: int, collect: bool = True,
                 stream_limit: int = P.ExecRequest.stream_limit,
                 replay_limit: int = REPLAY_MAX) -> None:
        self.channel = channel
        self.id = session_id
        # What the agent may send per stream (stdout, stderr); more is a protocol violation.
        self._allowed = {"stdout": stream_limit, "stderr": stream_limit,
                         "tail_stdout": TAIL_MAX, "tail_stderr": TAIL_MAX,
                         "replay_stdout": replay_limit, "replay_stderr": replay_limit}
        self._received = dict.fromkeys(self._allowed, 0)
        self.pid: int | None = None
        # collect: free the agent's copy as soon as the exit arrives; else the owner calls
        # collect() once it has recorded the exit (the edge, after journaling it).
        self.collect_on_exit = collect
        # Stream offsets of the first byte this Session yields (non-zero after an adopt whose
        # replay could not reach back to the start: the agent keeps only the last bytes).
        self.start_offsets = [0, 0]
        self._replaying = False
        self._replay_seen = [False, False]
        self._held_exit: P.Exited | None = None
        self._tails: dict[str, bytearray] = {}  # TAIL_* held until EXITED says if needed
        self._queue: asyncio.Queue[Event | RollboxError] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._started: asyncio.Future[int] = loop.create_future()
        self._exited: asyncio.Future[P.Exited] = loop.create_future()
        self._events_done = False
        # stdin credit: bytes sent but not yet acknowledged by STDIN_ACK (<= STDIN_WINDOW)
        self._stdin_unacked = 0
        self._stdin_credit = asyncio.Event()
        self._stdin_lock = asyncio.Lock()

    @property
    def done(self) -> bool:
        return self._exited.done()

    @property
    def stdin_unacked(self) -> int:
        """Bytes of stdin sent and not yet acknowledged by the agent (<= STDIN_WINDOW)."""
        return self._stdin_unacked

    async def events(self) -> AsyncIterator[Event]:
        """Yield output as it arrives, then ("exited", Exited). Raises if the channel dies."""
        while not self._events_done:
            item = await self._queue.get()
            if isinstance(item, RollboxError):
                self._events_done = True
                raise item
            if item[0] == "exited":
                self._events_done = True
            yield item

    async def wait(self) -> P.Exited:
        """The exit record (does not consume events; unread output stays queued)."""
        return await asyncio.shield(self._exited)

    async def write_stdin(self, data: bytes) -> None:
        """Feed the command's stdin; waits while it is not reading (per-session window).

        Data written after the command exited is discarded."""
        view = memoryview(data)
        async with self._stdin_lock:  # keep concurrent writers' chunks in order
            for off in range(0, len(view), P.CHUNK):
                chunk = bytes(view[off : off + P.CHUNK])
                while self._stdin_unacked + len(chunk) > P.STDIN_WINDOW and not self.done:
                    self._stdin_credit.clear()
                    await self._stdin_credit.wait()
                if self.done:
                    self._raise_failure()
                    return
                self._stdin_unacked += len(chunk)
                await self._send(P.pack(P.STDIN, self.id, chunk))

    async def close_stdin(self) -> None:
        await self._send(P.pack(P.STDIN_CLOSE, self.id))

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal size of a pty session (RESIZE; BadRequest outside 1..1000)."""
        try:
            size = P.pty_size(cols, rows)
        except ValueError as exc:
            raise BadRequest(str(exc), cols=cols, rows=rows) from None
        await self._send(P.pack(P.RESIZE, self.id, size))

    async def signal(self, sig: int) -> None:
        """Send ``sig`` to the session's process group."""
        await self._send(P.pack(P.SIGNAL, self.id, P.I32.pack(int(sig))))

    async def kill(self) -> None:
        """Kill everything of the session (its cgroup when it has one, and its process group)."""
        await self._send(P.pack(P.KILL, self.id))

    def abandon(self, exc: RollboxError) -> None:
        """The host gives up on this session (a guest that did not end it in time: its root may
        have stopped the agent): whoever waits on it (events, wait, stdin, signals) gets
        ``exc`` now, and what the agent sends for it later is not this Session's."""
        if self.done:
            return
        if self.channel._sessions.get(self.id) is self:
            del self.channel._sessions[self.id]
        self._fail(exc)

    async def _send(self, packet: bytes) -> None:
        """Send one packet of this session: waits while the socket is congested, never past
        the session's end (its exit, or a failure: the channel's, or :meth:`abandon` of a
        guest that stopped reading its port). Unsent, the packet stays queued: it is moot."""
        flushed = self.channel._queue(packet)
        if not flushed.done():
            await asyncio.wait((flushed, self._exited), return_when=asyncio.FIRST_COMPLETED)
        if flushed.done():
            flushed.result()
        else:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise why the session failed; nothing when it exited."""
        exc = self._exited.exception() if self._exited.done() else None
        if exc is not None:
            raise exc

    def collect(self) -> None:
        """Tell the agent the exit is recorded: it frees the session's rings and status."""
        self.channel.collect(self.id)

    # -- called by the channel --
    def _account(self, kind: str, n: int) -> None:
        self._received[kind] += n
        if self._received[kind] > self._allowed[kind]:
            raise AgentProtocolError(
                f"agent sent more {kind} for session {self.id} than allowed "
                f"({self._allowed[kind]} bytes)", session=self.id)

    def _yielded_end(self, i: int) -> int:
        """Stream offset just past the last byte of stream ``i`` this Session yielded."""
        name = "stdout" if i == 0 else "stderr"
        return self.start_offsets[i] + self._received[name] + self._received["replay_" + name]

    def _push(self, item: Event) -> None:
        if item[0] in ("tail_stdout", "tail_stderr"):
            # Held: only EXITED's totals tell whether it holds a byte this Session has not
            # yielded (an agent counts as dropped what an earlier connection missed and a
            # replay gave back since; the tail is then all duplicate).
            self._tails.setdefault(item[0], bytearray()).extend(item[1])
            return
        if item[0] == "exited":
            ex: P.Exited = item[1]
            for i, kind, total in ((0, "tail_stdout", ex.stdout_total),
                                   (1, "tail_stderr", ex.stderr_total)):
                tail = self._tails.pop(kind, None)
                if tail and self._yielded_end(i) < total:
                    self._queue.put_nowait((kind, bytes(tail)))
        self._queue.put_nowait(item)
        if item[0] == "exited" and not self._exited.done():
            self._exited.set_result(item[1])
            self.channel.exits += 1
            self._stdin_credit.set()
            if self.collect_on_exit and not self.channel.closed.done():
                self.collect()

    def _ack_stdin(self, n: int) -> None:
        self._stdin_unacked = max(0, self._stdin_unacked - n)
        self._stdin_credit.set()

    def _fail(self, exc: RollboxError) -> None:
        if not self._started.done():
            self._started.set_exception(exc)
            self._started.exception()  # mark retrieved: exec() may be gone already
        if not self._exited.done():
            self._exited.set_exception(exc)
            self._exited.exception()
        self._stdin_credit.set()
        self._queue.put_nowait(exc)


class AgentChannel:
    """A connection to one agent. Use :meth:`connect`; ``closed`` resolves when it ends."""

    def __init__(
        self,
        sock: socket.socket,
        on_close: Callable[[RollboxError | None], None] | None = None,
        stream_nonce: bytes | None = None,
    ) -> None:
        self._sock = sock
        # Stream transport: frames, and nothing before SYNC_MAGIC + this nonce counts.
        self._stream = stream_nonce is not None
        self._sync_pattern = P.SYNC_MAGIC + stream_nonce if stream_nonce is not None else b""
        self._synced = False
        self._hunted = 0
        self._rx = bytearray()
        self._head_off = 0  # bytes of the first queued frame already written
        self._loop = asyncio.get_running_loop()
        self._sessions: dict[int, Session] = {}
        # EXITED of sessions this channel did not start (ended while no edge was connected).
        self.unclaimed_exits: dict[int, P.Exited] = {}
        # Sessions of this channel that exited so far (a microVM fork's spares refill once
        # every child answered its first command: backends/microvm/backend.py).
        self.exits = 0
        # What the agent had when this channel connected (running and uncollected sessions).
        self.agent_sessions: dict[int, P.SessionEntry] = {}
        self._reserved: set[int] = set()
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._calls: dict[int, tuple[int, asyncio.Future[bytes]]] = {}  # token: (reply, fut)
        self._lists: collections.deque[asyncio.Future[list[P.SessionEntry]]] = collections.deque()
        self._ready: asyncio.Future[int] = self._loop.create_future()
        self._outq: collections.deque[tuple[bytes, list[int], asyncio.Future[None]]] = (
            collections.deque()
        )
        self._writing = False
        self._ids = itertools.count(random.randrange(1, 1 << 31))
        self._ping_ids = itertools.count(1)
        self.closed: asyncio.Future[RollboxError | None] = self._loop.create_future()
        self._on_close = on_close
        self._loop.add_reader(sock.fileno(), self._on_readable)

    # ---------- lifecycle ----------
    @classmethod
    def gone(cls) -> "AgentChannel":
        """A channel to no agent (a sandbox with no process: paused filesystem-only), closed
        from the start: every request on it fails as on any closed channel."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.close()
        channel = cls(ours)
        channel.close()
        return channel

    @classmethod
    async def connect(
        cls,
        sock_path: str,
        timeout: float = 5.0,
        on_close: Callable[[RollboxError | None], None] | None = None,
    ) -> "AgentChannel":
        """Connect, wait for READY and learn which session ids are taken (re-adoption)."""
        return await cls._open(socket.SOCK_SEQPACKET, sock_path, timeout, on_close)

    @classmethod
    async def connect_stream(
        cls,
        sock_path: str,
        timeout: float = 5.0,
        on_close: Callable[[RollboxError | None], None] | None = None,
    ) -> "AgentChannel":
        """Connect over a byte stream (a VM's agent port behind a unix socket): HELLO until
        SYNC, then as :meth:`connect`. The agent may not be up yet (a booting guest): HELLO
        waits in the stream until it reads it."""
        return await cls._open(socket.SOCK_STREAM, sock_path, timeout, on_close)

    @classmethod
    async def _open(cls, sock_type: int, sock_path: str, timeout: float,
                    on_close: Callable[[RollboxError | None], None] | None) -> "AgentChannel":
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, sock_type | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, str(sock_path))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise InfraError(f"cannot connect to agent at {sock_path}: {exc!r}") from exc
        except BaseException:  # cancelled: the socket is not left to the garbage collector
            sock.close()
            raise
        nonce = secrets.token_bytes(P.NONCE_LEN) if sock_type == socket.SOCK_STREAM else None
        ch = cls(sock, on_close, stream_nonce=nonce)
        deadline = loop.time() + timeout
        try:
            while True:
                if nonce is not None:
                    await ch._send_raw(P.hello(nonce))
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                try:
                    async with asyncio.timeout(min(HELLO_RESEND_S, left) if nonce else left):
                        version = await asyncio.shield(ch._ready)
                    break
                except TimeoutError:
                    if nonce is None or loop.time() >= deadline:
                        raise
            if version != P.PROTOCOL_VERSION:
                raise InfraError(f"agent speaks protocol {version}, expected {P.PROTOCOL_VERSION}")
            async with asyncio.timeout(timeout):  # as long again, as before
                entries = await ch.sessions()
        except TimeoutError as exc:
            ch.close()
            raise InfraError(f"agent at {sock_path} did not answer within {timeout}s") from exc
        except RollboxError as exc:
            ch.close()
            raise exc if isinstance(exc, InfraError) else InfraError(exc.message) from exc
        except BaseException:  # cancelled mid-handshake: no channel is left reading
            ch.close()
            raise
        ch.agent_sessions = {e.id: e for e in entries}
        ch._reserved.update(ch.agent_sessions)
        return ch

    @property
    def stream(self) -> bool:
        """True over a byte stream (a VM): no descriptors, the agent makes session cgroups."""
        return self._stream

    def close(self, reason: RollboxError | None = None) -> None:
        """Close the connection (the agent keeps running; its sessions continue). ``reason``:
        what this channel's sessions and later requests fail with (the edge's delete gives
        SandboxDead); without one, InfraError "agent channel closed"."""
        self._shutdown(reason)

    def fail_sessions(self, exc: RollboxError) -> None:
        """Every session this channel knows of ends with ``exc`` now (as
        :meth:`Session.abandon`); the channel stays open (the edge's filesystem-only pause:
        the backend still runs its guest's sync on it before it closes it)."""
        for sess in list(self._sessions.values()):
            sess.abandon(exc)

    def _shutdown(self, reason: RollboxError | None) -> None:
        if self.closed.done():
            return
        try:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        except (ValueError, OSError):
            pass
        self._sock.close()
        err = reason or InfraError("agent channel closed")
        if not self._ready.done():
            self._ready.set_exception(err)
            self._ready.exception()
        for sess in list(self._sessions.values()):
            sess._fail(err)
        self._sessions.clear()
        for fut in [*self._pings.values(), *self._lists,
                    *(f for _, f in self._calls.values())]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._pings.clear()
        self._calls.clear()
        self._lists.clear()
        while self._outq:
            _, _, fut = self._outq.popleft()
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self.closed.set_result(reason)
        if self._on_close is not None:
            self._on_close(reason)

    # ---------- requests ----------
    def busy(self) -> bool:
        """Whether a session this channel knows of has not exited yet."""
        return any(not sess.done for sess in self._sessions.values())

    def new_session_id(self) -> int:
        """A session id no session of this agent has (to journal before :meth:`exec`)."""
        while True:
            sid = next(self._ids) & 0xFFFFFFFF
            if sid and sid not in self._sessions and sid not in self._reserved and (
                sid not in self.unclaimed_exits
            ):
                self._reserved.add(sid)
                return sid

    async def exec(self, req: P.ExecRequest, cgroup_fd: int | None = None,
                   session_id: int | None = None, collect: bool = True) -> Session:
        """Start a command; returns once it runs. Raises SpawnError if it could not start.
        ``collect=False``: the agent keeps the exit and rings until ``Session.collect()``."""
        if not req.argv:
            raise BadRequest("argv must not be empty")
        if cgroup_fd is not None and self._stream:
            raise BadRequest("a stream channel carries no descriptors (the agent makes the "
                             "session's cgroup itself)")
        self._check_open()
        sid = session_id if session_id is not None else self.new_session_id()
        self._reserved.discard(sid)
        sess = Session(self, sid, collect, stream_limit=req.stream_limit,
                       replay_limit=min(req.tail_limit, REPLAY_MAX))
        self._sessions[sid] = sess
        try:
            await self._send(req.encode(sid, cgroup_fd is not None),
                             [cgroup_fd] if cgroup_fd is not None else [])
            sess.pid = await asyncio.shield(sess._started)
        except BaseException:
            if not sess._started.done():
                # Cancelled mid-start: the command may run; make sure it does not linger.
                self._loop.create_task(self._kill_quietly(sid))
            raise
        return sess

    def adopt(self, session_id: int, collect: bool = True,
              stream_limit: int = P.ExecRequest.stream_limit) -> Session:
        """Take over a session started by an earlier connection: its retained output (as far
        back as the agent's ring reaches; see ``start_offsets``), its later output and its
        exit. A session the agent does not know fails with SandboxDead. ``stream_limit``: the
        one its exec asked for (what the agent may still stream)."""
        self._check_open()
        sess = self._sessions.get(session_id)
        if sess is not None:
            return sess
        sess = Session(self, session_id, collect, stream_limit=stream_limit)
        entry = self.agent_sessions.get(session_id)
        sess._started.set_result(entry.pid if entry is not None else 0)
        sess.pid = entry.pid if entry is not None else None
        exited = self.unclaimed_exits.pop(session_id, None)
        if exited is None and entry is not None and entry.exited:
            exited = entry.exited_record()
        sess._held_exit = exited
        sess._replaying = True
        self._sessions[session_id] = sess
        self._post(P.pack(P.REPLAY, session_id, P.OFFSETS.pack(0, 0)))
        return sess

    def collect(self, session_id: int) -> None:
        """The agent may free an exited session (its exit is recorded elsewhere)."""
        self._post(P.pack(P.COLLECT, session_id))

    async def ping(self, timeout: float | None = None) -> None:
        self._check_open()
        token = next(self._ping_ids) & 0xFFFFFFFF
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pings[token] = fut
        try:
            await self._send(P.pack(P.PING, token))
            async with asyncio.timeout(timeout):  # not wait_for: see _call
                await asyncio.shield(fut)
        finally:
            self._pings.pop(token, None)

    async def list_sessions(self) -> list[tuple[int, int]]:
        """(session id, main pid) of every running session in the agent."""
        return [(e.id, e.pid) for e in await self.sessions() if not e.exited]

    async def sessions(self) -> list[P.SessionEntry]:
        """Every running or not yet collected session in the agent."""
        self._check_open()
        fut: asyncio.Future[list[P.SessionEntry]] = self._loop.create_future()
        self._lists.append(fut)
        await self._send(P.pack(P.LIST, 0))
        return await fut

    # ---------- platform commands (uniqueness of a restored clone, boot record) ----------
    async def _call(self, msg_type: int, payload: bytes, reply: int, timeout: float) -> bytes:
        self._check_open()
        token = next(self._ping_ids) & 0xFFFFFFFF
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self._calls[token] = (reply, fut)
        try:
            await self._send(P.pack(msg_type, token, payload))
            # asyncio.timeout, not wait_for: 3.11's wait_for returns the reply when the
            # caller's cancellation meets it, and the cancel is lost (a cancelled create
            # went on to finish)
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise InfraError(f"agent did not answer message {msg_type} within {timeout}s") \
                from None
        finally:
            self._calls.pop(token, None)

    async def _command(self, msg_type: int, payload: bytes, timeout: float) -> None:
        answer = await self._call(msg_type, payload, P.RESULT, timeout)
        (err,) = P.I32.unpack_from(answer)
        if err:
            message = answer[P.I32.size:].decode("utf-8", "replace")
            raise InfraError(f"agent: {message or errno_mod.errorcode.get(err, str(err))}",
                             errno=err)

    async def reseed(self, entropy: bytes, timeout: float = 5.0) -> None:
        """Mix host random bytes into the kernel's pool (credited) and reseed its CRNG."""
        if not 1 <= len(entropy) <= 4096:
            raise BadRequest("reseed takes 1 to 4096 bytes")
        await self._command(P.RESEED, entropy, timeout)

    async def set_machine_id(self, machine_id: str, timeout: float = 5.0) -> None:
        """Write the sandbox root's /etc/machine-id (32 lowercase hex digits)."""
        if len(machine_id) != 32 or any(c not in "0123456789abcdef" for c in machine_id):
            raise BadRequest("machine-id must be 32 lowercase hex digits")
        await self._command(P.SET_MACHINE_ID, machine_id.encode(), timeout)

    async def set_hostname(self, hostname: str, timeout: float = 5.0) -> None:
        raw = hostname.encode()
        if not 1 <= len(raw) <= 64 or b"\0" in raw or b"/" in raw:
            raise BadRequest("hostname must be 1 to 64 bytes, without NUL or '/'")
        await self._command(P.SET_HOSTNAME, raw, timeout)

    async def enable_sudo(self, uids: list[int], timeout: float = 5.0) -> None:
        """Let ``uids`` (and root) run commands as any user through the agent's sudo socket
        (the image's ``/usr/bin/sudo`` client); the socket exists only after this."""
        if not 1 <= len(uids) <= P.SUDO_UIDS_MAX or any(
                not 0 <= u < 2**32 - 1 for u in uids):
            raise BadRequest(f"sudo takes 1 to {P.SUDO_UIDS_MAX} uids, each 0..2**32-2")
        await self._command(P.SUDO, b"".join(P.U32.pack(u) for u in uids), timeout)

    async def set_clock(self, unix_ns: int | None = None, timeout: float = 5.0) -> None:
        """Step the sandbox's CLOCK_REALTIME (default: the host's now)."""
        ns = time.time_ns() if unix_ns is None else unix_ns
        if ns < 0:
            raise BadRequest("clock must not be before 1970")
        await self._command(P.SET_CLOCK, P.CLOCK.pack(ns // 10**9, ns % 10**9), timeout)

    async def boot_info(self, timeout: float = 5.0) -> P.BootInfo:
        """How the agent's boot went (a guest: timestamps of its steps, the first failure)."""
        return P.BootInfo.decode(await self._call(P.BOOT_INFO_REQ, b"", P.BOOT_INFO_REPLY,
                                                  timeout))

    async def _kill_quietly(self, sid: int) -> None:
        try:
            await self._send(P.pack(P.KILL, sid))
        except RollboxError:
            pass

    def _check_open(self) -> None:
        if self.closed.done():
            raise self.closed.result() or InfraError("agent channel closed")

    # ---------- socket I/O ----------
    def _post(self, packet: bytes) -> None:
        """Queue a packet without waiting (from sync code); a failure closes the channel."""
        if self.closed.done():
            return
        fut = self._queue_raw(P.frame(packet) if self._stream else packet, None)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _send(self, packet: bytes, fds: list[int] | None = None) -> None:
        """Send one packet; waits while the socket is congested (backpressure from the agent)."""
        await self._queue(packet, fds)

    def _queue(self, packet: bytes, fds: list[int] | None = None) -> asyncio.Future[None]:
        """Queue one packet; the future resolves once the socket took it (fails if the
        channel ends first; retrieved, so nobody has to await it)."""
        self._check_open()
        if len(packet) > P.MAX_PACKET:
            raise BadRequest(f"request too large ({len(packet)} > {P.MAX_PACKET} bytes)")
        if fds and self._stream:
            raise BadRequest("a stream channel carries no descriptors")
        fut = self._queue_raw(P.frame(packet) if self._stream else packet, fds)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    async def _send_raw(self, data: bytes, fds: list[int] | None = None) -> None:
        """Queue bytes as the transport carries them (a packet, or a stream's frame)."""
        self._check_open()
        await self._queue_raw(data, fds)

    def _queue_raw(self, data: bytes, fds: list[int] | None) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        self._outq.append((data, fds or [], fut))
        if not self._writing:
            self._flush()
        return fut

    def _flush(self) -> None:
        while self._outq:
            packet, fds, fut = self._outq[0]
            try:
                if self._stream:
                    # A stream may take part of a frame: the rest goes first next time.
                    self._head_off += self._sock.send(memoryview(packet)[self._head_off:])
                    if self._head_off < len(packet):
                        continue
                    self._head_off = 0
                elif fds:
                    socket.send_fds(self._sock, [packet], fds)
                else:
                    self._sock.send(packet)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self._sock.fileno(), self._flush)
                return
            except OSError as exc:
                self._shutdown(SandboxDead(f"agent connection lost: {exc}"))
                return
            self._outq.popleft()
            if not fut.done():
                fut.set_result(None)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._sock.fileno())

    def _on_readable(self) -> None:
        # Bounded per wakeup (reads and READ_BUDGET) so other tasks get to run: the consumers
        # too, whose flow control (PlatformTools' SIGSTOP) must see output before much more of
        # it is read. A packet socket gives one message per recv; a stream gives bytes, cut
        # into frames by _parse_stream.
        budget = READ_BUDGET
        for _ in range(64 if self._stream else 256):
            if self.closed.done() or budget <= 0:
                return
            try:
                data = self._sock.recv(RECV_CHUNK if self._stream else P.MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._shutdown(SandboxDead(f"agent connection lost: {exc}"))
                return
            if not data:
                self._shutdown(SandboxDead("agent closed the connection (sandbox dead?)"))
                return
            budget -= len(data)
            try:
                if self._stream:
                    self._rx += data
                    self._parse_stream()
                else:
                    self._dispatch(data)
            except AgentProtocolError as exc:
                self._shutdown(exc)
                return
            except (ValueError, KeyError, struct.error) as exc:
                self._shutdown(AgentProtocolError(f"malformed message from agent: {exc!r}"))
                return

    def _parse_stream(self) -> None:
        """Take the complete frames of ``_rx`` (after the SYNC of this connection)."""
        buf, off = self._rx, 0
        if not self._synced:
            at = buf.find(self._sync_pattern)
            if at < 0:
                skip = max(0, len(buf) - (len(self._sync_pattern) - 1))
                self._hunted += skip
                del buf[:skip]
            else:
                self._hunted += at
                off = at + len(self._sync_pattern)  # the end of the SYNC frame
                self._synced = True
            if self._hunted > HUNT_MAX:
                raise AgentProtocolError(f"no SYNC from the agent in {self._hunted} bytes")
            if not self._synced:
                return
        while len(buf) - off >= P.FRAME_LEN.size:
            (n,) = P.FRAME_LEN.unpack_from(buf, off)
            if not P.HEADER.size <= n <= P.MAX_PACKET:
                raise AgentProtocolError(f"frame of {n} bytes from agent")
            end = off + P.FRAME_LEN.size + n
            if end > len(buf):
                break
            packet = bytes(buf[off + P.FRAME_LEN.size:end])
            off = end
            self._dispatch(packet)
            if self.closed.done():
                return
        del buf[:off]

    def _dispatch(self, data: bytes) -> None:
        msg_type, flags, sid, payload = P.unpack(data)
        if msg_type in _STREAM_KINDS:
            sess = self._sessions.get(sid)
            if sess is not None and not sess._replaying:  # else: covered by the replay
                kind = _STREAM_KINDS[msg_type]
                sess._account(kind, len(payload))
                sess._push((kind, payload))
        elif msg_type == P.EXITED:
            exited = P.Exited.decode(payload)
            sess = self._sessions.get(sid)
            if sess is None:
                self.unclaimed_exits[sid] = exited
                if len(self.unclaimed_exits) > UNCLAIMED_EXITS_MAX:
                    raise AgentProtocolError("agent reported more unknown exits than it holds")
            elif sess._replaying:
                sess._held_exit = exited
            else:
                del self._sessions[sid]
                sess._push(("exited", exited))
            self._reserved.discard(sid)
        elif msg_type in (P.REPLAY_OUT, P.REPLAY_ERR):
            sess = self._sessions.get(sid)
            if sess is not None and sess._replaying:
                i = 0 if msg_type == P.REPLAY_OUT else 1
                if not sess._replay_seen[i]:
                    sess._replay_seen[i] = True
                    sess.start_offsets[i] = P.U64.unpack_from(payload)[0]
                kind = "replay_stdout" if i == 0 else "replay_stderr"
                body = payload[P.U64.size:]
                sess._account(kind, len(body))
                sess._push((kind, body))
        elif msg_type == P.REPLAY_END:
            sess = self._sessions.get(sid)
            if sess is not None and sess._replaying:
                sess._replaying = False
                totals = P.OFFSETS.unpack_from(payload)
                for i in (0, 1):
                    if not sess._replay_seen[i]:
                        sess.start_offsets[i] = totals[i]
                if sess._held_exit is not None:
                    del self._sessions[sid]
                    sess._push(("exited", sess._held_exit))
                elif flags & 1:  # no such session
                    del self._sessions[sid]
                    sess._fail(SandboxDead(f"agent has no session {sid}"))
        elif msg_type == P.STDIN_ACK:
            sess = self._sessions.get(sid)
            if sess is not None:
                sess._ack_stdin(P.U32.unpack_from(payload)[0])
        elif msg_type == P.STARTED:
            sess = self._sessions.get(sid)
            if sess is not None and not sess._started.done():
                sess._started.set_result(P.I32.unpack_from(payload)[0])
        elif msg_type == P.SPAWN_FAILED:
            err = P.I32.unpack_from(payload)[0]
            message = payload[P.I32.size :].decode("utf-8", "replace")
            sess = self._sessions.pop(sid, None)
            if sess is not None:
                sess._fail(SpawnError(err, message or errno_mod.errorcode.get(err, str(err))))
        elif msg_type == P.PONG:
            fut = self._pings.get(sid)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif msg_type == P.SESSIONS:
            (count,) = P.U32.unpack_from(payload)
            entries = [P.SessionEntry.decode(payload, P.U32.size + i * P.SESSION_ENTRY.size)
                       for i in range(count)]
            if self._lists:
                fut = self._lists.popleft()
                if not fut.done():
                    fut.set_result(entries)
        elif msg_type == P.READY:
            if not self._ready.done():
                self._ready.set_result(P.U32.unpack_from(payload)[0])
        elif msg_type in (P.RESULT, P.BOOT_INFO_REPLY):
            call = self._calls.get(sid)
            if call is not None and call[0] == msg_type and not call[1].done():
                call[1].set_result(payload)
        elif msg_type == P.SYNC and self._stream:
            pass  # a repeat (the agent answered a resent HELLO before ours was seen)
        else:
            raise ValueError(f"unknown message type {msg_type}")
