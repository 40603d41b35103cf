"""One sandbox's network: its link, its BPF allow map, its DNS gate and its current policy.

``attach`` brings it up (veth, programs on the cgroup, gate), ``apply`` changes the policy in
place (map updates only: effective for new and existing connections at once), ``adopt`` finds
it again after an edge restart, ``close`` stops the gate (the link goes with the sandbox's
teardown, the programs and map with its cgroup).

Addresses learned through the DNS gate stay allowed for the answer's TTL, bounded to
[MIN_TTL, MAX_TTL], so the allow-list of a long-lived sandbox does not grow forever. An expired
address that a socket of the sandbox still talks to is kept until that socket is gone (the
packet filter would otherwise cut a download in the middle).

``audit()`` counts what the policy refused: names the gate REFUSED, connects and sends the
BPF programs denied, packets they dropped (the programs' counter map; the gate's count starts
again when an edge restarts and re-adopts the sandbox, the BPF counters do not).
``audit_news()`` says what changed since its last call (the edge logs it as ``net.denied``,
at most once per sweep).
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from rollbox.config import Settings
from rollbox.isolation import cgroups
from rollbox.netpolicy import bpf, link
from rollbox.netpolicy.bpf import Entry
from rollbox.netpolicy.gate import DnsGate, upstream
from rollbox.netpolicy.policy import (
    Forbidden,
    Resolved,
    local_mirror_ports,
    parse_rules,
    resolve,
)

log = logging.getLogger(__name__)
RESOLV_CONF = "/etc/resolv.conf"
MIN_TTL = 30  # seconds a learned address stays allowed at least (short TTLs, retries)
MAX_TTL = 300
SWEEP_S = 5.0
# /proc/net/{tcp,udp} states with a peer still talking: ESTABLISHED .. CLOSING but TIME_WAIT,
# CLOSE and LISTEN (a connected UDP socket shows as ESTABLISHED).
_LIVE_STATES = {"01", "02", "03", "04", "05", "08", "09", "0B"}
_mirror_ports_added: set[int] = set()


class AllowList(Protocol):
    """Where a sandbox's allowed entries are enforced: its cgroup's BPF map (containers,
    bpf.AllowMap) or the nftables set at its guest's tap (microVMs, tapfilter.TapFilter)."""

    def add(self, entries: Iterable[Entry]) -> None: ...
    def remove(self, entries: Iterable[Entry]) -> None: ...
    def close(self) -> None: ...


class DropCounters(Protocol):
    """Refusals counted by the enforcement, under the names of bpf.COUNTERS."""

    @property
    def is_open(self) -> bool: ...
    def read(self) -> dict[str, int]: ...
    def close(self) -> None: ...


_running: dict[str, SandboxNetwork] = {}  # sandbox id -> the network whose gate runs here


def close_stale(sandbox_id: str, keep: SandboxNetwork | None = None) -> None:
    """An edge restarted in the same process (its predecessor closed without deleting its
    sandboxes) left this sandbox's gate bound and map open: the new edge's network replaces
    them, or, if it can not be re-attached, they must not keep the map alive."""
    stale = _running.get(sandbox_id)
    if stale is not None and stale is not keep:
        stale.close()


