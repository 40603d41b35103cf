"""Wire models shared by the API, the SDK and the edge (pydantic, validated on input).

Owns the shape of requests and answers only; no behaviour.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LABEL_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,63}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MAX_TIMEOUT_S = 7 * 24 * 3600


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU limit in cores (CFS quota)")
    memory_mib: int = Field(1024, ge=16, le=256 * 1024)
    pids: int = Field(1024, ge=8, le=65536)
    disk_mib: int = Field(2048, ge=1, le=1024 * 1024, description="cap on the writable layer")
    inodes: int = Field(200_000, ge=64, le=50_000_000)


class SandboxSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(..., min_length=1, max_length=256)
    # Extra layers (digests or image names) stacked above the image, lowest first.
    layers: list[str] = Field(default_factory=list, max_length=32)
    resources: Resources = Field(default_factory=Resources)
    ttl_s: float = Field(3600, gt=0, le=MAX_TIMEOUT_S)
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    backend: Literal["container"] = "container"

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


SandboxState = Literal["creating", "running", "stopping", "dead", "deleted"]


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


class ExecSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Either a shell command string (run with /bin/sh -c) or an argv list.
    cmd: str | list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = Field("/", max_length=4096)
    user: str = Field("root", max_length=64)
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    stdin: bool = Field(False, description="keep stdin open for exec_stdin; else /dev/null")
    background: bool = False

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


class ExecResult(BaseModel):
    exec_id: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_dropped: int = 0
    stderr_dropped: int = 0


class ExecInfo(BaseModel):
    exec_id: str
    cmd: str | list[str]
    state: Literal["running", "exited"]
    started_at: float
    exit_code: int | None = None
    timed_out: bool = False
    background: bool = False


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


class Event(BaseModel):
    sandbox_id: str
    seq: int
    ts: float
    kind: str  # sandbox.created, exec.started, exec.stdout, exec.stderr, exec.exited, ...
    exec_id: str | None = None
    data: str = ""
