"""Wire models shared by the API, the SDK and the edge (pydantic, validated on input).

Owns the shape of requests and answers only; no behaviour.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LABEL_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,63}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MAX_TIMEOUT_S = 7 * 24 * 3600
# A sandbox's service class (SandboxSpec.qos): placement (rollbox.placement) and the node's CPU
# scheduling (rollbox.isolation.qos) enforce it.
Qos = Literal["latency", "batch"]
# A trainer job's name (per project; also a URL path segment, so no "/").
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU limit in cores (CFS quota)")
    memory_mib: int = Field(1024, ge=16, le=256 * 1024)
    pids: int = Field(1024, ge=8, le=65536)
    disk_mib: int = Field(2048, ge=1, le=1024 * 1024, description="cap on the writable layer")
    inodes: int = Field(200_000, ge=64, le=50_000_000,
                        description="inode cap of the memory tier's tmpfs; on the disk tier "
                        "inodes count in disk_mib (~350 bytes each)")


NETWORK_MAX_RULES = 256  # rules of one network policy


class NetworkPolicy(BaseModel):
    """A sandbox's network: default deny; ``allow`` lists permission names (``pypi``, ``npm``,
    ``debian``, ``go``) and custom rules ``HOST:PORT[/tcp|/udp]`` or
    ``A.B.C.D[/LEN]:PORT[/tcp|/udp]`` (host names open through the sandbox's DNS gate).
    Unknown names and malformed rules are refused with bad_request."""
    model_config = ConfigDict(extra="forbid")
    allow: list[str] = Field(default_factory=list, max_length=NETWORK_MAX_RULES)

    @field_validator("allow")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        for rule in v:
            if not rule or len(rule) > 300 or any(c.isspace() or c == "\0" for c in rule):
                raise ValueError(f"malformed network rule {rule!r}")
        return v


class SandboxSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(..., min_length=1, max_length=256)
    # Extra layers (digests or image names) stacked above the image, lowest first.
    layers: list[str] = Field(default_factory=list, max_length=32)
    resources: Resources = Field(default_factory=Resources)
    ttl_s: float = Field(3600, gt=0, le=MAX_TIMEOUT_S)
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    # Paths of the tree the sandbox's own commands can not see (e.g. a task's tests): masked
    # and denied by Landlock. The platform's file API and grading still reach them.
    hidden_paths: list[str] = Field(default_factory=list, max_length=64)
    # None: no network at all (loopback only). A policy: a link to the host, default deny.
    network: NetworkPolicy | None = None
    # A live trainer job of the caller's project (see JobSpec): the sandbox is deleted when
    # the job ends or its lease expires.
    job: str | None = Field(None, max_length=128)
    # The kind of sandbox (rollbox.backends.base): "container" or "microvm"; one a node does
    # not offer is refused with bad_request naming the offered kinds.
    backend: str = Field("container", min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_-]*$")
    # What its TTL's end does: "delete" it, or "pause" it (frozen in place, memory and files
    # kept; it then lives paused_ttl_s more unless resumed and given a new TTL).
    on_expiry: Literal["delete", "pause"] = "delete"
    # A paused sandbox is resumed by traffic to it (a port proxy connection, an E2B envd call)
    # and given its ttl_s again (E2B's auto_resume); concurrent requests wait for one resume.
    resume_on_traffic: bool = False
    # What a pause at the TTL's end keeps (on_expiry "pause"): True, the memory too (frozen in
    # place); False, the filesystem only (every process stopped, memory and CPU released; a
    # resume or wake boots it again over the same layers). See pause(keep_memory=).
    pause_keep_memory: bool = True
    # Where the writable layer lives: "disk" (the node's disk pool, capped by disk_mib; writes
    # past it fail with ENOSPC/EDQUOT) or "memory" (a tmpfs: faster, but its bytes are host
    # RAM charged to the sandbox's memory limit).
    disk_tier: Literal["disk", "memory"] = "disk"
    # Makes a retried create (e.g. by the SDK on another API replica after the connection
    # broke) return the sandbox the first attempt made (or is making) instead of a second
    # one: per project, while that sandbox lives; the same key with another spec is
    # idempotency_conflict.
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)
    # Service class (rollbox.placement; the node's CPU scheduling enforces it): "batch" is
    # best-effort (a project's sandboxes by default; may go to burst nodes), "latency" is
    # latency-sensitive (graders and fncall workers; placed with more headroom, never on a
    # burst node).
    qos: Qos = "batch"
    # "vm" sandboxes of a layered image: "shell" starts the platform's busybox sh on the VGA
    # screen's tty1 inside the sandbox (a person at the live view types there; the
    # default-tier test guest); "none" leaves the screen to the kernel's console.
    vm_console: Literal["none", "shell"] = "none"

    @model_validator(mode="after")
    def _pause_kind(self) -> SandboxSpec:
        if not self.pause_keep_memory and self.on_expiry != "pause":
            raise ValueError("pause_keep_memory=false needs on_expiry 'pause'")
        return self

    @field_validator("job")
    @classmethod
    def _job(cls, v: str | None) -> str | None:
        if v is not None and not JOB_NAME_RE.match(v):
            raise ValueError(f"invalid job name {v[:130]!r}")
        return v

    @field_validator("hidden_paths")
    @classmethod
    def _hidden(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or "\0" in p or ":" in p or len(p) > 4096:
                raise ValueError(f"hidden path must be absolute, without ':' or NUL: {p[:200]!r}")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        for k, val in v.items():
            if not LABEL_RE.match(k) or len(val) > 256:
                raise ValueError(f"invalid label {k!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not ENV_KEY_RE.match(k) or "\0" in val or len(val) > 65536:
                raise ValueError(f"invalid environment variable {k!r}")
        return v


# paused: paused by the edge (pause/resume); it keeps its TTL, files, identity and disk. With
# SandboxInfo.memory_kept (the default) it is frozen in place, memory kept; without
# (pause(keep_memory=False): filesystem-paused) its processes are gone and its memory and CPU
# released, and a resume boots it again over the same layers (fresh agent, files kept).
SandboxState = Literal["creating", "running", "paused", "stopping", "dead", "deleted"]


class NetAudit(BaseModel):
    """What a sandbox's network policy refused so far (red-team audit trail): names the DNS
    gate answered REFUSED, connects and unconnected UDP sends the BPF filter denied (EPERM),
    packets it dropped (e.g. of a connection whose rule was removed)."""
    dns_refused: int = 0
    connect_denied: int = 0
    sendmsg_denied: int = 0
    packets_dropped: int = 0


class UsageSample(BaseModel):
    """One point of a sandbox's use over time (``GET /v1/sandboxes/{id}/usage``): the edge
    samples every live sandbox every ``usage_sample_s`` and keeps the last
    ``usage_samples``; ``cpu_usage_us`` is cumulative (the CPU share between two samples is its
    difference over theirs in time). None: not known for this backend."""
    at: float  # unix seconds
    memory_bytes: int | None = None
    cpu_usage_us: int | None = None
    disk_bytes: int | None = None
    oom_kills: int = 0


class SandboxUsage(BaseModel):
    """Live use of a sandbox as the host sees it (its backend's ``usage()``); None: unknown.
    A microVM's memory is its QEMU's, whatever the guest says."""
    memory_bytes: int | None = None
    cpu_usage_us: int | None = None
    cpu_throttled_us: int | None = None  # time its CPU quota held it back
    oom_kills: int = 0
    disk_bytes: int | None = None


class SandboxInfo(BaseModel):
    id: str
    node: str
    image: str
    layers: list[str]
    state: SandboxState
    created_at: float
    expires_at: float
    labels: dict[str, str]
    resources: Resources
    owner: str = ""
    dead_reason: str | None = None
    hidden_paths: list[str] = Field(default_factory=list)
    network: NetworkPolicy | None = None
    job: str | None = None
    audit: NetAudit | None = None  # live sandboxes with a network policy, in GET only
    usage: SandboxUsage | None = None  # live sandboxes, in GET only
    disk_tier: Literal["disk", "memory"] = "disk"
    backend: str = "container"
    qos: Qos = "batch"  # SandboxSpec's
    on_expiry: Literal["delete", "pause"] = "delete"
    resume_on_traffic: bool = False  # SandboxSpec's
    pause_keep_memory: bool = True  # SandboxSpec's: what a pause at the TTL's end keeps
    # False while it is paused filesystem-only (state "paused": no process, no memory held;
    # a resume reboots it); True otherwise (running, or paused with its memory frozen).
    memory_kept: bool = True
    ttl_s: float = 0.0  # the TTL it was created with (0: not recorded), given again on a wake
    # True when what the sandbox reports comes from code its own user controls (a microVM's
    # agent runs under the guest's root): exec results are the guest's word, not the host's.
    guest_reported: bool = False
    idempotency_key: str | None = None  # of the create that made it (SandboxSpec's)
    fork_key: str | None = None  # of the fork that made it (ForkSpec's idempotency_key)
    vm_console: Literal["none", "shell"] = "none"  # SandboxSpec's
    # A person holds the live view's mouse and keyboard now (the agent's computer-use input
    # is refused meanwhile), which viewer (only its input reaches the guest; the name the
    # computer.takeover event records), and how many times one took over: > 0 flags the
    # episode (rollbox.edge.takeover).
    taken_over: bool = False
    taken_over_by: str | None = None
    takeovers: int = 0


PTY_MAX_SIZE = 1000  # columns and rows of a terminal (the agent's bound too)


class PtySize(BaseModel):
    """A terminal's size in character cells."""

    model_config = ConfigDict(extra="forbid")
    cols: int = Field(80, ge=1, le=PTY_MAX_SIZE)
    rows: int = Field(24, ge=1, le=PTY_MAX_SIZE)


class ExecSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Either a command string (run by the platform shell: bash -c, never the sandbox's shell)
    # or an argv list.
    cmd: str | list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = Field("/", max_length=4096)
    user: str = Field("root", max_length=64)
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    stdin: bool = Field(False, description="keep stdin open for exec_stdin; else /dev/null")
    # A terminal: stdin, stdout and stderr are a pty of this size (its controlling terminal);
    # all output arrives as stdout, stdin is always open (raw bytes: b"\x03" is ctrl-C).
    pty: PtySize | None = Field(None, description="run on a terminal of this size")
    # With pty: stderr is its own stream (a pipe), not the terminal; stdin and stdout are.
    pty_stderr: bool = Field(False, description="with pty: stderr is a pipe, not the terminal")
    background: bool = False
    # A retry with the same key (per sandbox) returns the recorded command instead of running
    # it again, also across a server restart; the same key with another spec is refused.
    idempotency_key: str | None = Field(None, min_length=1, max_length=128,
                                        pattern=r"^[A-Za-z0-9._:-]+$")

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            if not v or "\0" in v or len(v) > 1 << 20:
                raise ValueError("cmd must be a non-empty string without NUL bytes")
        else:
            if not v or len(v) > 4096 or any("\0" in a for a in v):
                raise ValueError("argv must be non-empty, without NUL bytes")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v:
            raise ValueError("cwd must be an absolute path")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return SandboxSpec._env(v)  # type: ignore[operator]

    @model_validator(mode="after")
    def _pty_stderr(self) -> ExecSpec:
        if self.pty_stderr and self.pty is None:
            raise ValueError("pty_stderr needs pty")
        return self


class ExecResult(BaseModel):
    exec_id: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    # Killed by the kernel's OOM killer (its sandbox's memory limit, or the node's limit on
    # all sandboxes under overload); then signal is 9.
    oom_killed: bool = False
    duration_s: float
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    # Of the dropped bytes: the start of the stream lost to a server restart (a restarted edge
    # rebuilds a command from the agent, which keeps only the last 1 MiB per stream).
    stdout_truncated_bytes: int = 0
    stderr_truncated_bytes: int = 0
    # True: exit code and output were reported by a guest the sandbox's user controls (a
    # microVM), not observed by the host; grading never trusts them (a grade runs elsewhere).
    guest_reported: bool = False


class ExecInfo(BaseModel):
    exec_id: str
    cmd: str | list[str]
    state: Literal["running", "exited"]
    started_at: float
    exit_code: int | None = None
    timed_out: bool = False
    background: bool = False
    pty: bool = False  # started on a terminal (exec_resize applies)
    # bytes of output so far: the offsets to re-attach from (stream ?stdout_offset=...)
    stdout_bytes: int = 0
    stderr_bytes: int = 0


class FileStat(BaseModel):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int
    link_target: str | None = None
    # the file's (or directory's) user.* extended attributes, name -> value; None: none
    xattrs: dict[str, str] | None = None


class Event(BaseModel):
    sandbox_id: str
    seq: int
    ts: float
    kind: str  # sandbox.created, exec.started, exec.stdout, exec.stderr, exec.exited, ...
    exec_id: str | None = None
    data: str = ""


class GradeSpec(BaseModel):
    """Grade a sandbox's result in a fresh sandbox: the source's pristine layers, then
    ``layers`` (e.g. hidden tests), then only the declared ``files`` copied over from the
    source; ``cmd`` runs there. Nothing else of the source's writable tree reaches it."""
    model_config = ConfigDict(extra="forbid")
    files: list[str] = Field(..., min_length=1, max_length=64,
                             description="absolute paths (files or directories) to carry over")
    layers: list[str] = Field(default_factory=list, max_length=32)
    cmd: str | list[str]
    cwd: str = Field("/", max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(600, gt=0, le=24 * 3600)
    resources: Resources | None = None
    max_bytes: int = Field(256 << 20, gt=0, le=16 << 30, description="cap on the copied bytes")

    @field_validator("files")
    @classmethod
    def _files(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or "\0" in p or len(p) > 4096 or p.rstrip("/") == "":
                raise ValueError(f"declared file must be an absolute path below /: {p[:200]!r}")
        return v

    _cmd = field_validator("cmd")(ExecSpec._cmd.__func__)  # type: ignore[attr-defined]
    _cwd = field_validator("cwd")(ExecSpec._cwd.__func__)  # type: ignore[attr-defined]
    _env = field_validator("env")(SandboxSpec._env.__func__)  # type: ignore[attr-defined]


class GradeResult(BaseModel):
    sandbox_id: str
    grader_id: str
    files: list[str]
    copied_bytes: int
    result: ExecResult


class PortTokenRequest(BaseModel):
    """``POST /v1/sandboxes/{id}/port-tokens``: a token for one port (rollbox.api.ports);
    ``ttl_s`` None: the api's default (port_token_ttl_s)."""
    model_config = ConfigDict(extra="forbid")
    port: int = Field(..., ge=1, le=65535)
    ttl_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)


class PortAccess(BaseModel):
    """How to reach one port of a sandbox: ``path`` (the path form, below the api's URL; with
    the API key or the token in ``X-Rollbox-Port-Token``), ``host`` (the per-sandbox origin
    ``{port}-{id}.<domain>``; None when the api has no port domain), the token and its expiry
    (unix seconds)."""
    sandbox_id: str
    port: int
    path: str
    host: str | None = None
    token: str
    expires_at: float
    header: str = "X-Rollbox-Port-Token"


class SnapshotSpec(BaseModel):
    """Turn a sandbox's writable layer (scrubbed) into a new layer and tag ``name`` = the
    sandbox's layers + that layer (``pack_diff``; see docs/images.md). A "vm" sandbox's
    snapshot is its machine instead (disk + memory, nothing scrubbed: ``exclude`` and
    ``push`` are refused, ``scrub``, ``keep_git_history``, ``max_entries`` do not apply,
    ``pause`` is always on)."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=200, description="image name to tag")
    exclude: list[str] = Field(default_factory=list, max_length=256,
                               description='"/abs/glob" on the path or a basename glob')
    scrub: bool = Field(True, description="drop caches, /tmp, logs (SCRUB_RULES)")
    keep_git_history: bool = Field(
        False, description="keep every object of the snapshot's git repositories (default: "
        "only what HEAD reaches, red-team E36)")
    push: str | None = Field(None, max_length=2048,
                             description="chunk store to push to: 'default' or an allowed URL")
    pause: bool = Field(True, description="freeze the sandbox during the copy")
    max_bytes: int = Field(4 << 30, gt=0, le=64 << 30, description="cap on captured bytes")
    max_entries: int = Field(1_000_000, gt=0, le=50_000_000)

    @field_validator("exclude")
    @classmethod
    def _exclude(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p or "\0" in p or len(p) > 1024:
                raise ValueError(f"invalid exclude pattern: {p[:100]!r}")
        return v


class GitRepoFacts(BaseModel):
    """A git repository of a layer (images.git): its path, whether its history was kept, its
    objects and how many of them HEAD does not reach (0 once scrubbed)."""
    path: str
    history_kept: bool
    objects: int
    unreachable: int


class SnapshotResult(BaseModel):
    sandbox_id: str
    image: str  # the new image's name: create a sandbox from it
    # "layer": the writable layer became ``layer`` (container, microvm sandboxes: any layered
    # backend creates from the image). "machine": a "vm" sandbox's disk + memory, kept on its
    # node; the image restores as "vm" sandboxes only (same resources and network presence),
    # ``layer`` is None and ``layers`` the source's. (docs/backends/vm.md, Snapshot)
    kind: Literal["layer", "machine"] = "layer"
    layer: str | None  # digest of the new layer (None: a machine snapshot)
    layers: list[str]  # the full image: the sandbox's layers (lowest first) + the new one
    size: int  # bytes of the new layer file (a machine snapshot: its state + disk as saved)
    memory_bytes: int = 0  # a machine snapshot: bytes of the saved state (devices and RAM)
    files: int  # entries captured (whiteouts included)
    content_bytes: int  # bytes of regular files captured
    whiteouts: int
    scrubbed: int  # entries dropped by scrub rules and exclude patterns
    git_repos_scrubbed: list[str] = Field(default_factory=list)
    git_repos: list[GitRepoFacts] = Field(default_factory=list)
    paused_s: float  # how long the sandbox was frozen
    duration_s: float
    pushed_to: str | None = None
    # The source sandbox's hidden paths: their content is in the lower layers, so pass them
    # again when creating sandboxes from this image.
    hidden_paths: list[str] = Field(default_factory=list)

# ---- fork: n copies of one sandbox (EdgeAPI.fork, POST /v1/sandboxes/{id}/fork) -----------
# The most children one fork asks (the API's bound; a node may allow fewer: ROLLBOX_FORK_MAX).
MAX_FORK_CHILDREN = 100
FORK_OF_LABEL = "fork_of"


class ForkSpec(BaseModel):
    """Fork a live (or paused) sandbox into ``n`` new ones with its filesystem state."""
    model_config = ConfigDict(extra="forbid")
    n: int = Field(..., ge=1, le=MAX_FORK_CHILDREN, description="children to make")
    labels: dict[str, str] = Field(default_factory=dict, max_length=64,
                                   description="added to the labels the children inherit")
    # Makes a retried fork (the SDK sends it again on another API replica after a broken
    # connection) return the children the first attempt made (or is making) instead of n
    # more: per project, while any of them lives; the same key for another source, n or
    # labels is idempotency_conflict.
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not LABEL_RE.match(k) or len(val) > 256:
                raise ValueError(f"invalid label {k!r}")
        return v


class ForkResult(BaseModel):
    source_id: str
    children: list[SandboxInfo]  # in the order made; each labelled fork_of=<source_id>
    frozen_s: float  # how long the source was held still (frozen, or a VM stopped)
    duration_s: float


# ---- trainer jobs: leases kept alive by heartbeats (rollbox.jobs) ---------------------------
MISSED_HEARTBEATS = 3  # a lease expires after this many heartbeat intervals without one
MIN_HEARTBEAT_S = 0.2
MAX_HEARTBEAT_S = 600.0
JobState = Literal["live", "ended", "expired"]


class JobSpec(BaseModel):
    """Open (or resume, if live) the lease of job ``name`` of the caller's project."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=128)
    heartbeat_s: float = Field(10.0, ge=MIN_HEARTBEAT_S, le=MAX_HEARTBEAT_S)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError(f"invalid job name {v[:130]!r}: letters, digits, '_.-'")
        return v


class JobInfo(BaseModel):
    name: str
    project: str
    heartbeat_s: float
    state: JobState
    created_at: float
    heartbeat_at: float  # last heartbeat (or open)
    expires_at: float  # heartbeat_at + MISSED_HEARTBEATS * heartbeat_s while live
    ended_at: float | None = None
    reason: str | None = None  # why it ended or expired


class JobEnded(BaseModel):
    job: JobInfo
    deleted: list[str]  # the sandboxes deleted with it


# ---- API keys (admin) -------------------------------------------------------------------------
class ApiKeyInfo(BaseModel):
    """An API key as listed: never its secret (``display`` is its first 12 characters)."""
    key_id: str
    display: str
    project: str
    admin: bool
    created_at: float
    last_used_at: float | None = None  # to the minute (see iam.keys.LAST_USED_WRITE_S)
    revoked_at: float | None = None
    # The subtree the key administers ("" = everything: the operator's); None: none.
    scope: str | None = None


class KeySpec(BaseModel):
    """``POST /v1/keys``: a key of ``project`` (one the caller administers); ``admin``: it
    administers ``project`` and its sub-projects."""
    model_config = ConfigDict(extra="forbid")
    project: str = Field(..., min_length=1, max_length=128)
    admin: bool = False
    # "e2b": E2B's own form (e2b_ + hex) so E2B's SDKs accept it as is; same powers.
    format: Literal["rollbox", "e2b"] = "rollbox"


class CreatedKey(BaseModel):
    """A new key: ``key`` is shown here once and never again."""
    key: str
    info: ApiKeyInfo


# ---- images of a project (uploads, snapshots; rollbox.edge.storage) -------------------------
class ImageInfo(BaseModel):
    name: str
    layers: list[str]  # lowest first
    owner: str | None = None  # the project; None: one of the node's own images
    created: float = 0.0
    size: int = 0  # bytes of all its layer files
    layer: str | None = None  # the layer an upload added (uploads only)
    files: int | None = None  # entries of that layer (uploads only)


class LayerUsage(BaseModel):
    """A project's layer storage on a node: the distinct layers of the images it owns (the
    node's own images' layers not counted), against its limit."""
    project: str
    used_bytes: int
    limit_bytes: int
    images: int
    store_free_bytes: int  # free space of the image store's filesystem
    store_reserve_bytes: int  # below this, new layers are refused


# ---- fncall: stateless calls from warm pools (rollbox.fncall) ------------------------------
# go, java, rust, typescript run on the optional image fncall-polyglot:1 (`rollbox image
# ensure-polyglot`); a node without it refuses them (bad_request).
FnCallLanguage = Literal["python", "bash", "c", "cpp", "nodejs", "go", "java", "rust",
                         "typescript"]
FnCallStatus = Literal["ok", "runtime_error", "timeout", "memory_exceeded", "compile_error"]
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class FnCallSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: FnCallLanguage
    code: str = Field(..., max_length=1 << 20)
    # relative path -> base64 content, written into the call's fresh working directory
    files: dict[str, str] = Field(default_factory=dict)
    stdin: str = Field("", max_length=8 << 20)
    args: list[str] = Field(default_factory=list, max_length=256)
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(10.0, gt=0, le=600)
    compile_timeout_s: float = Field(30.0, gt=0, le=600)
    memory_mib: int = Field(512, ge=16, le=8192)
    max_output_bytes: int = Field(1 << 20, ge=0, le=8 << 20, description="kept per stream")
    # Python modules imported before the call arrives; one warm pool per distinct set.
    preload: list[str] = Field(default_factory=list, max_length=64)
    image: str | None = Field(None, max_length=256, description="default: the fncall image")
    # files returned base64 in the result, at most 8 MiB in all: relative to the call dir, or
    # absolute paths of files the call itself wrote elsewhere (e.g. /tmp, /mnt)
    fetch_files: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError("at most 256 files")
        for k in v:
            if not k or k.startswith("/") or "\0" in k or ".." in k.split("/") or len(k) > 1024:
                raise ValueError(f"file path must be relative and inside the call dir: {k!r}")
        return v

    @field_validator("preload")
    @classmethod
    def _preload(cls, v: list[str]) -> list[str]:
        for m in v:
            if not MODULE_RE.match(m) or len(m) > 200:
                raise ValueError(f"invalid module name {m!r}")
        return sorted(set(v))

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return SandboxSpec._env(v)  # type: ignore[operator]


class FnCallStep(BaseModel):
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0


class FnCallResult(BaseModel):
    status: FnCallStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0  # produced; beyond max_output_bytes only counted
    stderr_bytes: int = 0
    truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    compile: FnCallStep | None = None
    files: dict[str, str] = Field(default_factory=dict)  # fetch_files that existed, base64
    worker: str = ""  # the warm sandbox that ran it


class FnCallBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    calls: list[FnCallSpec] = Field(..., max_length=4096)
    concurrency: int = Field(32, ge=1, le=1024)


class FnCallBatchItem(BaseModel):
    result: FnCallResult | None = None
    error: dict | None = None  # the typed error payload's "error" object


class FnCallBatchResult(BaseModel):
    results: list[FnCallBatchItem]


MAX_QUOTA_INT = 1 << 48  # 256 TiB of MiB, 2.8e14 sandboxes: above any cluster, exact as a float
MAX_QUOTA_CPUS = float(1 << 24)


class Quota(BaseModel):
    """A project's limits (None = unlimited): live sandboxes, and the sums of the CPUs and
    memory they request, over the whole cluster and the project's sub-projects, carved out of
    its parent's (``docs/iam.md``); ``layer_mib``: storage of the project's own layers per node
    (snapshots, uploads). Set by an admin of a project above it
    (``PUT /v1/projects/{project}/quota``)."""
    model_config = ConfigDict(extra="forbid")
    # Bounded: a stored limit must fit a 64-bit column (SQLite INTEGER, PostgreSQL BIGINT) and
    # stay exact as the float the delegation sums use; cpus finite (inf - inf is NaN there).
    sandboxes: int | None = Field(None, ge=0, le=MAX_QUOTA_INT)
    cpus: float | None = Field(None, ge=0, le=MAX_QUOTA_CPUS, allow_inf_nan=False)
    memory_mib: int | None = Field(None, ge=0, le=MAX_QUOTA_INT)
    layer_mib: int | None = Field(None, ge=0, le=MAX_QUOTA_INT)


# ---- cluster view (rollbox.watcher) -------------------------------------------------------
# The reason a sandbox is dead when the watcher lost its node (SandboxInfo.dead_reason and the
# details of SandboxDead).
NODE_LOST = "node_lost"
NodeHealth = Literal["alive", "suspect", "dead"]


class NodeSandbox(BaseModel):
    """One live sandbox as its node's report lists it (``NodeReport.sandboxes``): bounded
    facts only (a few hundred bytes at most, whatever the project put in its labels). No
    labels: a project's 64 labels of up to 319 characters each would make every probe of the
    node megabytes (docs/watcher.md, Reports). ``platform``: it carries a ``rollbox.*`` label
    (a grader or fncall worker of the platform's, not charged to a project)."""
    id: str
    owner: str
    backend: str
    state: SandboxState
    cpus: float
    memory_mib: int
    created_at: float
    expires_at: float
    image: str  # at most 256 characters (SandboxSpec.image)
    platform: bool = False
    job: str | None = None


class NodeReport(BaseModel):
    """What one probe of an edge answers (``EdgeAPI.report``): cheap, from the edge's memory
    (no per-sandbox I/O). ``free``: room left per budget after overcommit for a new create, as
    the edge's admission counts it ("sandboxes", "cpus", "memory_mib"); ``limits``: the node's
    full budgets; ``sandboxes``: its live sandboxes, at most the probe's bound
    (``sandboxes_total`` counts them all, ``truncated`` when the list stops short)."""
    node_id: str
    # random per edge process start: a change means the edge restarted between two probes
    incarnation: str
    started_at: float  # wall time the edge process started
    at: float  # the edge's wall time of the report
    backends: list[str]  # kinds offered now
    free: dict[str, float]
    limits: dict[str, float]
    # live host memory new creates may get now (MemAvailable - promised - reserve), the warm
    # pool's included: a create evicts pooled sandboxes before it is refused (rollbox.edge.pool)
    memory_available_mib: int
    # of it, what the warm pool's sandboxes hold now (their live use and the start-up headroom
    # still promised to them): reclaimable by eviction, not used by sandboxes the node keeps
    pooled_memory_mib: int = 0
    pooled: int = 0  # pooled sandboxes (not in sandboxes_total: nobody's yet)
    starting: int  # creates in progress
    sandboxes: list[NodeSandbox]
    sandboxes_total: int
    truncated: bool = False
    layers: list[str] = Field(default_factory=list)  # layer digests in the node's cache
    by_backend: dict[str, int] = Field(default_factory=dict)
    by_project: dict[str, int] = Field(default_factory=dict)
    # seconds this edge tears its sandboxes down after going unprobed (None: not fenced)
    fence_s: float | None = None
    # a burst node (ROLLBOX_NODE_BURST, started by the autoscaler; rollbox.placement.burst)
    burst: bool = False
    # refusing new creates (Edge.drain: a burst node being released)
    draining: bool = False


class NodeStatus(BaseModel):
    """One node in ``rollbox cluster status`` (``Watcher.status``)."""
    node_id: str
    health: NodeHealth
    incarnation: str | None = None
    last_seen_s: float | None = None  # seconds since its last answered probe (None: never)
    backends: list[str] = Field(default_factory=list)
    free: dict[str, float] = Field(default_factory=dict)
    starting: int = 0
    sandboxes: int = 0  # live (scoped: the caller's project's only)
    lost: int = 0  # reported dead with reason node_lost (scoped likewise)
    by_backend: dict[str, int] = Field(default_factory=dict)
    by_project: dict[str, int] = Field(default_factory=dict)
    burst: bool = False  # a burst node (started by the autoscaler above the use threshold)
    draining: bool = False  # refusing creates (a burst node being released)


class ClusterStatus(BaseModel):
    """The watcher's view of the cluster; scoped to one project (``project``), it counts and
    names only that project's sandboxes."""
    project: str | None = None
    nodes: list[NodeStatus]
    sandboxes: int
    by_backend: dict[str, int] = Field(default_factory=dict)
    by_project: dict[str, int] = Field(default_factory=dict)


class QuotaUsage(BaseModel):
    """What sandboxes hold: a count and the sums of their requested CPUs and memory."""
    sandboxes: int = 0
    cpus: float = 0.0
    memory_mib: int = 0


class ProjectSpec(BaseModel):
    """``POST /v1/projects``: ``name`` is the full path (``team/run-7``), or one segment with
    ``parent``; ``quota`` is carved out of the parent's (none: nothing of what the parent
    limits)."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=128)
    parent: str | None = Field(None, min_length=1, max_length=128)
    quota: Quota | None = None


class Project(BaseModel):
    """A project as listed: its limits, what it and its sub-projects use (``used``), what
    it uses itself and what it has delegated to its children (the sums of their limits)."""
    name: str
    parent: str | None
    quota: Quota
    used: QuotaUsage
    own_used: QuotaUsage
    delegated: QuotaUsage
    created_at: float


# ---- computer use (backend "vm": docs/backends/vm.md) --------------------------------------
MouseButton = Literal["left", "right", "middle"]
# The bounds here are the wire's; the backend checks coordinates against the display it has,
# key names against its key table and text against what its layout can type.
MAX_COORD = 16384
MAX_TYPE_CHARS = 65536


class ComputerAction(BaseModel):
    """One input action for a sandbox's screen (``POST /v1/sandboxes/{id}/computer``).
    ``move``/``click``/``double_click``: the pointer to (x, y), then the button;
    ``drag``: press at (x, y), move to (x2, y2), release; ``scroll``: at (x, y), ``dy`` wheel
    steps (negative: up), ``dx`` ignored unless the guest has a horizontal wheel (refused);
    ``type``: ``text`` typed key by key; ``press``: a chord like ``ctrl+s`` (``keys``)."""
    model_config = ConfigDict(extra="forbid")
    action: Literal["move", "click", "double_click", "drag", "scroll", "type", "press"]
    x: int | None = Field(None, ge=-MAX_COORD, le=MAX_COORD)
    y: int | None = Field(None, ge=-MAX_COORD, le=MAX_COORD)
    x2: int | None = Field(None, ge=-MAX_COORD, le=MAX_COORD)
    y2: int | None = Field(None, ge=-MAX_COORD, le=MAX_COORD)
    button: MouseButton = "left"
    dy: int = Field(0, ge=-100, le=100)
    text: str | None = Field(None, max_length=MAX_TYPE_CHARS)
    keys: str | None = Field(None, min_length=1, max_length=128)
    screenshot_hash: bool = Field(False, description="record the screen's sha256 after it")


class DisplayInfo(BaseModel):
    """A sandbox's screen as its VM draws it now."""
    width: int
    height: int


class ViewRequest(BaseModel):
    """``POST /v1/sandboxes/{id}/view``: a live view of the screen (rollbox.api.liveview);
    ``ttl_s``: how long the view's cookie lives (None: the api's view_token_ttl_s)."""
    model_config = ConfigDict(extra="forbid")
    ttl_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)


class ViewAccess(BaseModel):
    """A live view: ``url`` (below the api's URL) holds a one-time code that a browser
    exchanges for the view's cookie by opening it, before ``code_expires_at``; the view then
    lives until ``expires_at`` at the latest (unix seconds), and ends with the sandbox."""
    sandbox_id: str
    url: str
    code_expires_at: float
    expires_in_s: float


class ComputerActionResult(BaseModel):
    """What an action did: the display it was checked against, the input events sent, when
    (recorded in the event log as ``computer.<action>``) and, if asked, the screen's hash."""
    action: str
    display: DisplayInfo
    events: int
    ts: float
    screenshot_sha256: str | None = None
