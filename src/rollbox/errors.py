"""Typed errors shared by every rollbox component, the HTTP API and the SDK.

Each error has a stable ``code`` (the JSON ``error.code`` on the wire), an HTTP status and a
``retryable`` flag. The API turns any RollboxError into ``{"error": {...}}``; the SDK turns that
JSON back into the same class with :func:`error_from_payload` (:data:`ERRORS_BY_CODE`);
:func:`without_paths` is an error as a client may see it, with host paths renamed. Owns nothing
else, imports nothing of rollbox: every layer may raise these.

The tree (class, wire code, HTTP status, ``R`` = retryable: when it is raised)::

    RollboxError                 internal               500    a fault the api did not expect
    ├── BadRequest               bad_request            400    malformed or invalid input
    │   ├── DiskFull             bad_request            400    the sandbox's disk/inodes are full
    │   └── IdempotencyConflict  idempotency_conflict   400    exec/create key reused, other spec
    ├── Unauthorized             unauthorized           401    no key, or unknown or revoked
    │   ├── PortTokenInvalid     port_token_invalid     401    port token forged, expired, other
    │   └── ViewTokenInvalid     view_token_invalid     401    live view: no/forged/expired/used
    ├── Forbidden                forbidden              403    a key that may not (admin routes)
    ├── NotFound                 not_found              404    no such sandbox/image/exec/file/job
    ├── CommandTimeout           command_timeout        408    SDK: exec(check=True) timed out
    ├── SandboxPaused            sandbox_paused         409    exec in a paused sandbox
    ├── HostResourceConflict     host_resource_conflict 409    edge start: another edge holds it
    ├── DisplayLocked            display_locked         409    a person took over mouse/keyboard
    ├── SandboxDead              sandbox_dead           410    deleted, expired, OOM-killed, lost
    ├── PayloadTooLarge          payload_too_large      413    a body/file/tar/diff over its cap
    ├── QuotaExceeded            quota_exceeded         429    the project's quota says no
    ├── CommandFailed            command_failed         500    SDK: exec(check=True), exit != 0
    ├── NotSupported             not_supported          501    compat: a peer's feature we lack
    ├── HashMismatch             hash_mismatch          502    mirror: upstream sha256 is wrong
    ├── PortNotListening         port_not_listening     502    port proxy: nothing listens there
    └── InfraError               infrastructure         503 R  a platform fault: retry (elsewhere)
        ├── CapacityExceeded     capacity               503 R  admission: node/cluster full
        ├── ChunkStoreError      chunk_store            503 R  the image chunk store failed
        │   ├── ChunkMissing     chunk_missing          503 R  a manifest's chunk is not stored
        │   ├── ChunkCorrupt     chunk_corrupt          503 R  a chunk or manifest fails checks
        │   └── StoreUnreachable store_unreachable      503 R  the store refused or is away
        ├── NodeCacheFull        cache_full             503 R  lazy-load cache full, none evictable
        ├── ServerUnreachable    unreachable            503 R  SDK: the request never got there
        ├── ConnectionLost       connection_lost        503 R  SDK: broke after it was sent
        ├── EdgeUnreachable      edge_unreachable       503 R  api: a node's edge refused/away
        ├── ExecIndeterminate    exec_indeterminate     503    an exec may or may not have run
        ├── AgentProtocolError   agent_protocol         503    the in-sandbox agent broke the wire
        ├── UpstreamUnavailable  upstream_unavailable   503 R  mirror: upstream down, none cached
        ├── UpstreamBadResponse  upstream_bad_response  502 R  mirror: upstream answer unusable
        └── UpstreamTooLarge     upstream_too_large     502    mirror: file larger than the cache

``CommandFailed``, ``CommandTimeout``, ``ServerUnreachable`` and ``ConnectionLost`` are raised
by the SDK itself, never sent by the api (``ConnectionLost`` also by ``edge.remote`` when the api's
request to a node's edge broke after it was sent; ``EdgeUnreachable`` when it never got there);
``ExecIndeterminate`` by both (the SDK's re-checks ran out; the edge lost a command across a
restart). ``DiskFull`` travels as ``bad_request`` (``details.reason == "disk_full"``) and comes
back as ``BadRequest`` (``edge.remote`` rebuilds it as ``DiskFull``). The mirror's errors answer
pip (``rollbox.netpolicy.mirror``), not the api. Components raise subclasses without a code of
their own (``agent.channel.SpawnError``: bad_request; ``backends.microvm``'s ``QMPError`` and
``TemplateLoadError``: infrastructure): a client sees their parent. Every error with a code of
its own is defined here; all but ``CommandFailed`` (it carries a result) and ``DiskFull`` are in
:data:`ERRORS_BY_CODE` (tests/unit/test_errors_tree.py checks the tree against the classes).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: models import nothing of errors, nor errors of models
    from rollbox.models import ExecResult


class RollboxError(Exception):
    code = "internal"
    status = 500
    retryable = False
    # The api request this error answered (its ``X-Request-Id``; the api's error body repeats
    # it as ``error.request_id``): set by the SDK on every error it raises for a request,
    # and what the api's and the edge's log lines name (rollbox.trace). None elsewhere.
    request_id: str | None = None

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_payload(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "retryable": self.retryable,
                "details": self.details,
            }
        }


class BadRequest(RollboxError):
    """The request is malformed or names something invalid (bad resources, bad path...)."""

    code = "bad_request"
    status = 400


class DiskFull(BadRequest):
    """The sandbox's writable layer (or inode budget) is full. Keeps the ``bad_request`` wire
    code so older SDKs still map it; ``details.reason == "disk_full"`` tells it apart."""

    def __init__(self, message: str = "sandbox disk full", **details: Any) -> None:
        details.setdefault("reason", "disk_full")
        super().__init__(message, **details)


class IdempotencyConflict(BadRequest):
    """An idempotency key was reused with a different command (exec) or spec (create)."""

    code = "idempotency_conflict"


class Unauthorized(RollboxError):
    code = "unauthorized"
    status = 401


class PortTokenInvalid(Unauthorized):
    """The port proxy (rollbox.api.ports): a port token that is forged, expired, or made for
    another sandbox or port (``details.reason``: forged | expired | malformed)."""

    code = "port_token_invalid"


class ViewTokenInvalid(Unauthorized):
    """The live view (rollbox.api.liveview): no view cookie, or a code or token that is
    forged, expired, already used or made for another sandbox (``details.reason``)."""

    code = "view_token_invalid"


class Forbidden(RollboxError):
    """A valid key that may not do this (e.g. an admin-only route with a project key)."""

    code = "forbidden"
    status = 403


class NotFound(RollboxError):
    """Unknown sandbox, image, exec session or file."""

    code = "not_found"
    status = 404


class PayloadTooLarge(RollboxError):
    code = "payload_too_large"
    status = 413


class QuotaExceeded(RollboxError):
    """The caller's project quota does not allow this; retrying will not help by itself."""

    code = "quota_exceeded"
    status = 429


