"""Files and snapshots of a microVM: through its agent, never on the host.

The host never mounts the guest's disk (a crafted ext4 image attacks the host's kernel), so
the file API is ``rollbox.agent.files`` (the platform's busybox applets in the sandbox's root,
their output parsed as hostile) and a snapshot is ``rollbox.agent.snapshot`` (busybox tar of
the overlay upper). The guest's agent runs the platform's tools in a view of the overlay alone
(none of the sandbox's mounts, nor masks over hidden paths: what a container's host-side file
API sees), with the upper read-only at :data:`GUEST_UPPER` of that view.

Owns this wiring only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rollbox.agent import snapshot as agent_snapshot
from rollbox.agent.files import AgentFiles
from rollbox.agent.tools import PlatformTools
from rollbox.backends.base import CaptureOptions, CaptureResult

GUEST_UPPER = "/proc"  # agent.c TOOL_VIEW_UPPER: /rw/upper, read-only, in the tools' view


def vm_files(vm: Any) -> AgentFiles:
    """The files of ``vm`` (a MicroVM handle; its channel is read at each call: an adopted
    VM gets a new one)."""
    return AgentFiles(PlatformTools(lambda: vm.channel))


async def capture(files: AgentFiles, dest: Path, opts: CaptureOptions) -> CaptureResult:
    """The VM's writable layer as an overlay upper in ``dest`` (see agent.snapshot). The guest
    keeps running: ``opts.pause`` can not freeze it without stopping its agent too."""
    return await agent_snapshot.capture_writable(
        files, lambda cap: agent_snapshot.tar_stream(files, GUEST_UPPER, cap), dest, opts)
