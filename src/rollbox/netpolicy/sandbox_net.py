"""One sandbox's network: its link, its BPF allow map, its DNS gate and its current policy.

``attach`` brings it up (veth, programs on the cgroup, gate), ``apply`` changes the policy in
place (map updates only: effective for new and existing connections at once), ``adopt`` finds
it again after an edge restart, ``close`` stops the gate (the link goes with the sandbox's
teardown, the programs and map with its cgroup).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from pathlib import Path

from rollbox.netpolicy import bpf, link
from rollbox.netpolicy.bpf import Entry
from rollbox.netpolicy.gate import DnsGate
from rollbox.netpolicy.policy import (
    Forbidden, Resolved, local_mirror_ports, parse_rules, resolve,
)

log = logging.getLogger(__name__)
RESOLV_CONF = "/etc/resolv.conf"
_mirror_ports_added: set[int] = set()


class SandboxNetwork:
    def __init__(self, sandbox_id: str, lnk: link.Link, allow_map: bpf.AllowMap,
                 settings: object) -> None:
        self.sandbox_id = sandbox_id
        self.link = lnk
        self.map = allow_map
        self.settings = settings
        self.rules: list[str] = []
        self.resolved = Resolved()
        self.current: set[Entry] = set()
        self.dns_ips: dict[str, set[ipaddress.IPv4Address]] = {}
        self.forbidden = Forbidden.current()
        self.gate: DnsGate | None = None
        self._lock = asyncio.Lock()

    @property
    def env(self) -> dict[str, str]:
        return dict(self.resolved.env)

    def resolv_conf(self) -> bytes:
        return f"nameserver {self.link.gate_ip}\noptions timeout:2 attempts:2\n".encode()

    def _desired(self) -> set[Entry]:
        want = set(self.resolved.entries)
        for name, ips in self.dns_ips.items():
            for proto, port in self.resolved.name_ports(name):
                for ip in ips:
                    want.add(Entry(proto, port, ipaddress.IPv4Network(ip)))
        return want

    def _sync(self) -> None:
        want = self._desired()
        self.map.remove(self.current - want)
        self.map.add(want - self.current)
        self.current = want

    def apply(self, rules: list[str]) -> dict[str, str]:
        """Replace the policy (validated first: a bad rule changes nothing); returns the env."""
        parsed = parse_rules(rules)
        self.forbidden = Forbidden.current()
        resolved = resolve(parsed, self.link.gate_ip, self.settings, self.forbidden)
        ports = local_mirror_ports(resolved, self.link.gate_ip) - _mirror_ports_added
        if ports:
            link.allow_local_mirror_ports(ports)
            _mirror_ports_added.update(ports)
        self.resolved = resolved
        self.rules = list(rules)
        self._sync()
        return self.env

    # DNS gate callbacks
    def _allowed(self, qname: str) -> bool:
        return bool(self.resolved.name_ports(qname))

    def _admit(self, qname: str,
               addrs: list[ipaddress.IPv4Address]) -> list[ipaddress.IPv4Address]:
        ok = []
        ports = self.resolved.name_ports(qname)
        for a in addrs:
            net = ipaddress.IPv4Network(a)
            if all(self.forbidden.cut(net, port) for _, port in ports):
                ok.append(a)
        if ok:
            self.dns_ips.setdefault(qname, set()).update(ok)
            self._sync()
        return ok

    async def start_gate(self) -> None:
        self.gate = DnsGate(self.link.gate_ip, self._allowed, self._admit)
        await self.gate.start()

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        self.map.close()


async def attach(sandbox_id: str, netns_name: str, cgroup_dir: Path, rules: list[str],
                 settings: object) -> SandboxNetwork:
    parse_rules(rules)  # bad input before anything is made
    lnk = await asyncio.to_thread(link.create, sandbox_id, netns_name)
    net = None
    try:
        amap = bpf.attach_policy(cgroup_dir, sandbox_id[-11:])
        net = SandboxNetwork(sandbox_id, lnk, amap, settings)
        await asyncio.to_thread(net.apply, rules)
        await net.start_gate()
        return net
    except BaseException:
        if net is not None:
            net.close()
        await asyncio.to_thread(link.delete, sandbox_id)
        raise


async def adopt(sandbox_id: str, cgroup_dir: Path, rules: list[str],
                settings: object) -> SandboxNetwork | None:
    """Find the link and map again after an edge restart and restart the gate."""
    lnk = await asyncio.to_thread(link.find, sandbox_id)
    amap = bpf.find_policy(cgroup_dir)
    if lnk is None or amap is None:
        if amap is not None:
            amap.close()
        return None
    net = SandboxNetwork(sandbox_id, lnk, amap, settings)
    # Entries from before the restart: start from what the map holds, then converge.
    old = set(amap.keys())
    try:
        await asyncio.to_thread(net.apply, rules)
        stale = old - {e.key() for e in net.current}
        for key in stale:
            amap._elem(bpf.MAP_DELETE_ELEM, key, None)
        await net.start_gate()
    except BaseException:
        net.close()
        raise
    return net
