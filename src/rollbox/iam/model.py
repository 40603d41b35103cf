"""The IAM's interface: nested projects, who may do what, the quota ledger's protocol, and the
rules both stores share (names, delegation, reservation checks) as pure functions.

Projects are named by their path: ``a/b/c`` is a child of ``a/b``, which is a child of ``a``;
top-level projects hang under the root (the operator). A key belongs to one project (its
sandboxes are that project's) and may administer a subtree (:attr:`Principal.scope`): a project
admin key of ``a/b`` administers ``a/b`` and everything below it, never ``a`` or a sibling; the
operator's admin key (``scope == ""``) administers everything (``Principal.admin``).

Delegation rule (for each of ``sandboxes``, ``cpus``, ``memory_mib``; None = unlimited): for
every project P with a limit L(P),

    own_use(P) + sum(L(C) for each child C of P)  <=  L(P)

where own_use(P) counts the sandboxes of P itself (not of its children) in the ledger, live
reservations included. So a child's limit is carved out of its parent's: what P delegates is
no longer P's to use, whether the child uses it or not, and P can never delegate more than it
holds. A child of a project that limits a field must have a limit on it too (a child created
with no quota under a limited parent gets 0 there: it holds nothing until given some); a
limit may not be set below what the project has delegated plus what it uses. Top-level
projects are bounded only by what the operator sets. ``layer_mib`` (a project's own image
layers, per node) is not carved: a child's is at most its parent's.

A reservation of ``need`` in P is granted when own_use(P) + carved(P) + need <= L(P), and, for P
and each ancestor A, subtree_use(A) + need <= L(A) (which the rule above already implies; it is
checked anyway, for limits lowered by the operator or migrated from flat quotas).

Owns no storage: ``iam.keys`` (SQLite) and ``iam.postgres`` (PostgreSQL) implement
:class:`IamStore` and :class:`QuotaLedger` (each closed by whoever made it: not part of the
protocols); errors name only the caller's own project.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from rollbox import errors
from rollbox.models import NodeSandbox, Quota, Resources, SandboxInfo

# One path segment; a name is segments joined by "/", at most MAX_NAME chars.
SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
MAX_NAME = 128
LIMITED = ("sandboxes", "cpus", "memory_mib")  # carved out of the parent's, ledger-enforced
EPS = 1e-9
# A reservation not renewed for this long is gone (its api replica stopped renewing it).
RESERVATION_TTL_S = 5.0
# Reconcile leaves entries committed this recently alone (the live sets it is given may be
# older than them) and does not charge again a sandbox released this recently (a live set
# taken before its delete).
RECONCILE_GRACE_S = 3.0
TOMBSTONE_S = 60.0
PLATFORM_LABEL_PREFIX = "rollbox."  # graders, fncall workers: not charged to a project


# Names the flat IAM accepted (projects of keys made on the host); looked-up names must match.
PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$")


def check_lookup(name: str) -> str:
    """BadRequest for a name no project can have (a lookup: old names allowed)."""
    if not PROJECT_RE.match(name):
        raise errors.BadRequest(f"invalid project name {name[:140]!r}", field="project")
    return name


def check_name(name: object) -> str:
    """BadRequest unless ``name`` is segments of [A-Za-z0-9_.-] (starting alphanumeric)
    joined by "/", at most 128 chars."""
    if (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME
            or not all(SEGMENT_RE.match(s) for s in name.split("/"))):
        raise errors.BadRequest(f"invalid project name {str(name)[:140]!r}: segments of "
                                "letters, digits, '_', '.', '-' joined by '/'", field="name")
    return name


def parent_of(name: str) -> str | None:
    """``"a/b/c" -> "a/b"``; a top-level project's parent is the root (None)."""
    return name.rsplit("/", 1)[0] if "/" in name else None


