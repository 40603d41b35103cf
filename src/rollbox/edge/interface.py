"""The operations an edge offers to the api (and, in a cluster, to remote api replicas).

``api`` depends only on this interface; ``edge.Edge`` implements it for one node, and
``edge.remote.RemoteEdge`` for an edge served over HTTP (``edge.service``). Every method that may
be remote is ``async`` (or an async iterator). Output
streams are async iterators of :class:`ExecOutput` items ending with exactly one ``exit``
(or ``error``) item.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollbox.agent.protocol import ExecRequest
from rollbox.backends.base import PortStream
from rollbox.models import (
    Event, ExecInfo, ExecResult, ExecSpec, FileStat, ForkResult, ForkSpec, GradeResult,
    GradeSpec, ImageInfo,
    LayerUsage, NetworkPolicy, NodeReport, SandboxInfo, SandboxSpec, SnapshotResult,
    SnapshotSpec, UsageSample, ComputerAction, ComputerActionResult, DisplayInfo,
)


@dataclass
class ExecOutput:
    kind: Literal["started", "stdout", "stderr", "exit", "error"]
    exec_id: str
    data: bytes = b""
    result: ExecResult | None = None
    offset: int = 0  # stdout/stderr: stream offset of data's first byte
    error: Exception | None = None


# Whose share of the node's budgets a create takes (edge.admission): "reserved" is the
# platform's own sandboxes that must not starve behind new creates (fncall workers).
Share = Literal["new", "reserved"]


class PlatformProcess(Protocol):
    """One of the platform's own processes in a sandbox (``EdgeAPI.platform_exec``): the agent
    channel's session. ``events()`` yields ("stdout"|"stderr", bytes) and ends with
    ("exited", rollbox.agent.protocol.Exited)."""

    def events(self) -> AsyncIterator[tuple[str, Any]]: ...
    async def write_stdin(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def kill(self) -> None: ...


class EdgeAPI(Protocol):
    node_id: str

    # Counts, memory and budgets of the node (edge.admission), ``free`` (placement ranks by
    # it), ``max_sandboxes``, and ``backends``: each kind with whether it is offered and its
    # facts (rollbox.backends.base.BackendCapacity).
    async def capacity(self) -> dict[str, object]: ...

    # The watcher's probe (rollbox.watcher), once a second: capacity after overcommit, creates
    # in progress, the live sandboxes (at most ``max_sandboxes`` listed), cached layers, counts
    # per backend and project; from memory, no per-sandbox I/O. ``fence_s`` arms the edge's
    # fence (rollbox.edge.fence: unprobed that long, it tears its sandboxes down as node_lost);
    # None disarms it.
    async def report(self, max_sandboxes: int = 10000,
                     fence_s: float | None = None) -> NodeReport: ...
    # Sandboxes the watcher reported dead (node_lost) while it could not reach this node: the
    # live ones among them are torn down (never resurrected stale); returns those ids.
    async def declare_lost(self, sandbox_ids: list[str]) -> list[str]: ...

    # ``requested``: the data (JSON text) of the api's ``sandbox.requested`` event (who asked),
    # logged by the edge after its sandbox.created, or before a delete's own events: in the
    # same call, not a record_event round trip of its own.
    async def create(self, spec: SandboxSpec, owner: str, share: Share = "new",
                     requested: str | None = None) -> SandboxInfo: ...
    async def get(self, sandbox_id: str) -> SandboxInfo: ...
    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]: ...
    async def delete(self, sandbox_id: str, requested: str | None = None) -> None: ...
    async def set_ttl(self, sandbox_id: str, ttl_s: float) -> SandboxInfo: ...
    # network policy of a live sandbox (None: deny all); effective for existing connections.
    async def set_network(self, sandbox_id: str, policy: NetworkPolicy | None) -> SandboxInfo: ...
    # the sandbox's sampled use, oldest first, ending with one taken now
    async def usage_history(self, sandbox_id: str) -> list[UsageSample]: ...
    # pause freezes the whole sandbox (state "paused"; exec answers SandboxPaused, host-side
    # files/TTL/network/delete still work; the TTL keeps counting); resume thaws it. Both are
    # idempotent. keep_memory=False: filesystem-only (memory_kept false): every process
    # stopped, memory and CPU released, files and identity kept; resume boots it again
    # (NotSupported where its backend can not, BadRequest for a platform sandbox).
    async def pause(self, sandbox_id: str, keep_memory: bool = True) -> SandboxInfo: ...
    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    # exec: start returns the exec id at once (the recorded one for a known idempotency key);
    # stream() replays what is buffered from the given (stdout, stderr) offsets and follows.
    async def exec_start(self, sandbox_id: str, spec: ExecSpec) -> str: ...
    def exec_stream(self, sandbox_id: str, exec_id: str,
                    offsets: tuple[int, int] = (0, 0)) -> AsyncIterator[ExecOutput]: ...
    async def exec_wait(self, sandbox_id: str, exec_id: str) -> ExecResult: ...
    # exec_start and then exec_wait in one call (the api's wait=1: one round trip to a remote
    # edge, not two).
    async def exec_run(self, sandbox_id: str, spec: ExecSpec) -> ExecResult: ...
    async def exec_stdin(self, sandbox_id: str, exec_id: str, data: bytes, eof: bool) -> None: ...
    async def exec_kill(self, sandbox_id: str, exec_id: str, signal: int) -> None: ...
    # a pty command's terminal size (cols, rows in 1..models.PTY_MAX_SIZE; BadRequest else,
    # or when the command has no terminal or has exited)
    async def exec_resize(self, sandbox_id: str, exec_id: str, cols: int, rows: int) -> None: ...
    async def exec_list(self, sandbox_id: str) -> list[ExecInfo]: ...
    # traffic to a sandbox: a paused one with resume_on_traffic is resumed (one resume for
    # concurrent callers) and given its creation TTL again; any other is returned as it is
    async def wake(self, sandbox_id: str) -> SandboxInfo: ...

    # files: every path is resolved inside the sandbox root (links never lead out of it).
    async def file_read(self, sandbox_id: str, path: str, max_bytes: int) -> bytes: ...
    async def file_write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None: ...
    # streamed single files: memory stays bounded whatever the size; a write is atomic (the
    # file appears complete or not at all) and counts against the sandbox's disk cap. A read
    # from ``offset`` on resumes a download where it broke (BadRequest below 0).
    def file_read_stream(self, sandbox_id: str, path: str, max_bytes: int,
                         offset: int = 0) -> AsyncIterator[bytes]: ...
    # ``xattrs``: user.* extended attributes the new file gets (hostfs.check_xattrs' caps;
    # BadRequest else, NotSupported on a backend without them); a replaced file's are gone.
    async def file_write_stream(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                                mode: int, max_bytes: int,
                                xattrs: dict[str, str] | None = None) -> int: ...
    async def file_stat(self, sandbox_id: str, path: str) -> FileStat: ...
    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]: ...
    async def file_mkdir(self, sandbox_id: str, path: str, parents: bool) -> None: ...
    async def file_remove(self, sandbox_id: str, path: str, recursive: bool) -> None: ...
    async def upload_tar(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes]) -> int: ...
    def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]: ...

    # grading: a fresh sandbox of the pristine layers + only the declared files.
    async def grade(self, sandbox_id: str, spec: GradeSpec, owner: str) -> GradeResult: ...

    # snapshot (pack_diff): the writable layer, scrubbed, becomes a new layer; spec.name is
    # tagged as the sandbox's layers + it, so create(spec.name) restores the same tree.
    async def snapshot(self, sandbox_id: str, spec: SnapshotSpec,
                       owner: str) -> SnapshotResult: ...

    # fork: spec.n new sandboxes of ``owner`` from the live or paused sandbox's filesystem
    # state (Backend.fork), on this node; all admitted at once, all made or none.
    async def fork(self, sandbox_id: str, spec: ForkSpec, owner: str) -> ForkResult: ...

    # images of a project on this node (rollbox.edge.storage): an upload is a tar stream the
    # edge builds one layer from (over ``base``); owner None lists/deletes as an admin.
    async def image_upload(self, name: str, chunks: AsyncIterator[bytes], owner: str,
                           base: str | None = None) -> ImageInfo: ...
    async def image_list(self, owner: str | None) -> list[ImageInfo]: ...
    async def image_delete(self, name: str, owner: str | None) -> None: ...
    async def image_usage(self, owner: str) -> LayerUsage: ...

    # lazy-loading counters of the node's image store (per layer; per sandbox, filtered to
    # ``project`` unless None: admin), see rollbox.images.lazy.
    async def image_stats(self, project: str | None) -> dict[str, Any]: ...

    # events outlive the sandbox; follow=True keeps streaming until the sandbox is gone.
    def events(self, sandbox_id: str, after_seq: int, follow: bool) -> AsyncIterator[Event]: ...
    # an event of the platform's own about a sandbox (e.g. fncall.call), into its audit trail.
    async def record_event(self, sandbox_id: str, kind: str, data: str) -> None: ...

    # Computer use ("vm" sandboxes; others: BadRequest): the screen as PNG bytes, its size,
    # one mouse/keyboard action (recorded in the event log as computer.<action>).
    async def screenshot(self, sandbox_id: str, format: str = "png") -> bytes: ...
    async def display_info(self, sandbox_id: str) -> DisplayInfo: ...
    async def computer_action(self, sandbox_id: str,
                              action: ComputerAction) -> ComputerActionResult: ...
    # The live view (rollbox.api.liveview): a viewer's RFB stream to the screen (the bytes
    # QEMU's VNC server sends; what the viewer writes is checked, its input reaches the guest
    # only while ``viewer`` holds it: rollbox.backends.vm.rfb, rollbox.edge.takeover),
    # recorded as computer.view with ``viewer``. Take-over (``taken``) and release by a
    # person ``by``: recorded (computer.takeover / computer.release) and in SandboxInfo
    # (taken_over, taken_over_by, takeovers); one holder at a time (another viewer's
    # take-over answers DisplayLocked), a release by anyone; meanwhile computer_action
    # answers DisplayLocked.
    async def display_open(self, sandbox_id: str, viewer: str) -> PortStream: ...
    async def display_takeover(self, sandbox_id: str, taken: bool, by: str) -> SandboxInfo: ...

    # The platform's own processes in a sandbox it owns (fncall workers, image builds,
    # benchmarks), never a project's command: run as ``req`` says through the agent, in a
    # session of their own, not journaled, not in the event log, no exec id. A paused
    # sandbox answers SandboxPaused.
    async def platform_exec(self, sandbox_id: str, req: ExecRequest) -> PlatformProcess: ...
    # ``cmd`` under the platform shell as root; (exit code or -1, last ``tail`` output bytes).
    async def run_shell(self, sandbox_id: str, cmd: str, env: dict[str, str],
                        timeout_s: float, tail: int = 4000) -> tuple[int, bytes]: ...

    # Exposed ports (rollbox.api.ports): a connection to 127.0.0.1:``port`` of a running
    # sandbox as the sandbox itself sees it (Backend.open_port: never the host's loopback nor
    # another sandbox), with or without network permission. BadRequest for a port outside
    # 1..65535, SandboxPaused, NotFound/SandboxDead, PortNotListening (maybe only at the first
    # read). The caller closes it; the edge closes it when the sandbox goes.
    async def port_open(self, sandbox_id: str, port: int) -> PortStream: ...