class SandboxDead(RollboxError):
    """The sandbox is gone (deleted, expired, OOM-killed, node lost)."""

    code = "sandbox_dead"
    status = 410


class SandboxPaused(RollboxError):
    """The sandbox is paused (frozen): nothing can run in it until it is resumed. Host-side
    operations (files, TTL, network, snapshot, delete) still work on a paused sandbox."""

    code = "sandbox_paused"
    status = 409


class CommandTimeout(RollboxError):
    """Raised by the SDK only when the caller asks exec to raise on timeout."""

    code = "command_timeout"
    status = 408


class CommandFailed(RollboxError):
    """``exec(..., check=True)`` and the command exited non-zero (or by a signal). Raised by
    the SDK from the result, which it carries (``result``)."""

    code = "command_failed"
    status = 500

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message, exit_code=result.exit_code, signal=result.signal)
        self.result = result


class HashMismatch(RollboxError):
    """The PyPI mirror: the upstream's bytes do not have the sha256 its index announced;
    nothing was kept."""

    code = "hash_mismatch"
    status = 502


class PortNotListening(RollboxError):
    """The port proxy: nothing listens on that port on the sandbox's own loopback (its
    127.0.0.1 or 0.0.0.0); ``details.port``."""

    code = "port_not_listening"
    status = 502


class InfraError(RollboxError):
    """A fault of the platform, not of the request; safe to retry (maybe on another node)."""

    code = "infrastructure"
    status = 503
    retryable = True


class HostResourceConflict(RollboxError):
    """An edge asked for a host resource another live edge of this host holds (its node id,
    data or run dir, cgroup parent, host uid band or sandbox subnet): it does not start.
    ``details``: ``resource`` (what), ``holder`` (the other edge's node id). Not retryable:
    the settings must change (``Settings.for_node`` gives co-hosted edges disjoint ones)."""

    code = "host_resource_conflict"
    status = 409


class CapacityExceeded(InfraError):
    """The node (or cluster) is full; admission control refused. Retry later or elsewhere."""

    code = "capacity"
    status = 503
    retryable = True


class ChunkStoreError(InfraError):
    """The image chunk store failed (see rollbox.images.chunks); retry, maybe another replica."""

    code = "chunk_store"
    status = 503
    retryable = True


class ChunkMissing(ChunkStoreError):
    """A chunk named by a layer manifest is not in the store (pruned, partial push)."""

    code = "chunk_missing"


class ChunkCorrupt(ChunkStoreError):
    """A chunk or manifest failed verification (hash, size or decompression)."""

    code = "chunk_corrupt"


class StoreUnreachable(ChunkStoreError):
    """The chunk store could not be reached or refused the request."""

    code = "store_unreachable"


