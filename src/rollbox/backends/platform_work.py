"""The platform's own commands in a sandbox of any backend (image builds, benchmarks, the
edge's ``run_shell``): run under the platform shell as root through the sandbox's agent, in a
session of their own, outside the edge's journaled exec sessions.

Owns only that loop. Must not touch a backend's internals: it speaks to a
:class:`rollbox.backends.base.SandboxHandle` (its channel and sessions).
"""
from __future__ import annotations

import os
from collections.abc import Callable

from rollbox.agent.protocol import ExecRequest, shell_argv
from rollbox.backends.base import SandboxHandle


async def run_shell(box: SandboxHandle, cmd: str, env: dict[str, str], timeout_s: float,
                    on_output: Callable[[bytes], object] | None = None,
                    tail: int = 4000) -> tuple[int, bytes]:
    """Run ``cmd`` under the platform shell as root. Returns the exit code (-1 if none came)
    and the last ``tail`` bytes of stdout+stderr."""
    slot = box.new_session()
    try:
        session = await box.channel.exec(ExecRequest(
            argv=shell_argv(cmd), env=[f"{k}={v}" for k, v in env.items()],
            timeout_ms=int(timeout_s * 1000), platform_shell=True), slot.cgroup_fd)
    finally:
        if slot.cgroup_fd is not None:
            os.close(slot.cgroup_fd)
    out = b""
    code = -1
    try:
        async for kind, payload in session.events():
            if kind in ("stdout", "stderr"):
                out = (out + payload)[-tail:]
                if on_output is not None:
                    on_output(payload)
            elif kind == "exited":
                code = payload.exit_code
    finally:
        box.drop_session(slot.name)
    return code, out
