"""What the E2B front door keeps: the access-token secret, the template -> image map, and the
mappings between E2B's names and rollbox's (pids, metadata, users, paths).
"""
from __future__ import annotations

import contextvars
import datetime as dt
import hashlib
import hmac
import re
import secrets
import time
from pathlib import Path

from rollbox import errors
from rollbox.config import Settings
from rollbox.default_images import E2B_BASE_IMAGE
from rollbox.iam.keyfile import node_secret
from rollbox.models import LABEL_RE, SandboxInfo

# The envd version rollbox speaks, and what the SDK (2.63) then uses: >= 0.1.4 recursive
# watch, 0.3.0 optional stdin, 0.4.0 no default user sent, 0.5.2 close stdin, 0.5.7
# octet-stream (and gzip) uploads, 0.6.2 file metadata (user.e2b.* xattrs of the file), 0.6.3
# entry info in watch events, 0.6.4 watches on network mounts (polled: nothing to refuse).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "rollbox"
TEMPLATE_LABEL = "e2b.template"
META_PREFIX = "e2b.m."
# E2B pids are numbers; rollbox exec ids are "e<n>" per sandbox: pid = n + PID_BASE.
PID_BASE = 1000
_EXEC_RE = re.compile(r"^e(\d{1,9})$")
# E2B's default user is "user". A sandbox of E2B's base template (rollbox's e2b-base image)
# has one (home /home/user); in root images "user" (and no user) run as root, home /root.
USER_LABEL = "e2b.user"
DEFAULT_USER = "root"
HOME = "/root"
E2B_USER, E2B_HOME, E2B_UID = "user", "/home/user", 1000
# The default user of the envd request being served (set by envd's route() from the
# sandbox's USER_LABEL): what "no user"/"user" and relative paths resolve against.
_default_user: contextvars.ContextVar[str] = contextvars.ContextVar("e2b_user", default="root")


def set_default_user(user: str) -> None:
    _default_user.set(user)


def home() -> str:
    return E2B_HOME if _default_user.get() == E2B_USER else HOME


def _load_secret(settings: Settings) -> bytes:
    """Key of the envd access tokens: the node's e2b_secret, else a root-only file in the data
    dir (tokens stay valid across restarts), else a per-process random key."""
    try:
        return node_secret(settings.e2b_secret, Path(settings.data_dir) / "e2b-token.key")
    except (OSError, ValueError):  # no writable data dir, or a file that holds no key
        return secrets.token_bytes(32)


class E2BState:
    def __init__(self, settings: Settings | None = None,
                 templates: dict[str, str] | None = None) -> None:
        settings = settings or Settings()
        self.templates = (templates if templates is not None
                          else {"base": E2B_BASE_IMAGE, **settings.e2b_templates})
        self._secret = _load_secret(settings)
        self.paused_ttl_s = settings.paused_ttl_s  # a paused sandbox lives this long

    # -- access tokens: "<sandbox id>.<key id>.<mac>", so envd calls route by token alone and
    # end with the key that got the token (a revoked key's tokens are refused at once) --
    def token(self, sandbox_id: str, key_id: str) -> str:
        msg = f"{sandbox_id}.{key_id}".encode()
        mac = hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:40]
        return f"{sandbox_id}.{key_id}.{mac}"

    def sandbox_of(self, token: str | None, sandbox_id: str | None) -> tuple[str, str]:
        """(sandbox, key id) a request may reach: the token must be the one issued for them.
        The caller checks the key is still active."""
        if not token:
            raise errors.Unauthorized("missing X-Access-Token")
        parts = token.rsplit(".", 2)
        sid, key_id = (parts[0], parts[1]) if len(parts) == 3 else ("", "")
        if sandbox_id and sandbox_id != sid:
            raise errors.Unauthorized("access token does not match E2b-Sandbox-Id")
        if not sid or not key_id or not hmac.compare_digest(self.token(sid, key_id), token):
            raise errors.Unauthorized("invalid access token")
        return sid, key_id

    def image_of(self, template: str) -> str:
        return self.templates.get(template, template)


def pid_of(exec_id: str) -> int:
    m = _EXEC_RE.match(exec_id)
    if m is None:
        raise errors.InfraError(f"unexpected exec id {exec_id!r}")
    return int(m[1]) + PID_BASE


def exec_of(pid: int) -> str:
    if pid < PID_BASE:
        raise errors.NotFound(f"process with pid {pid} not found")
    return f"e{pid - PID_BASE}"


def labels_of(metadata: dict[str, str], template: str) -> dict[str, str]:
    labels = {TEMPLATE_LABEL: template[:256]}
    for k, v in metadata.items():
        key = META_PREFIX + k
        if not isinstance(v, str) or not LABEL_RE.match(key) or len(v) > 256:
            raise errors.BadRequest(
                f"metadata key {k!r} not supported (at most {63 - len(META_PREFIX)} of "
                "[A-Za-z0-9_.-/], values at most 256 characters)")
        labels[key] = v
    return labels


def metadata_of(info: SandboxInfo) -> dict[str, str]:
    return {k[len(META_PREFIX):]: v for k, v in info.labels.items() if k.startswith(META_PREFIX)}


def user_of(name: str | None) -> str:
    if not name or name == E2B_USER:
        return _default_user.get()
    return name


def abs_path(path: str) -> str:
    """envd resolves relative paths against the user's home."""
    if not path:
        raise errors.BadRequest("path is required")
    if path.startswith("/"):
        return path
    if path == "~" or path.startswith("~/"):
        path = path[2:]
    return f"{home()}/{path}" if path else home()


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def now() -> float:
    return time.time()
