"""SWE-ReX front door: the remote-runtime routes of the ``swe-rex`` package, per sandbox.

``RemoteRuntime(host=f"{url}/swerex/{sandbox_id}", auth_token=<rollbox api key>)`` drives a
rollbox sandbox: bash sessions (each command a PTY exec of the platform shell, framed on the
host), execute, read/write files and upload. :class:`RollboxDeployment` (needs ``swe-rex`` installed) creates
the sandbox and hands out that runtime. Owns only the ``/swerex`` routes and their sessions;
must not touch the core ``/v1`` routes, and never runs a binary of the sandbox for its own work.
"""
from __future__ import annotations

from typing import Any

from rollbox.compat.swerex.routes import mount

__all__ = ["RollboxDeployment", "mount", "runtime_url"]


def runtime_url(base_url: str, sandbox_id: str) -> str:
    """The ``host`` to give SWE-ReX's RemoteRuntime (with ``port=None``) for one sandbox."""
    return f"{base_url.rstrip('/')}/swerex/{sandbox_id}"


def __getattr__(name: str) -> Any:
    if name == "RollboxDeployment":  # imports swe-rex, which the server does not need
        from rollbox.compat.swerex.deployment import RollboxDeployment

        return RollboxDeployment
    raise AttributeError(name)
