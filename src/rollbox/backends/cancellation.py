"""How a backend's create meets a cancellation: it ends cancelled and leaves nothing.

A create is cancelled midway when its caller gives up on it (a trainer's timeout, a template
build's create, the edge's close, a server's shutdown). Two rules make that safe, for every
backend:

- :func:`to_the_end`: a step that makes something on the host (a thread of ``to_thread``, a
  child process such as ``runc run -d`` or the jailer) runs to its end before the cancellation
  goes on. Left running, it made its mounts, cgroups, namespaces or processes behind the
  teardown's back, and they outlived the sandbox.
- :func:`teardown_after`: a teardown that fails after a cancellation is logged and the create
  stays cancelled; an InfraError raised there would replace the CancelledError (a template
  build looked failed and its create booted cold and finished).

- :func:`all_or_raise`: steps run at once, each to its own end; the first failure is raised
  after all have ended (a fork's children: the caller tears down the ones made).

Owns those rules only; each backend decides which of its steps they wrap. Below every
backend (and knows none of them), like ``base``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


async def to_the_end(step: Awaitable[T], dispose: Callable[[T], object] | None = None) -> T:
    """Await ``step`` to its end even when the caller is cancelled meanwhile, then raise the
    cancellation: a thread (``to_thread``) or a child process goes on after a cancel and
    would make its files, cgroups or processes behind the teardown's back. ``dispose`` gets
    what a step that ended well after all made (its caller will never use it). A second
    cancellation stops the wait (the step then ends on its own)."""
    task = asyncio.ensure_future(step)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if dispose is not None and not task.cancelled() and task.exception() is None:
            dispose(task.result())
        raise


async def teardown_after(failure: BaseException, teardown: Awaitable[object]) -> None:
    """Run ``teardown`` (shielded) for a step that failed with ``failure``. Its own error
    propagates after an error, but never replaces a cancellation (it is logged: the create
    stays cancelled, whatever the teardown left)."""
    try:
        await asyncio.shield(teardown)
    except Exception as exc:
        if isinstance(failure, Exception):
            raise
        log.warning("teardown after a cancellation failed (the cancellation goes on): %s", exc)


async def all_or_raise(steps: list[Awaitable[T]]) -> list[T]:
    """Await every step at once, each to its end (none is cancelled by another's failure);
    their results in order, or the first failure once all have ended."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]
