"""How the SDK rides out a server restart (used by ``_async``; owns no I/O of its own).

- :class:`Reconnect`: retries with jittered exponential backoff inside a bounded window.
- :class:`Offsets`: the bytes of each output stream a client has, so a resumed stream
  (re-attached from those offsets) yields every byte at most once and counts what the server
  could no longer replay (``truncated``).
- Exec starts carry an idempotency key (one per call, made here unless the caller gave one): a
  retry after a broken connection returns the recorded command instead of running it twice.
  When the outcome can not be re-checked, the call fails with ``ExecIndeterminate`` (it may
  have run) rather than a plain connection error (``ServerUnreachable``: it certainly did not).
"""
from __future__ import annotations

import asyncio
import base64
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rollbox import errors

T = TypeVar("T")
DEFAULT_RECONNECT_S = 60.0
_FIRST_DELAY_S = 0.05
_MAX_DELAY_S = 2.0


def new_idempotency_key() -> str:
    return f"sdk-{secrets.token_hex(12)}"


class Reconnect:
    """``await wait(exc)`` sleeps before the next attempt, or raises ``exc`` once the window
    (seconds from the first failure) is over."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.deadline: float | None = None
        self.delay = _FIRST_DELAY_S
        self.may_have_run = False  # an exec start was sent on a connection that then broke

    async def wait(self, exc: errors.InfraError) -> None:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.window_s
        if isinstance(exc, errors.ConnectionLost):
            self.may_have_run = True
        if now + self.delay > self.deadline:
            raise exc
        await asyncio.sleep(self.delay * random.uniform(0.5, 1.0))
        self.delay = min(self.delay * 2, _MAX_DELAY_S)


    async def wait_exec(self, exc: errors.InfraError, key: str, exec_id: str | None) -> None:
        """:meth:`wait` for an exec start (or its stream): once the window is over it raises
        what :func:`indeterminate` says instead of ``exc``."""
        try:
            await self.wait(exc)
        except errors.InfraError:
            raise indeterminate(exc, key, exec_id, self.may_have_run) from exc

    async def call(self, attempt: Callable[[], Awaitable[T]], key: str | None = None) -> T:
        """``attempt()`` until the server answers, waiting between tries; ``key``: the call is
        an exec start with that idempotency key (see :meth:`wait_exec`)."""
        while True:
            try:
                return await attempt()
            except (errors.ServerUnreachable, errors.ConnectionLost) as exc:
                if key is None:
                    await self.wait(exc)
                else:
                    await self.wait_exec(exc, key, None)


def indeterminate(exc: errors.InfraError, key: str, exec_id: str | None,
                  may_have_run: bool) -> errors.RollboxError:
    """The error for an exec start whose re-checks ran out: ``ServerUnreachable`` if no
    attempt reached the server, else ``ExecIndeterminate``."""
    if exec_id is None and not may_have_run:
        return exc
    return errors.ExecIndeterminate(
        f"exec may or may not have run (server unreachable: {exc.message}); re-check with "
        f"idempotency_key={key!r}", idempotency_key=key, exec_id=exec_id)


class Offsets:
    """Bytes per stream the client has; trims resumed (replayed) output."""

    def __init__(self) -> None:
        self.have = {"stdout": 0, "stderr": 0}
        self.truncated = {"stdout": 0, "stderr": 0}

    def take(self, msg: dict[str, Any]) -> bytes:
        """The new bytes of a stdout/stderr message (b"" if the client has them all)."""
        kind = msg["type"]
        data = base64.b64decode(msg["data"])
        off = msg.get("offset")
        have = self.have[kind]
        if off is None:  # a server without offsets: contiguous
            off = have
        if off > have:  # the server no longer has these bytes (lost to a restart)
            self.truncated[kind] += off - have
            have = off
        data = data[have - off:] if off < have else data
        self.have[kind] = have + len(data)
        return data

    def params(self) -> dict[str, int]:
        return {"stdout_offset": self.have["stdout"], "stderr_offset": self.have["stderr"]}
