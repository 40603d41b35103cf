"""Wire format between the edge and the in-sandbox agent (``native/agent/agent.c``).

Two transports carry the same messages (``channel.py`` speaks both):

- **seqpacket** (containers, described first below): one message per packet, descriptors with
  SCM_RIGHTS.
- **stream** (microVMs: the virtio-serial port ``org.rollbox.agent``, host side a unix stream
  socket; or a SOCK_STREAM listener as fd 3): each message is a ``<I`` length (``HEADER.size``
  to ``MAX_PACKET``) then the packet; no descriptors (EXEC_CGROUP is refused: in a guest the
  agent makes every session's cgroup itself). A byte stream has no boundaries a reconnect can
  resync on, so every host connection starts with HELLO(16), payload ``HELLO_MAGIC`` + an
  8-byte nonce; the agent scans for the magic until it has seen one (and again after any bad
  frame), drops what it had queued for an earlier connection, and answers SYNC(47) with
  ``SYNC_MAGIC`` + the same nonce, then READY and the queued EXITED. The host skips every byte
  before ``SYNC_MAGIC + nonce`` (what an earlier connection left half-sent; bounded), and
  resends HELLO (same nonce: the agent ignores a repeat) until it sees it. In a guest the agent
  learns that the host went away from POLLHUP on the port (then it stops streaming output and
  queues EXITED until the next HELLO).

The agent is the sandbox's PID 1 (a static binary bind-mounted read-only from the host; never a
file of the sandbox's writable tree). It talks over a unix SOCK_SEQPACKET socket whose
*listening* end the edge creates on the host (``<run_dir>/sandboxes/<id>/agent.sock``, root-only)
and hands to the agent as fd 3 (``runc --preserve-fds 3``: fd 4 is the agent's own binary, fd 5
the platform shell). The path does not exist in the
sandbox's mount namespace, the fd is close-on-exec, and the agent is non-dumpable, so nothing
inside the sandbox can reach or forge the channel. A restarted edge reconnects to the same path
(re-adoption); a new connection replaces the old one.

Every packet is one message: an 8-byte header ``<BBHI`` (type, flags, reserved, session id)
followed by the payload. Packets are at most ``MAX_PACKET`` bytes.

Edge -> agent
  EXEC(1)        payload ``<IIIIQIII`` uid, gid, timeout_ms (0 = none), flags, stream_limit,
                 tail_limit, argc, envc; then NUL-terminated strings: cwd, argv[argc], env[envc]
                 ("K=V"). flags: EXEC_STDIN (stdin is a pipe fed by STDIN, else /dev/null),
                 EXEC_CGROUP (one fd attached with SCM_RIGHTS: the session's cgroup-v2
                 directory; the child joins it before exec and timeouts kill through its
                 ``cgroup.kill``), EXEC_PLATFORM_SHELL (argv runs under the platform shell:
                 the agent execs the shell binary it got from the edge as fd 5 at start, by
                 descriptor, with argv as given; argv[0] is only its name, e.g. ``bash``; no
                 path of the sandbox is looked up, so a ``/bin/sh`` or ``bash`` the sandbox
                 replaced never runs), EXEC_PLATFORM_TOOL (the same by descriptor for the
                 platform's busybox-static: argv[0] is the applet; in a guest that is the
                 initramfs's ``/platform/busybox``, run chrooted in the tools' view of the
                 overlay (none of the sandbox's mounts or masks), or with EXEC_TOOL_IN_SANDBOX
                 in the sandbox root itself (to mask hidden paths there); in a container fd 6
                 when the edge passes one; argv[0] ``rollbox-xattrs``, ``rollbox-xattr`` or ``rollbox-watch`` runs
                 the tool built into the agent, exec'd from its own binary: fd 4 kept
                 close-on-exec in a container, the initramfs's /init in a guest; an agent
                 older than the tool answers the applet's exit 127), EXEC_PTY (a terminal: the head is followed by
                 ``<HH`` cols, rows, each 1..``PTY_MAX_SIZE``, then the strings; the agent opens
                 a pty on the sandbox's own devpts (its ptmx not followed through links,
                 checked to be a devpts character device; the slave from the master by
                 TIOCGPTPEER, never by path), the command's stdin, stdout and stderr are the
                 slave and its controlling terminal (setsid + TIOCSCTTY), and the master is
                 the session's one output stream (STDOUT; no STDERR) and its stdin (STDIN
                 bytes go to the master raw; excludes EXEC_STDIN and EXEC_PLATFORM_TOOL)),
                 EXEC_PTY_STDERR (with EXEC_PTY: stderr is its own pipe, the session's
                 STDERR, not the terminal). Unknown flags are refused (an older agent answers
                 SPAWN_FAILED EINVAL to EXEC_PTY and EXEC_PTY_STDERR). The agent answers
                 STARTED or SPAWN_FAILED.
  STDIN(2)       bytes for the session's stdin (at most ``CHUNK`` per packet), credit-based: the
                 edge keeps at most ``STDIN_WINDOW`` bytes per session not yet acknowledged by
                 STDIN_ACK, so a command that never reads its stdin can't stall the connection
                 (an edge that overruns the window is disconnected).
  STDIN_CLOSE(3) close its stdin (after the queued bytes are written).
  SIGNAL(4)      ``<i`` signo sent to the session's process group.
  KILL(5)        kill everything of the session (cgroup.kill, then SIGKILL to the group).
  PING(6)        answered by PONG(7) with the same session id.
  LIST(8)        answered by one SESSIONS(40).
  REPLAY(9)      ``<QQ`` stdout and stderr offsets: the session's retained output from there,
                 answered by REPLAY_OUT/REPLAY_ERR packets then REPLAY_END. Live output the
                 agent sent before the REPLAY_END is covered by the replay.
  COLLECT(10)    the edge has the session's exit for good (journaled): the agent frees it.
  Platform commands (a restored template's clone is made unique with them before its first
  command), each answered by RESULT(45) with the request's session id as a token; served by
  a guest's agent only (elsewhere, like BOOT_INFO off the stream transports, an unknown type):
  RESEED(11)     1..4096 host random bytes, added to the kernel's pool credited
                 (RNDADDENTROPY), then the CRNG reseeded at once (RNDRESEEDCRNG).
  SET_MACHINE_ID(12) 32 lowercase hex digits -> the sandbox root's /etc/machine-id.
  SET_HOSTNAME(13) 1..64 bytes -> sethostname (the guest's or the container's UTS name).
  SET_CLOCK(14)  ``<qI`` seconds, nanoseconds of CLOCK_REALTIME -> clock_settime.
  BOOT_INFO(15)  answered by BOOT_INFO_REPLY(46).
  HELLO(16)      stream transports only (see above).
  RESIZE(17)     ``<HH`` cols, rows of a pty session's terminal (TIOCSWINSZ: the kernel sends
                 SIGWINCH to its foreground process group); a size outside 1..``PTY_MAX_SIZE``
                 or a session without a pty is ignored (logged), no answer.
  SUDO(18)       1..16 ``<I`` uids allowed to raise privileges through the agent (an image
                 labelled ``rollbox.sudo``; both transports), answered by RESULT. The first
                 one makes the agent listen on the sandbox's ``/dev/rollbox-sudo.sock``
                 (its own request format: ``native/agent/agent.c``, "agent-mediated sudo";
                 docs/security.md); without it that socket never exists.

Agent -> edge
  READY(32)      ``<I`` protocol version, sent on every new connection.
  STARTED(33)    ``<i`` pid of the session's main process (sandbox pid namespace).
  SPAWN_FAILED(34) ``<i`` errno then a UTF-8 message; the session is over.
  STDOUT(35) / STDERR(36)  output bytes, streamed until ``stream_limit`` bytes per stream
                 (and only while an edge is connected); the rest is counted as dropped.
                 Independently, every session keeps the last ``tail_limit`` bytes of each
                 stream (its retention ring; never blocks the command) until COLLECT; all
                 rings together are capped at 64 MiB (a ring past it keeps fewer bytes).
  TAIL_STDOUT(38) / TAIL_STDERR(39)  the last bytes of the ring (at most 64 KiB), sent just
                 before EXITED when bytes were dropped (they end at the stream's total, so
                 they may overlap what the edge has: the channel compares offsets).
  EXITED(37)     ``<iiBBxxQQQQ`` exit_code (-1 if killed by a signal), signal, timed_out,
                 oom_kills (the OOM killer's kills in the session's cgroup, capped at 255; a
                 guest's agent reads its own session cgroup's memory.events, a container's
                 agent sends 0: the edge reads the cgroup it made), stdout_total,
                 stderr_total, stdout_dropped, stderr_dropped (bytes this connection did
                 not get: not streamed, and after a REPLAY not in it either). Sent when the
                 main process has exited and its pipes are drained (at most ~50 ms after exit;
                 processes it left behind keep running but lose their stdout/stderr).
                 EXITED of sessions that end while no edge is connected are queued (bounded)
                 and delivered after the next READY. The session itself (exit status and
                 rings) stays until COLLECT; uncollected exited sessions are bounded (at most
                 256 and 16 MiB of rings; the oldest are dropped first).
  SESSIONS(40)   ``<I`` count then count x ``<IiBBBxiiQQQQ`` (session id, main pid, state 1
                 running / 2 exited, timed_out, oom_kills, exit_code, signal, stdout_total,
                 stderr_total, stdout_retained, stderr_retained) of every running or
                 uncollected session.
  STDIN_ACK(41)  ``<I`` stdin bytes of the session consumed (written to the pipe, or discarded
                 because the command closed its stdin or the session is unknown).
  REPLAY_OUT(42) / REPLAY_ERR(43)  ``<Q`` stream offset of the first byte, then bytes.
  REPLAY_END(44) ``<QQ`` stdout and stderr totals when the replay was taken; flags 1: no such
                 session.
  RESULT(45)     ``<i`` errno (0: done), then a UTF-8 message naming what failed.
  BOOT_INFO_REPLY(46) ``<iQQQQQQ`` errno of the first failed boot step (0: none; the agent of
                 a guest that could not mount its layers still serves, to say why), then
                 CLOCK_BOOTTIME ns at: init start, modules loaded, disks found, mounts done,
                 serving, now; then the failed step as UTF-8. A container's agent reports 0s
                 for the steps it has not got.
  SYNC(47)       stream transports only (see above); a later one is ignored.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

PROTOCOL_VERSION = 3
MAX_PACKET = 128 * 1024
CHUNK = 64 * 1024

HEADER = struct.Struct("<BBHI")
EXEC_HEAD = struct.Struct("<IIIIQIII")
EXITED_BODY = struct.Struct("<iiBBxxQQQQ")
I32 = struct.Struct("<i")
U32 = struct.Struct("<I")
SESSION_ENTRY = struct.Struct("<IiBBBxiiQQQQ")
U64 = struct.Struct("<Q")
OFFSETS = struct.Struct("<QQ")
FRAME_LEN = struct.Struct("<I")  # stream transports: the length before each packet
CLOCK = struct.Struct("<qI")
BOOT_INFO = struct.Struct("<iQQQQQQ")
PTY_SIZE = struct.Struct("<HH")  # cols, rows (EXEC_PTY, RESIZE)
PTY_MAX_SIZE = 1000
HELLO_MAGIC = b"rollbox-hello-v1"
SYNC_MAGIC = b"rollbox-sync--v1"
NONCE_LEN = 8

# edge -> agent
EXEC, STDIN, STDIN_CLOSE, SIGNAL, KILL, PING, PONG, LIST, REPLAY, COLLECT = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
RESEED, SET_MACHINE_ID, SET_HOSTNAME, SET_CLOCK, BOOT_INFO_REQ, HELLO = 11, 12, 13, 14, 15, 16
RESIZE = 17
SUDO = 18
SUDO_UIDS_MAX = 16
# agent -> edge
READY, STARTED, SPAWN_FAILED, STDOUT, STDERR, EXITED, TAIL_STDOUT, TAIL_STDERR, SESSIONS = (
    32, 33, 34, 35, 36, 37, 38, 39, 40,
)
STDIN_ACK = 41
REPLAY_OUT, REPLAY_ERR, REPLAY_END = 42, 43, 44
RESULT, BOOT_INFO_REPLY, SYNC = 45, 46, 47
RETAIN_LIMIT = 1 << 20  # the edge's tail_limit: bytes per stream a restarted edge can replay
STDIN_WINDOW = 256 * 1024

EXEC_STDIN = 1
EXEC_CGROUP = 2
EXEC_PLATFORM_SHELL = 4
EXEC_PLATFORM_TOOL = 8  # argv[0] names an applet of the platform's busybox, run by descriptor
EXEC_TOOL_IN_SANDBOX = 16  # with EXEC_PLATFORM_TOOL (guest): in the sandbox root, not the view
EXEC_PTY = 32  # a terminal of (cols, rows): stdin/stdout/stderr are a pty's slave
EXEC_PTY_STDERR = 64  # with EXEC_PTY: stderr stays a pipe (STDERR), not the terminal

# argv[0] of the platform shell (bash-static): bash semantics. ``sh`` would make it bash's
# POSIX mode, for callers that promise /bin/sh semantics.
PLATFORM_SHELL_NAME = "bash"


def shell_argv(cmd: str, name: str = PLATFORM_SHELL_NAME) -> list[str]:
    """argv of a command string run by the platform shell (with ``platform_shell=True``)."""
    return [name, "-c", cmd]


def pty_size(cols: int, rows: int) -> bytes:
    """``<HH`` of a terminal size; ValueError outside 1..PTY_MAX_SIZE."""
    if not (1 <= cols <= PTY_MAX_SIZE and 1 <= rows <= PTY_MAX_SIZE):
        raise ValueError(f"terminal size {cols}x{rows}: cols and rows must be 1..{PTY_MAX_SIZE}")
    return PTY_SIZE.pack(cols, rows)


def pack(msg_type: int, session: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(msg_type, flags, 0, session) + payload


def unpack(packet: bytes) -> tuple[int, int, int, bytes]:
    """Return (type, flags, session, payload); raises ValueError on a short packet."""
    if len(packet) < HEADER.size:
        raise ValueError("short packet")
    msg_type, flags, _, session = HEADER.unpack_from(packet)
    return msg_type, flags, session, packet[HEADER.size :]


@dataclass
class ExecRequest:
    argv: list[str]
    env: list[str]
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    timeout_ms: int = 0
    stdin: bool = False
    stream_limit: int = 8 << 20
    tail_limit: int = 64 << 10
    platform_shell: bool = False  # argv runs under the platform shell (EXEC_PLATFORM_SHELL)
    platform_tool: bool = False  # argv[0] is a platform busybox applet, or one built into the
    # agent: rollbox-xattrs, rollbox-xattr, rollbox-watch (EXEC_PLATFORM_TOOL; agent.c
    # documents their output)
    tool_in_sandbox: bool = False  # ...run in the sandbox root (EXEC_TOOL_IN_SANDBOX)
    pty: tuple[int, int] | None = None  # (cols, rows): a terminal (EXEC_PTY)
    pty_stderr: bool = False  # with pty: stderr its own pipe (EXEC_PTY_STDERR)

    def encode(self, session: int, with_cgroup: bool) -> bytes:
        flags = ((EXEC_STDIN if self.stdin else 0) | (EXEC_CGROUP if with_cgroup else 0)
                 | (EXEC_PLATFORM_SHELL if self.platform_shell else 0)
                 | (EXEC_PLATFORM_TOOL if self.platform_tool else 0)
                 | (EXEC_TOOL_IN_SANDBOX if self.tool_in_sandbox else 0)
                 | (EXEC_PTY if self.pty is not None else 0)
                 | (EXEC_PTY_STDERR if self.pty is not None and self.pty_stderr else 0))
        head = EXEC_HEAD.pack(
            self.uid, self.gid, self.timeout_ms, flags, self.stream_limit, self.tail_limit,
            len(self.argv), len(self.env),
        )
        if self.pty is not None:
            head += pty_size(*self.pty)
        strings = b"".join(s.encode() + b"\0" for s in [self.cwd, *self.argv, *self.env])
        return pack(EXEC, session, head + strings)


@dataclass
class Exited:
    exit_code: int
    signal: int
    timed_out: bool
    stdout_total: int
    stderr_total: int
    stdout_dropped: int
    stderr_dropped: int
    oom_kills: int = 0

    @classmethod
    def decode(cls, payload: bytes) -> "Exited":
        code, sig, to, oom, ot, et, od, ed = EXITED_BODY.unpack_from(payload)
        return cls(code, sig, bool(to), ot, et, od, ed, oom)


@dataclass
class SessionEntry:
    """One row of SESSIONS: what a (re)connected edge learns about a session."""

    id: int
    pid: int
    exited: bool
    timed_out: bool
    exit_code: int
    signal: int
    stdout_total: int
    stderr_total: int
    stdout_retained: int
    stderr_retained: int
    oom_kills: int = 0

    @classmethod
    def decode(cls, payload: bytes, offset: int) -> "SessionEntry":
        sid, pid, state, to, oom, code, sig, ot, et, orr, er = SESSION_ENTRY.unpack_from(
            payload, offset)
        return cls(sid, pid, state == 2, bool(to), code, sig, ot, et, orr, er, oom)

    def exited_record(self) -> Exited:
        """The exit as EXITED would have told it (what was dropped is unknown: 0)."""
        return Exited(self.exit_code, self.signal, self.timed_out, self.stdout_total,
                      self.stderr_total, 0, 0, self.oom_kills)


@dataclass
class BootInfo:
    """BOOT_INFO_REPLY: how the guest's boot went, in CLOCK_BOOTTIME ns (0: not reached)."""

    errno: int
    init_ns: int
    modules_ns: int
    disks_ns: int
    mounts_ns: int
    ready_ns: int
    now_ns: int
    error: str

    @classmethod
    def decode(cls, payload: bytes) -> "BootInfo":
        err, *times = BOOT_INFO.unpack_from(payload)
        message = payload[BOOT_INFO.size:].decode("utf-8", "replace")
        return cls(err, *times, message)


def frame(packet: bytes) -> bytes:
    """A packet as the stream transports carry it."""
    return FRAME_LEN.pack(len(packet)) + packet


def hello(nonce: bytes) -> bytes:
    return frame(pack(HELLO, 0, HELLO_MAGIC + nonce))