class SandboxNetwork:
    def __init__(self, sandbox_id: str, lnk: link.Link, allow_map: AllowList,
                 settings: Settings, cgroup_dir: Path | None = None,
                 counters: DropCounters | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.link = lnk
        self.map = allow_map
        self.counters = counters
        self._audit_logged: dict[str, int] = {}
        self.settings = settings
        self.cgroup_dir = cgroup_dir
        self.rules: list[str] = []
        self.resolved = Resolved()
        self.current: set[Entry] = set()
        # name -> address -> monotonic deadline after which it leaves the allow-list
        self.dns_ips: dict[str, dict[ipaddress.IPv4Address, float]] = {}
        self.forbidden = Forbidden.current(settings)
        self.gate: DnsGate | None = None
        self._sweeper: asyncio.Task | None = None  # type: ignore[type-arg]

    def audit(self) -> dict[str, int]:
        """Refusals so far: dns_refused, connect_denied (TCP/UDP connect, IPv4 and IPv6),
        sendmsg_denied (unconnected UDP sends), packets_dropped (in and out)."""
        c = dict.fromkeys(bpf.COUNTERS, 0)
        if self.counters is not None and self.counters.is_open:
            try:
                c = self.counters.read()
            except OSError as exc:  # the map went with a torn-down cgroup: last known
                log.debug("sandbox %s: reading counters failed: %s", self.sandbox_id, exc)
                return dict(self._audit_logged) or self._zero_audit()
        return {"dns_refused": self.gate.refused_count if self.gate is not None else 0,
                "connect_denied": c["connect4"] + c["connect6"],
                "sendmsg_denied": c["sendmsg4"] + c["sendmsg6"],
                "packets_dropped": c["egress"] + c["ingress"]}

    @staticmethod
    def _zero_audit() -> dict[str, int]:
        return {"dns_refused": 0, "connect_denied": 0, "sendmsg_denied": 0,
                "packets_dropped": 0}

    def audit_news(self) -> dict[str, object] | None:
        """{"total", "new" (increase since the last call), "names" (the names refused since
        then, up to the gate's last 64)} if anything was refused since the last call."""
        now = self.audit()
        before = self._audit_logged or self._zero_audit()
        delta = {k: max(0, v - before.get(k, 0)) for k, v in now.items()}
        self._audit_logged = now
        if not any(delta.values()):
            return None
        names = self.gate.refused[-delta["dns_refused"]:] if (
            self.gate is not None and delta["dns_refused"]) else []
        return {"total": now, "new": delta, "names": names}

    @property
    def env(self) -> dict[str, str]:
        return dict(self.resolved.env)

    def resolv_conf(self) -> bytes:
        return f"nameserver {self.link.gate_ip}\noptions timeout:2 attempts:2\n".encode()

    def _desired(self) -> set[Entry]:
        want = set(self.resolved.entries)
        for name, learned in self.dns_ips.items():
            ips = list(learned)
            for proto, port in self.resolved.name_ports(name):
                for ip in ips:
                    want.add(Entry(proto, port, ipaddress.IPv4Network(ip)))
        return want

    def _sync(self) -> None:
        want = self._desired()
        self.map.remove(self.current - want)
        self.map.add(want - self.current)
        self.current = want

    def apply(self, rules: list[str], sync: bool = True) -> dict[str, str]:
        """Replace the policy (validated first: a bad rule changes nothing); returns the env.
        sync=False: resolve only (the caller syncs the map)."""
        parsed = parse_rules(rules)
        self.forbidden = Forbidden.current(self.settings)
        resolved = resolve(parsed, self.link.gate_ip, self.settings, self.forbidden)
        ports = local_mirror_ports(resolved, self.link.gate_ip) - _mirror_ports_added
        if ports:
            link.allow_local_mirror_ports(ports, self.settings)
            _mirror_ports_added.update(ports)
        self.resolved = resolved
        self.rules = list(rules)
        if sync:
            self._sync()
        return self.env

    # DNS gate callbacks
    def _allowed(self, qname: str) -> bool:
        return bool(self.resolved.name_ports(qname))

    def _admit(self, qname: str, addrs: list[ipaddress.IPv4Address],
               ttl: int) -> tuple[list[ipaddress.IPv4Address], int]:
        ok = []
        ports = self.resolved.name_ports(qname)
        for a in addrs:
            net = ipaddress.IPv4Network(a)
            if all(self.forbidden.cut(net, port) for _, port in ports):
                ok.append(a)
        keep = max(MIN_TTL, min(ttl, MAX_TTL))
        if ok:
            deadline = time.monotonic() + keep
            learned = self.dns_ips.setdefault(qname, {})
            for a in ok:
                learned[a] = max(learned.get(a, 0.0), deadline)
        self.expire()  # syncs the map
        return ok, keep

    def in_use(self) -> set[ipaddress.IPv4Address]:
        """Remote IPv4 addresses of the sandbox's TCP/UDP sockets (its netns, seen through a
        process of its cgroup)."""
        if self.cgroup_dir is None:
            return set()
        pids = cgroups.procs(self.cgroup_dir)
        out: set[ipaddress.IPv4Address] = set()
        for table in ("tcp", "udp"):
            for pid in pids[:1]:
                try:
                    lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
                except OSError:
                    continue
                for line in lines:
                    fields = line.split()
                    if fields[3] not in _LIVE_STATES:
                        continue  # listening, unconnected, TIME_WAIT: no traffic to keep
                    remote = fields[2].split(":")[0]
                    ip = ipaddress.IPv4Address(bytes.fromhex(remote)[::-1])
                    if not ip.is_unspecified:
                        out.add(ip)
        return out

    def expire(self, now: float | None = None) -> int:
        """Drop learned addresses past their deadline (kept while a socket uses them); syncs
        the map; returns how many were dropped."""
        now = time.monotonic() if now is None else now
        due = [(n, a) for n, ips in self.dns_ips.items() for a, d in ips.items() if d <= now]
        dropped = 0
        if due:
            busy = self.in_use()
            for name, addr in due:
                if addr not in busy:
                    del self.dns_ips[name][addr]
                    dropped += 1
            self.dns_ips = {n: ips for n, ips in self.dns_ips.items() if ips}
        self._sync()
        return dropped

    def relearn(self, entries: set[Entry]) -> None:
        """After a re-adoption: single addresses the map held for ports of gated names were
        learned through the gate before; keep them (for MAX_TTL) under the names they fit."""
        deadline = time.monotonic() + MAX_TTL
        for e in entries:
            if e.net.prefixlen != 32:
                continue
            for name, ports in self.resolved.names.items():
                if (e.proto, e.port) in ports:
                    self.dns_ips.setdefault(name, {})[e.net.network_address] = deadline
        self._sync()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            if self.dns_ips:
                try:
                    await asyncio.to_thread(self.expire)
                except Exception as exc:  # noqa: BLE001 - retried next round
                    log.warning("sandbox %s: expiring DNS addresses failed: %s",
                                self.sandbox_id, exc)

    async def start_gate(self) -> None:
        close_stale(self.sandbox_id, keep=self)
        self.gate = DnsGate(self.link.gate_ip, self._allowed, self._admit,
                            upstream(self.settings.dns_upstream))
        for attempt in range(20):
            try:
                await self.gate.start()
                break
            except OSError as exc:
                # A transport's socket closes on the loop's next turns: wait for it (briefly).
                if exc.errno != errno.EADDRINUSE or attempt == 19:
                    raise
                await asyncio.sleep(0.05)
        _running[self.sandbox_id] = self
        self._sweeper = asyncio.create_task(self._sweep())

    def close(self) -> None:
        if _running.get(self.sandbox_id) is self:
            del _running[self.sandbox_id]
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        self.map.close()
        if self.counters is not None:
            self.counters.close()


def bpf_tag(sandbox_id: str) -> str:
    """The sandbox's part of its BPF program and map names."""
    return sandbox_id[-11:]


def bpf_leftovers(sandbox_id: str, wait_s: float = 2.0) -> list[str]:
    """BPF programs and maps of a deleted sandbox still loaded on the host. The kernel frees
    them shortly after the cgroup goes (deferred work), so wait up to wait_s for that."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            left = bpf.objects_of(bpf_tag(sandbox_id))
        except PermissionError:
            return []  # not root: this process never loaded any
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


async def attach(sandbox_id: str, netns_name: str, cgroup_dir: Path, rules: list[str],
                 settings: Settings) -> SandboxNetwork:
    parse_rules(rules)  # bad input before anything is made
    lnk = await asyncio.to_thread(link.create, sandbox_id, netns_name, settings)
    net = None
    try:
        amap, counters = bpf.attach_policy(cgroup_dir, bpf_tag(sandbox_id))
        net = SandboxNetwork(sandbox_id, lnk, amap, settings, cgroup_dir, counters)
        await asyncio.to_thread(net.apply, rules)
        await net.start_gate()
        return net
    except BaseException:
        if net is not None:
            net.close()
        await asyncio.to_thread(link.delete, sandbox_id)
        raise


async def adopt(sandbox_id: str, cgroup_dir: Path, rules: list[str],
                settings: Settings) -> SandboxNetwork | None:
    """Find the link and map again after an edge restart and restart the gate."""
    close_stale(sandbox_id)
    lnk = await asyncio.to_thread(link.find, sandbox_id)
    found = bpf.find_policy(cgroup_dir)
    if lnk is None or found is None:
        if found is not None:
            found[0].close()
            if found[1] is not None:
                found[1].close()
        return None
    amap, counters = found
    net = SandboxNetwork(sandbox_id, lnk, amap, settings, cgroup_dir, counters)
    # Entries from before the restart: start from what the map holds, then converge.
    old = set(amap.keys())
    try:
        net.current = {e for e in (bpf.entry_of(k) for k in old) if e is not None}
        await asyncio.to_thread(net.apply, rules, False)
        net.relearn(net.current - net.resolved.entries)  # syncs the map
        stale = old - {e.key() for e in net.current}
        for key in stale:
            amap._elem(bpf.MAP_DELETE_ELEM, key, None)
        await net.start_gate()
    except BaseException:
        net.close()
        raise
    return net