def ancestors(name: str) -> list[str]:
    """Strict ancestors, root-first: ``"a/b/c" -> ["a", "a/b"]``."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def in_subtree(name: str, root: str | None) -> bool:
    """Whether ``name`` is ``root`` or below it (``root == ""``: everything; None: nothing)."""
    if root is None:
        return False
    return root == "" or name == root or name.startswith(root + "/")


@dataclass(frozen=True)
class Principal:
    """Who calls. ``scope``: the subtree the key administers ("" = everything, None = none);
    ``admin`` is the operator's (everything), as before nested projects."""

    project: str
    admin: bool
    key_id: str
    scope: str | None = None

    def administers(self, project: str) -> bool:
        return self.admin or in_subtree(project, self.scope)


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    display: str  # e.g. "rbx_AbCdEfGh..." - not a secret
    project: str
    admin: bool  # administers its project's subtree (or everything: scope "")
    created_at: float
    revoked: bool
    revoked_at: float | None = None
    last_used_at: float | None = None
    scope: str | None = None


@dataclass
class Usage:
    """What sandboxes hold or ask: a count and the sums of requested CPUs and memory."""

    sandboxes: int = 0
    cpus: float = 0.0
    memory_mib: int = 0

    @classmethod
    def of(cls, r: Resources) -> Usage:
        return cls(1, r.cpus, r.memory_mib)

    def get(self, name: str) -> float:
        return float(getattr(self, name))


@dataclass(frozen=True)
class ProjectInfo:
    """A project as a lister sees it: its limits, what its subtree uses and what it has
    delegated to its children (sums of their limits)."""

    name: str
    parent: str | None
    quota: Quota
    used: Usage = field(default_factory=Usage)
    own_used: Usage = field(default_factory=Usage)
    delegated: Usage = field(default_factory=Usage)
    created_at: float = 0.0


@dataclass(frozen=True)
class Reservation:
    """Room held in a project's quota for one sandbox being created."""

    id: str
    project: str
    need: Usage
    expires_at: float


@dataclass(frozen=True)
class LiveSandbox:
    """A sandbox an edge runs, as the ledger is reconciled from (the watcher's view)."""

    id: str
    project: str
    cpus: float
    memory_mib: int


def _charged(owner: str, labels: Mapping[str, str]) -> bool:
    """A project's sandbox: the platform's own (graders, fncall workers: labels ``rollbox.*``,
    which a project's sandbox can not have) are never charged."""
    return bool(owner) and not any(k.startswith(PLATFORM_LABEL_PREFIX) for k in labels)


def live_sandboxes(infos: Iterable[SandboxInfo]) -> list[LiveSandbox]:
    """The charged sandboxes of an edge's list (``EdgeAPI.list(None, {})``)."""
    return [LiveSandbox(i.id, i.owner, i.resources.cpus, i.resources.memory_mib)
            for i in infos if _charged(i.owner, i.labels)]


def charged(sandboxes: Iterable[LiveSandbox | NodeSandbox]) -> list[LiveSandbox]:
    """What reconcile charges of a live set: a :class:`LiveSandbox` as given, a watcher's
    :class:`rollbox.models.NodeSandbox` (an edge report's) unless it is the platform's
    (``NodeSandbox.platform``: the edge found a ``rollbox.*`` label on it)."""
    out = []
    for s in sandboxes:
        if isinstance(s, LiveSandbox):
            out.append(s)
        elif s.owner and not s.platform:
            out.append(LiveSandbox(s.id, s.owner, s.cpus, s.memory_mib))
    return out