class NodeCacheFull(InfraError):
    """The node's chunk cache (lazy loading) is full and nothing can be evicted; retry later
    or on another node."""

    code = "cache_full"
    status = 503
    retryable = True


class ServerUnreachable(InfraError):
    """The SDK could not reach the server: the request was certainly not processed."""

    code = "unreachable"


class ConnectionLost(InfraError):
    """The connection broke after the request was sent: it may or may not have been processed
    (the SDK retries what is safe to retry, on another API URL when it has several: reads, and
    creates and exec starts with an idempotency key)."""

    code = "connection_lost"


class EdgeUnreachable(InfraError):
    """A node's edge could not be reached over HTTP (``edge.remote``: connection refused or
    reset, no answer within the connect timeout): the request certainly never got to it. Retry,
    maybe on another node; the watcher decides whether the node is lost."""

    code = "edge_unreachable"


class ExecIndeterminate(InfraError):
    """An exec may or may not have run: the connection broke after the start was sent and the
    outcome could not be re-checked (the server stayed unreachable past the SDK's reconnect
    window, or the edge lost the command across a restart). Not retryable blindly: re-check
    with the same ``idempotency_key`` (in ``details``) instead of starting it again."""

    code = "exec_indeterminate"
    retryable = False


class AgentProtocolError(InfraError):
    """The in-sandbox agent broke the wire protocol (garbage, an oversized or truncated frame,
    output past the bounds the edge asked for): the edge closed the channel. From a microVM
    this is the guest's doing (its root owns the agent); retrying the same sandbox won't help."""

    code = "agent_protocol"
    retryable = False


class UpstreamUnavailable(InfraError):
    """The PyPI mirror: the upstream could not be reached (or failed) and nothing usable is
    cached. Retry."""

    code = "upstream_unavailable"
    status = 503


class UpstreamBadResponse(InfraError):
    """The PyPI mirror: the upstream answered with something the mirror can not use (bad
    status, bad page, redirect off the allowed hosts)."""

    code = "upstream_bad_response"
    status = 502


class UpstreamTooLarge(InfraError):
    """The PyPI mirror: the upstream file is larger than the whole cache may hold."""

    code = "upstream_too_large"
    status = 502
    retryable = False


class DisplayLocked(RollboxError):
    """A person took over the sandbox's screen at its live view: the computer-use input
    routes refuse until they release it (screenshots still work)."""

    code = "display_locked"
    status = 409


class NotSupported(RollboxError):
    """A peer's feature rollbox does not offer (a compat front door: an E2B route or option);
    the message names the feature. Not retryable: the same request fails the same way."""

    code = "not_supported"
    status = 501


ERRORS_BY_CODE: dict[str, type[RollboxError]] = {
    cls.code: cls
    for cls in (
        RollboxError,
        BadRequest,
        IdempotencyConflict,
        Unauthorized,
        PortTokenInvalid,
        ViewTokenInvalid,
        Forbidden,
        NotFound,
        PayloadTooLarge,
        QuotaExceeded,
        SandboxDead,
        SandboxPaused,
        DisplayLocked,
        CommandTimeout,
        InfraError,
        CapacityExceeded,
        HostResourceConflict,
        ChunkStoreError,
        ChunkMissing,
        ChunkCorrupt,
        StoreUnreachable,
        NodeCacheFull,
        ServerUnreachable,
        ConnectionLost,
        EdgeUnreachable,
        ExecIndeterminate,
        AgentProtocolError,
        HashMismatch,
        PortNotListening,
        NotSupported,
        UpstreamUnavailable,
        UpstreamBadResponse,
        UpstreamTooLarge,
    )
}


def error_from_payload(payload: Any, status: int = 500) -> RollboxError:
    """Rebuild a typed error from the API's JSON body (falls back on the HTTP status)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        cls: type[RollboxError] = InfraError if status >= 500 else RollboxError
        return cls(f"HTTP {status}: {str(payload)[:200]}")
    cls = ERRORS_BY_CODE.get(str(err.get("code")), RollboxError)
    exc = cls(str(err.get("message", "")), **(err.get("details") or {}))
    if isinstance(err.get("request_id"), str):
        exc.request_id = err["request_id"][:64]
    return exc


def without_paths(exc: RollboxError, trees: dict[Path, str]) -> RollboxError:
    """``exc`` as the client may see it: each host directory of ``trees`` (the staging dir of
    an upload or snapshot, a sandbox's upper, named in messages of mkfs.erofs, git or an
    OSError) shown as the given name instead ("/" for the image's root)."""
    message = exc.message
    for path, shown in sorted(trees.items(), key=lambda t: -len(str(t[0]))):  # longest first
        message = message.replace(f"{path}/", shown.rstrip("/") + "/").replace(str(path), shown)
    if message == exc.message:
        return exc
    return type(exc)(message or "failed", **exc.details)

