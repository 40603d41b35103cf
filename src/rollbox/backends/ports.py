"""The two ways a backend opens a sandbox's port (``Backend.open_port``, ``PortStream``):

- :func:`connect_in_netns` (containers): a TCP socket made inside the sandbox's named network
  namespace by a short-lived host thread (``isolation.netns.socket_inside``) and connected to
  127.0.0.1:port there (then ``[::1]``). The socket is the host process's, in its cgroup: the
  sandbox's cgroup-BPF filters never see it, so it works with no network permission at all,
  and it can reach nothing but that namespace's loopback (the address is fixed here, never
  the caller's). The sandbox can not use it: it lives in the edge's process only.
- :class:`SessionPort` (microVMs): a relay through the agent: the platform's busybox ``nc``
  to the guest's 127.0.0.1:port, run as a platform tool (EXEC_PLATFORM_TOOL, never a binary
  of the sandbox), the bytes over its exec session's stdin and stdout on virtio-serial. No
  guest network is needed.

Owns these connections only; must not choose a port or a sandbox (the edge checked both), nor
touch the sandbox's network policy.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

from rollbox import errors
from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel, Session
from rollbox.isolation import netns

READ_CHUNK = 256 << 10
CONNECT_TIMEOUT_S = 5.0
RELAY_STREAM_LIMIT = 1 << 62  # a relay's output is not capped by the agent's stream limit
RELAY_ERR_KEEP = 4096


def _not_listening(port: int, why: str) -> errors.PortNotListening:
    return errors.PortNotListening(
        f"nothing listens on port {port} in the sandbox ({why}); a service must listen on "
        "its 127.0.0.1 or 0.0.0.0", port=port)


class SocketPort:
    """A connected non-blocking socket as a PortStream. A close while a read waits (the port
    proxy's idle connection when the edge closes a deleted sandbox's ports, maybe from another
    thread) shuts the socket down, which ends that read with b"", and the read closes the
    socket as it leaves: the fd is never closed under a read its loop still waits on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        with contextlib.suppress(OSError):  # a request's head and body go out at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._reading = 0

    async def read(self) -> bytes:
        if self._closed:
            return b""
        self._reading += 1
        try:
            data = await self._loop.sock_recv(self.sock, READ_CHUNK)
            if data:
                # The ACK now, not delayed: a service that writes an answer's head and body
                # apart without TCP_NODELAY (stdlib http.server) sends the body only once the
                # head is ACKed (Nagle), 40 ms later on a kept-alive connection otherwise.
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            return data
        except (ConnectionResetError, BrokenPipeError):
            return b""
        finally:
            self._reading -= 1
            if self._closed and not self._reading:
                self.sock.close()

    async def write(self, data: bytes) -> None:
        try:
            await self._loop.sock_sendall(self.sock, data)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise errors.ConnectionLost(f"the sandbox's service closed the connection: {exc}"
                                        ) from None

    async def write_eof(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._reading:  # the read ends with b"" and closes the socket
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            else:
                self.sock.close()


async def connect_in_netns(netns_name: str, port: int) -> SocketPort:
    """A connection to ``port`` on the named namespace's loopback (127.0.0.1, then ::1)."""
    loop = asyncio.get_running_loop()
    why = "no answer"
    for family, addr in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port))):
        try:
            sock = netns.socket_inside(netns_name, family)
        except OSError as exc:
            if family == socket.AF_INET6:  # no IPv6 in this namespace
                break
            raise errors.InfraError(f"no socket in the sandbox's network namespace: {exc}"
                                    ) from None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, addr)
            return SocketPort(sock)
        except TimeoutError:  # an OSError too: first
            sock.close()
            if family == socket.AF_INET:  # what 127.0.0.1 said is the reason given
                why = "connect timed out"
        except OSError as exc:
            sock.close()
            if family == socket.AF_INET:
                why = ("connection refused" if isinstance(exc, ConnectionRefusedError)
                       else str(exc))
        except BaseException:
            sock.close()
            raise
    raise _not_listening(port, why)


class SessionPort:
    """An agent exec session of ``nc 127.0.0.1 PORT`` as a PortStream."""

    def __init__(self, session: Session, port: int) -> None:
        self.session = session
        self.port = port
        self._events = session.events().__aiter__()
        self._stderr = bytearray()
        self._got = False
        self._ended = False

    async def read(self) -> bytes:
        while not self._ended:
            try:
                kind, payload = await self._events.__anext__()
            except StopAsyncIteration:
                self._ended = True
                break
            if kind in ("stdout", "replay_stdout", "tail_stdout") and payload:
                self._got = True
                return bytes(payload)
            if kind in ("stderr", "replay_stderr", "tail_stderr"):
                self._stderr += bytes(payload)[:RELAY_ERR_KEEP - len(self._stderr)]
            elif kind == "exited":
                self._ended = True
                if not self._got and payload.exit_code != 0:
                    text = self._stderr.decode(errors="replace").strip()
                    raise _not_listening(self.port, text[-200:] or "the relay failed")
        return b""

    async def write(self, data: bytes) -> None:
        if self.session.done:  # the relay ended: why (PortNotListening if it never connected)
            while await self.read():
                pass
            raise errors.ConnectionLost("the sandbox's service closed the connection")
        await self.session.write_stdin(data)

    async def write_eof(self) -> None:
        if not self.session.done:
            with contextlib.suppress(errors.RollboxError):
                await self.session.close_stdin()

    async def close(self) -> None:
        if not self.session.done:
            with contextlib.suppress(errors.RollboxError, OSError):
                await self.session.kill()


async def relay_through_agent(channel: AgentChannel, port: int) -> SessionPort:
    """A relay to ``port`` on the guest's loopback through its agent (see the module doc)."""
    req = P.ExecRequest(argv=["nc", "127.0.0.1", str(port)], env=[], stdin=True,
                        stream_limit=RELAY_STREAM_LIMIT, tail_limit=0, platform_tool=True)
    session = await channel.exec(req)
    return SessionPort(session, port)


async def end_pumps(*tasks: asyncio.Future[None]) -> None:
    """Cancel the two directions' tasks of a relayed connection and wait for both."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task