class IamStore(Protocol):
    """Projects, keys and quotas. Every method taking ``who`` checks that the caller may:
    Forbidden for a project outside what it administers (whether or not it exists: the
    error says nothing of other projects), NotFound for one inside that does not exist,
    BadRequest for bad names and quotas; nothing is written when it raises."""

    async def authenticate(self, key: str | None) -> Principal:
        """The key's principal; Unauthorized if missing, malformed, unknown or revoked."""
        ...

    async def key_active(self, key_id: str) -> None:
        """Unauthorized unless ``key_id`` is a key not revoked (read at every use)."""
        ...

    async def create_project(self, who: Principal, name: str,
                             quota: Quota | None = None) -> ProjectInfo:
        """Create ``name`` (its parent must exist and be administered by ``who``; a
        top-level project needs the operator) with ``quota`` carved out of the parent's."""
        ...

    async def projects(self, who: Principal) -> list[ProjectInfo]:
        """The caller's subtree (a plain key: its own project), by name."""
        ...

    async def project_names(self) -> list[str]:
        """Every project's name (the api's own checks: image names under a project's)."""
        ...

    async def get_quota(self, who: Principal, project: str) -> Quota:
        """A project's limits: its own project for any key, its subtree for an admin."""
        ...

    async def set_quota(self, who: Principal, project: str, quota: Quota) -> Quota:
        """Replace a project's limits (an admin of a project above it, or the operator),
        under the delegation rule."""
        ...

    async def create_key(self, who: Principal, project: str, admin: bool = False,
                         fmt: Literal["rollbox", "e2b"] = "rollbox") -> tuple[str, KeyInfo]:
        """A new key of ``project`` (administered by ``who``): (plaintext, once; its info).
        ``admin``: it administers ``project``'s subtree; ``fmt`` "e2b": in E2B's own form
        (``e2b_`` + hex), for E2B SDKs that check the form."""
        ...

    async def list_keys(self, who: Principal, project: str | None = None) -> list[KeyInfo]:
        """Keys of the caller's subtree (or of ``project`` in it); needs an admin key."""
        ...

    async def revoke_key(self, who: Principal, key_id: str) -> None:
        """Revoke a key of the caller's subtree (NotFound for any other; Forbidden for a
        plain key)."""
        ...

    def get(self, project: str) -> Quota:
        """A project's own limits, answered from a cache (the edge's per-node admission
        asks on every create: ``edge.admission.ProjectQuotas``)."""
        ...


class QuotaLedger(Protocol):
    """The cluster-wide quota ledger: one entry per sandbox (reserved while it is created,
    committed once its edge made it), shared by every api replica. All checks of a reserve
    run in one transaction (SQLite: BEGIN IMMEDIATE; PostgreSQL: the rows of the project
    and its ancestors locked, root first), so racing replicas never exceed a quota."""

    async def reserve(self, project: str, need: Usage) -> Reservation:
        """Hold ``need`` in ``project`` and every ancestor (the module's rule), or raise
        QuotaExceeded naming only ``project``. Expires RESERVATION_TTL_S after the last
        renew unless committed."""
        ...

    async def reserve_many(self, project: str, need: Usage, n: int) -> list[Reservation]:
        """``n`` reservations of ``need`` each (a fork's children), checked together in the
        one transaction of :meth:`reserve` (``n`` times ``need`` must fit) and written in
        it: all ``n`` or none (QuotaExceeded, nothing held)."""
        ...

    async def renew(self, reservation: Reservation) -> None:
        """Keep a reservation alive while its create runs (a gone one is not an error:
        commit charges the sandbox anyway)."""
        ...

    async def commit(self, reservation: Reservation, sandbox_id: str, node: str) -> None:
        """The edge made ``sandbox_id``: the reservation becomes its entry (charged even if
        the reservation expired meanwhile)."""
        ...

    async def cancel(self, reservation: Reservation) -> None:
        """The create failed: drop the reservation."""
        ...

    async def release(self, sandbox_id: str) -> bool:
        """The sandbox ended: its entry goes (False if there was none)."""
        ...

    async def reconcile(self, live: Mapping[str, Collection[LiveSandbox | NodeSandbox]],
                        complete_nodes: Collection[str]) -> int:
        """Make the ledger equal what the edges run. ``live``: node id -> the
        :class:`LiveSandbox` of every project sandbox it runs (its id, project, requested
        cpus and memory_mib; :func:`live_sandboxes` makes them of an edge's list), or the
        watcher's ``NodeSandbox`` of the node's report (platform sandboxes, ``platform``:
        labels ``rollbox.*``, are left out: :func:`charged`); a dead node maps to none; only
        the nodes in ``complete_nodes`` are authoritative (their whole set was read). It
        releases entries of a complete node whose sandbox is not in its set (but not ones
        committed in the last RECONCILE_GRACE_S), drops reservations past their expiry,
        and charges a live sandbox (of any node given) the ledger lacks, unless it was
        released in the last TOMBSTONE_S. Returns the number of entries changed."""
        ...

    async def usage(self, project: str, subtree: bool = True) -> Usage:
        """What ``project`` (and, with ``subtree``, its descendants) holds now."""
        ...


