"""Files and snapshots of a microVM: through its agent, never on the host.

The host never mounts the guest's disk (a crafted ext4 image attacks the host's kernel), so
the file API is ``rollbox.agent.files`` (the platform's busybox applets in the sandbox's root,
their output parsed as hostile) and a snapshot is ``rollbox.agent.snapshot`` (busybox tar of
the overlay upper). The guest's agent runs the platform's tools in a view of the overlay alone
(none of the sandbox's mounts, nor masks over hidden paths: what a container's host-side file
API sees), with the upper read-only at :data:`GUEST_UPPER` of that view.

Hidden paths (the task's tests, answers) are masked in the sandbox's own root before its first
command: an empty read-only tmpfs over a directory, /dev/null over a file, a missing one made an
empty directory first (as containers do). The tools' view has no masks, so the file API and
grading still reach them. Unlike a container's, a VM's root holds every capability inside its
guest and can unmount a mask: a hidden path keeps honest commands and tools from seeing the
files, while grading's defence is that it runs in a fresh VM the agent never touched (add the
secret files to the grade, ``GradeSpec.layers``, rather than to the agent's image).

Files, tar and snapshots of a paused VM fail at once with SandboxPaused (its agent is frozen
with the vCPUs); those in progress when the pause comes fail with it at once too
(:func:`cut_file_ops`; what they did in the guest before stays, their tools are killed on
resume). A container's are served while paused (host side).

Owns this wiring only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rollbox import errors
from rollbox.agent import protocol as P
from rollbox.agent import snapshot as agent_snapshot
from rollbox.agent.files import AgentFiles
from rollbox.agent.tools import PlatformTools, tool_error
from rollbox.backends.base import CaptureOptions, CaptureResult
from rollbox.backends.container.bundle import normalize_hidden

GUEST_UPPER = "/proc"  # agent.c TOOL_VIEW_UPPER: /rw/upper, read-only, in the tools' view


def paused_error(vm: Any, *, during: bool = False) -> errors.SandboxPaused:
    what = "was paused during the file operation" if during else "is a paused microVM"
    return errors.SandboxPaused(
        f"sandbox {vm.id} {what}: its files are served by its agent, which is stopped with "
        "it; resume it first", sandbox_id=vm.id)


def live_channel(vm: Any) -> Any:
    """``vm``'s agent channel for a file operation; SandboxPaused at once when the VM is
    paused: its agent is stopped with the vCPUs and would answer only after the resume (the
    caller waited out the host deadline for an InfraError)."""
    if vm.paused:
        raise paused_error(vm)
    return vm.channel


def cut_file_ops(vm: Any) -> None:
    """``vm`` is being paused: its file operations in progress fail with SandboxPaused now
    (set ``vm.paused`` first, so none starts meanwhile)."""
    if isinstance(vm.files, AgentFiles):
        vm.files.tools.interrupt(paused_error(vm, during=True))


def vm_files(vm: Any) -> AgentFiles:
    """The files of ``vm`` (a MicroVM handle; its channel is read at each call: an adopted
    VM gets a new one; a paused one answers SandboxPaused, see :func:`live_channel`)."""
    return AgentFiles(PlatformTools(lambda: live_channel(vm)))


async def capture(files: AgentFiles, dest: Path, opts: CaptureOptions) -> CaptureResult:
    """The VM's writable layer as an overlay upper in ``dest`` (see agent.snapshot), its user.*
    extended attributes included (the agent's ``rollbox-xattrs``). The guest keeps running: ``opts.pause`` can not freeze it without stopping its agent too.
    A snapshot's content only: image builds run on the container backend."""
    if opts.content != "snapshot":
        raise errors.BadRequest(f"a microVM's writable layer is captured as a snapshot, "
                                f"not as {opts.content!r}")
    return await agent_snapshot.capture_writable(
        files, lambda cap: agent_snapshot.tar_stream(files, GUEST_UPPER, cap), dest, opts,
        lambda: agent_snapshot.xattr_records(files, GUEST_UPPER))


def in_sandbox_request(argv: list[str], stdin: bool, timeout_ms: int, stream_limit: int
                       ) -> P.ExecRequest:
    """A platform applet in the sandbox's root (its /proc, /dev, /run), not the tools' view."""
    return P.ExecRequest(argv=argv, env=[], timeout_ms=timeout_ms, stdin=stdin,
                         stream_limit=stream_limit, tail_limit=0, platform_tool=True,
                         tool_in_sandbox=True)


async def mask_hidden(vm: Any, paths: tuple[str, ...] | list[str]) -> None:
    """Mask each hidden path in the sandbox's root (see the module docstring)."""
    tools = PlatformTools(lambda: vm.channel, request=in_sandbox_request)
    for path in normalize_hidden(paths):
        res = await tools.run(["stat", "-L", "-c", "%F", "--", path])
        kind = res.stdout.strip()
        if not res.ok:
            err = tool_error(res, path, "stat")
            if not isinstance(err, errors.NotFound):
                raise err
            made = await tools.run(["mkdir", "-p", "-m", "755", "--", path])
            if not made.ok:
                raise tool_error(made, path, "mkdir")
            kind = b"directory"
        if kind == b"directory":
            argv = ["mount", "-t", "tmpfs", "-o", "ro,nosuid,nodev,noexec,size=4k,mode=0555",
                    "rollbox-hidden", path]
        else:
            argv = ["mount", "-o", "bind", "/dev/null", path]
        res = await tools.run(argv)
        if not res.ok:
            raise errors.InfraError(f"hidden path {path} not masked in the microVM: "
                                    f"{res.message()}", path=path)
