"""Claims of host resources by the edges of one host: who holds which node id, data and run
dir, cgroup parent, host uid band and sandbox subnet.

Several edges may run on one host (tests, demos, ``rollbox cluster`` on one machine; docs/
cluster.md). Each one, as it starts, claims the host resources its settings name
(:func:`claim`): under ``<host_dir>/claims`` it writes ``<node_id>.claim`` (JSON: what it
holds and its pid) and keeps an exclusive flock on that file for as long as it runs (the lock
goes with the process, however it ends: a file no one holds locked is a dead edge's, removed
by the next claimer). A claim is refused with :class:`~rollbox.errors.HostResourceConflict`
when a live edge holds

- the same node id (sandbox ids, netns names ``rollbox-<node>-*``, host link aliases and the
  journal all derive from it; every "remove leftovers" sweep of an edge is scoped to it),
- the same data or run dir, or one inside or around it (either way),
- the same cgroup parent, or one inside or around it,
- a host uid of the band (``Settings.uid_band``),
- an address of the sandbox subnet (``net_pool``).

With ``host_auto`` the claim picks the first free uid band (from ``uid_base`` up) and subnet
(of ``net_pool``'s size, in ``net_host_range``) and writes them into the settings; what it
took is kept in the data dir (``host-claim.json``) and asked for again when the same edge
restarts (its journaled sandboxes keep their host uids and addresses).

Owns the files under ``<host_dir>/claims`` and the data dir's ``host-claim.json``. Must not
touch any resource a claim names: it only records who holds what.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from rollbox.config import NODE_ID_RE, UID_BAND_EXTRA, UID_LIMIT, UID_RANGE, Settings
from rollbox.errors import BadRequest, HostResourceConflict
from rollbox.isolation import syscalls

SUFFIX = ".claim"
AUTO_FILE = "host-claim.json"


@dataclass(frozen=True)
class Holding:
    """What one edge holds (its claim file's content)."""
    node_id: str
    data_dir: str
    run_dir: str
    cgroup_parent: str
    uid_first: int
    uid_end: int
    net_pool: str
    net_host_range: str
    pid: int

    @classmethod
    def of(cls, settings: Settings) -> Holding:
        first, end = settings.uid_band
        return cls(settings.node_id, os.path.realpath(settings.data_dir),
                   os.path.realpath(settings.run_dir), settings.cgroup_parent.strip("/"),
                   first, end, str(settings.net_pool), str(settings.net_host_range), os.getpid())


def _nested(a: str, b: str) -> bool:
    """Whether path ``a`` is ``b`` or one is inside the other."""
    pa, pb = PurePosixPath(a), PurePosixPath(b)
    return pa == pb or pa.is_relative_to(pb) or pb.is_relative_to(pa)


def conflicts(mine: Holding, other: Holding) -> list[tuple[str, str]]:
    """(resource, what) of every host resource ``mine`` would share with ``other``."""
    out: list[tuple[str, str]] = []
    if mine.node_id == other.node_id:
        out.append(("node_id", f"node id {mine.node_id!r}"))
    for name, a in (("data_dir", mine.data_dir), ("run_dir", mine.run_dir)):
        for b in (other.data_dir, other.run_dir):
            if _nested(a, b):
                out.append((name, f"{name.replace('_', ' ')} {a} (and {b})"))
    if _nested(mine.cgroup_parent, other.cgroup_parent):
        out.append(("cgroup_parent", f"cgroup parent {mine.cgroup_parent!r} (and "
                                     f"{other.cgroup_parent!r})"))
    if mine.uid_first < other.uid_end and other.uid_first < mine.uid_end:
        out.append(("uid_band", f"host uids [{mine.uid_first}, {mine.uid_end}) (overlap "
                                f"[{other.uid_first}, {other.uid_end}))"))
    if ipaddress.IPv4Network(mine.net_pool).overlaps(ipaddress.IPv4Network(other.net_pool)):
        out.append(("net_pool", f"sandbox subnet {mine.net_pool} (overlaps {other.net_pool})"))
    return out


class HostClaim:
    """A live claim: the locked claim file of this edge. :meth:`release` when it stops."""

    def __init__(self, path: Path, fd: int, holding: Holding) -> None:
        self.path = path
        self._fd: int | None = fd
        self.holding = holding

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # still locked: no claimer reads it meanwhile
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def claims_dir(settings: Settings) -> Path:
    return settings.host_dir / "claims"


def live_holdings(directory: Path) -> list[Holding]:
    """The claims of live edges under ``directory``; dead edges' files are removed. Call
    with the directory's ``.lock`` held."""
    out = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: a live edge
                try:
                    out.append(Holding(**json.loads(os.read(fd, 1 << 16))))
                except (ValueError, TypeError):  # not ours to judge; it stays held
                    continue
            else:  # no one holds it: its edge is gone
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return out


def _check_settings(settings: Settings) -> None:
    if not NODE_ID_RE.fullmatch(settings.node_id):
        raise BadRequest(f"node id {settings.node_id!r}: 1-32 of A-Z a-z 0-9 _ . (no '-')")
    if not settings.net_pool.subnet_of(settings.net_host_range):
        raise BadRequest(f"node {settings.node_id}: net_pool {settings.net_pool} is not in "
                         f"net_host_range {settings.net_host_range}")
    if settings.uid_slots <= 0 or settings.uid_band[1] > UID_LIMIT - 1:
        raise BadRequest(f"node {settings.node_id}: uid band {settings.uid_band} is not "
                         "within host uids 0..2**32-2")


def _pick(settings: Settings, live: list[Holding]) -> None:
    """host_auto: the data dir's earlier choice, else the first free band and subnet."""
    kept = settings.data_dir / AUTO_FILE
    try:
        earlier = json.loads(kept.read_text())
        settings.uid_base = int(earlier["uid_base"])
        settings.net_pool = ipaddress.IPv4Network(earlier["net_pool"])
        return
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    stride = (settings.uid_slots + UID_BAND_EXTRA) * UID_RANGE
    base = settings.uid_base
    while True:
        if base + stride > UID_LIMIT - 1:
            raise HostResourceConflict(
                f"node {settings.node_id}: no free host uid band of {settings.uid_slots} "
                f"slots above {settings.uid_base}", resource="uid_band")
        if not any(base < o.uid_end and o.uid_first < base + stride for o in live):
            break
        base += stride
    taken = [ipaddress.IPv4Network(o.net_pool) for o in live]
    if settings.net_pool.prefixlen - settings.net_host_range.prefixlen > 12:
        raise BadRequest(f"node {settings.node_id}: net_pool {settings.net_pool} is too small "
                         f"a part of net_host_range {settings.net_host_range} to pick one "
                         "(at most 4096 subnets)")
    subnets = list(settings.net_host_range.subnets(new_prefix=settings.net_pool.prefixlen))
    start = subnets.index(settings.net_pool) if settings.net_pool in subnets else 0
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            break
    else:
        raise HostResourceConflict(
            f"node {settings.node_id}: no free /{settings.net_pool.prefixlen} subnet in "
            f"{settings.net_host_range}", resource="net_pool")
    settings.uid_base, settings.net_pool = base, net
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"uid_base": base, "net_pool": str(net)}))


def claim(settings: Settings) -> HostClaim:
    """Claim the host resources of the edge of ``settings`` (module docstring); with
    ``host_auto`` its uid band and subnet are chosen here and set in ``settings``.
    HostResourceConflict names the first resource a live edge holds; BadRequest for
    settings that name no valid resource."""
    _check_settings(settings)
    directory = claims_dir(settings)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with syscalls.flocked(directory / ".lock"):
        live = live_holdings(directory)
        if settings.host_auto:
            _pick(settings, [o for o in live if o.node_id != settings.node_id])
            _check_settings(settings)
        mine = Holding.of(settings)
        for other in live:
            found = conflicts(mine, other)
            if found:
                resource, what = found[0]
                raise HostResourceConflict(
                    f"node {mine.node_id} can not start: {what} is held by node "
                    f"{other.node_id} (pid {other.pid}) on this host",
                    resource=resource, holder=other.node_id,
                    conflicts=[r for r, _ in found])
        path = directory / f"{mine.node_id}{SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(asdict(mine)).encode())
        except BaseException:
            os.close(fd)
            raise
        return HostClaim(path, fd, mine)