# ---- rules shared by the stores (pure) -------------------------------------------------
def quota_fields(q: Quota) -> dict[str, float | None]:
    return {f: getattr(q, f) for f in (*LIMITED, "layer_mib")}


def check_values(q: Quota) -> Quota:
    """BadRequest for a negative limit (the model forbids them too; a store checks anyway)."""
    for name, value in quota_fields(q).items():
        if value is not None and value < 0:
            raise errors.BadRequest(f"quota {name} must be >= 0, got {value}", field=name)
    return q


def default_child_quota(parent: Quota) -> Quota:
    """What a sub-project created with no quota gets: 0 of each limit its parent has."""
    return Quota(**{f: (0 if v is not None else None) for f, v in quota_fields(parent).items()})


def check_delegation(project: str, quota: Quota, parent: Quota | None,
                     siblings: Sequence[Quota], parent_own: Usage,
                     children: Sequence[Quota], own: Usage) -> None:
    """BadRequest unless ``quota`` for ``project`` keeps the delegation rule: with its
    parent's limits (None: a top-level project), the limits of its parent's other children,
    what the parent itself uses, the limits of its own children and what it uses itself."""
    check_values(quota)
    for name in LIMITED:
        mine = getattr(quota, name)
        cap = getattr(parent, name) if parent is not None else None
        if cap is not None:
            if mine is None:
                raise errors.BadRequest(f"quota {name}: the parent project limits {name}, so "
                                        f"{project!r} needs a limit too", field=name)
            given = sum(float(getattr(s, name) or 0) for s in siblings)
            free = cap - given - parent_own.get(name)
            if mine > free + EPS:
                raise errors.BadRequest(
                    f"quota {name}={mine:g} for {project!r} is above what its parent has left "
                    f"to delegate ({max(free, 0):g})", field=name, available=max(free, 0))
        if mine is not None:
            held = own.get(name)
            for c in children:
                v = getattr(c, name)
                if v is None:
                    raise errors.BadRequest(f"quota {name}: a sub-project of {project!r} has "
                                            f"no limit on {name}; limit it first", field=name)
                held += float(v)
            if held > mine + EPS:
                raise errors.BadRequest(
                    f"quota {name}={mine:g} for {project!r} is below what it has delegated "
                    f"and uses ({held:g})", field=name, held=held)
    cap = parent.layer_mib if parent is not None else None
    if cap is not None and (quota.layer_mib is None or quota.layer_mib > cap):
        raise errors.BadRequest(f"quota layer_mib for {project!r} must be at most its "
                                f"parent's ({cap})", field="layer_mib", available=cap)


@dataclass(frozen=True)
class ChainLink:
    """One project of a reserve's chain (the project and its ancestors) as the store read it
    inside the transaction."""

    name: str
    quota: Quota
    subtree_used: Usage


def check_reserve(project: str, need: Usage, chain: Sequence[ChainLink], own: Usage,
                  carved: Usage) -> None:
    """QuotaExceeded unless ``need`` fits ``project`` (the module's rule). ``chain``: the
    project's ancestors and itself; ``own``: what the project itself holds; ``carved``: the
    sums of its children's limits. The error names ``project`` alone (an ancestor's name or
    limit is not the caller's to know)."""
    for link in chain:
        for name in LIMITED:
            cap = getattr(link.quota, name)
            if cap is None:
                continue
            add = need.get(name)
            if link.name == project:
                have = own.get(name) + carved.get(name)
                if have + add > cap + EPS:
                    raise errors.QuotaExceeded(
                        f"project {project!r} quota: {name} {own.get(name):g} used + "
                        f"{carved.get(name):g} delegated + {add:g} > {cap:g}",
                        project=project, field=name, limit=cap)
            if link.subtree_used.get(name) + add > cap + EPS:
                if link.name == project:
                    raise errors.QuotaExceeded(
                        f"project {project!r} quota: {name} {link.subtree_used.get(name):g} "
                        f"used with its sub-projects + {add:g} > {cap:g}",
                        project=project, field=name, limit=cap)
                raise errors.QuotaExceeded(
                    f"project {project!r}: {name} is at the limit of a project above it",
                    project=project, field=name)


