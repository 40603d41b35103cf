"""rollbox: elastic sandboxes for RL training of LLM agents. The SDK is the public face.

Exports resolve lazily so server-side modules (``rollbox.errors``, ``rollbox.edge``...) can be
imported without pulling in the SDK's HTTP client.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncClient": "rollbox.sdk", "AsyncProcess": "rollbox.sdk", "AsyncSandbox": "rollbox.sdk",
    "Client": "rollbox.sdk", "Process": "rollbox.sdk", "Sandbox": "rollbox.sdk",
    "OutputChunk": "rollbox.sdk",
    "AsyncJob": "rollbox.sdk", "Job": "rollbox.sdk", "JobInfo": "rollbox.models",
    "ExecResult": "rollbox.models", "ExecInfo": "rollbox.models", "Event": "rollbox.models",
    "FileStat": "rollbox.models", "SandboxInfo": "rollbox.models",
    **{name: "rollbox.errors" for name in (
        "RollboxError", "BadRequest", "Unauthorized", "Forbidden", "NotFound", "PayloadTooLarge",
        "QuotaExceeded", "SandboxDead", "SandboxPaused", "CommandTimeout", "CommandFailed",
        "InfraError", "CapacityExceeded")},
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from rollbox.errors import (  # noqa: F401 - the lazy exports, for type checkers
        BadRequest, CapacityExceeded, CommandFailed, CommandTimeout, Forbidden, InfraError,
        NotFound, PayloadTooLarge, QuotaExceeded, RollboxError, SandboxDead, SandboxPaused,
        Unauthorized,
    )
    from rollbox.models import (  # noqa: F401
        Event, ExecInfo, ExecResult, FileStat, JobInfo, SandboxInfo,
    )
    from rollbox.sdk import (  # noqa: F401
        AsyncClient, AsyncJob, AsyncProcess, AsyncSandbox, Client, Job, OutputChunk, Process,
        Sandbox,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
