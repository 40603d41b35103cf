"""Policy parsing and resolution: rule strings -> allow-list entries, DNS names, environment.

Rules (``NetworkPolicy.allow``):

* a permission name: ``pypi``, ``npm``, ``debian``, ``go`` (see permissions.py);
* ``HOST:PORT[/tcp|/udp]``: a DNS name (``*.example.com`` covers sub-domains), opened through
  the DNS gate when the sandbox resolves it;
* ``A.B.C.D[/LEN]:PORT[/tcp|/udp]``: an IPv4 address or CIDR.

Whatever a rule says, some destinations are never allowed: other sandboxes and their gates
(the link pool), loopback, 0/8, link-local (169.254/16: cloud metadata services),
multicast/broadcast, and the host's own addresses on the platform's ports. They are cut out of
every CIDR and out of every DNS answer. The host's other addresses (where any host service bound
to 0.0.0.0 answers) are cut out of DNS answers and of every CIDR wider than one address: only a
rule naming one host address exactly (``A.B.C.D:PORT``) opens it, as a deliberate choice.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollbox.config import Settings
from rollbox.errors import BadRequest
from rollbox.netpolicy.bpf import PROTOS, Entry
from rollbox.netpolicy.permissions import (
    LOCAL_HOSTS,
    PERMISSIONS,
    sandbox_url,
    split_url,
)

NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
HOST_RE = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}"
                     r"[a-z0-9])?$")
RULE_RE = re.compile(r"^(?P<host>[^:/\s]+(/\d{1,2})?):(?P<port>\d{1,5})(/(?P<proto>tcp|udp))?$")

ALWAYS_FORBIDDEN = [ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")]
DNS_PORT = 53


def platform_ports(settings: Settings) -> set[int]:
    """Ports of the platform's own services on this host (api, mirrors' real listeners are
    reached only through their permission): the api's, the edge service's
    (``settings.edge_port``, red-team class 27 in cluster mode) and ``settings.platform_ports``."""
    return {7420, settings.edge_port, *settings.platform_ports}


def host_addresses() -> set[ipaddress.IPv4Address]:
    """IPv4 addresses local to this host (from the kernel's LOCAL routing table)."""
    out: set[ipaddress.IPv4Address] = set()
    prev = None
    with open("/proc/net/fib_trie") as f:
        for line in f:
            s = line.strip()
            if s.startswith("|--"):
                prev = s[3:].strip()
            elif "host LOCAL" in s and prev:
                out.add(ipaddress.IPv4Address(prev))
    return out


@dataclass(frozen=True)
class Rule:
    kind: str  # "permission" | "host" | "cidr"
    value: str  # permission name, host pattern or CIDR
    port: int = 0
    proto: int = 6


def parse_rule(text: str) -> Rule:
    """Parse one rule; BadRequest names what is wrong."""
    if not isinstance(text, str) or not text or len(text) > 300:
        raise BadRequest(f"malformed network rule {text!r}")
    t = text.strip().lower()
    if ":" not in t:
        if not NAME_RE.match(t):
            raise BadRequest(f"malformed network rule {text!r}")
        if t not in PERMISSIONS:
            raise BadRequest(f"unknown network permission {text!r}; known: "
                             f"{', '.join(sorted(PERMISSIONS))} or HOST:PORT[/udp]",
                             permission=text)
        return Rule("permission", t)
    m = RULE_RE.match(t)
    if not m:
        raise BadRequest(f"malformed network rule {text!r}: expected HOST:PORT[/tcp|/udp] "
                         f"or A.B.C.D[/LEN]:PORT[/tcp|/udp]")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise BadRequest(f"malformed network rule {text!r}: port must be 1..65535")
    proto = PROTOS[m["proto"] or "tcp"]
    host = m["host"]
    if re.match(r"^[0-9./]+$", host):
        try:
            net = ipaddress.IPv4Network(host, strict=True)
        except ValueError as exc:
            raise BadRequest(f"malformed network rule {text!r}: {exc}") from None
        return Rule("cidr", str(net), port, proto)
    if "/" in host or not HOST_RE.match(host) or len(host) > 253:
        raise BadRequest(f"malformed network rule {text!r}: bad host name")
    return Rule("host", host, port, proto)


def parse_rules(rules: Iterable[str]) -> list[Rule]:
    return [parse_rule(r) for r in rules]


@dataclass
class Forbidden:
    """Destinations no policy may open, as seen from one sandbox."""
    nets: list[ipaddress.IPv4Network]
    host_addrs: set[ipaddress.IPv4Address]
    ports: set[int]

    @classmethod
    def current(cls, settings: Settings) -> Forbidden:
        # Every edge's sandbox subnet of this host (net_host_range), not only this node's.
        nets = [settings.net_host_range] + ([] if settings.net_pool.subnet_of(
            settings.net_host_range) else [settings.net_pool])
        return cls(ALWAYS_FORBIDDEN + nets, host_addresses(),
                   platform_ports(settings))

    def cut(self, net: ipaddress.IPv4Network, port: int,
            explicit: bool = False) -> list[ipaddress.IPv4Network]:
        """net minus the forbidden ranges, minus the host's addresses unless ``explicit`` (a
        rule's own CIDR) names exactly one address on a port that is not the platform's."""
        banned = list(self.nets)
        if port in self.ports or not explicit or net.prefixlen < 32:
            # (gates are host addresses too, already out with the link pool)
            banned += [ipaddress.IPv4Network(a) for a in self.host_addrs
                       if not any(a in n for n in self.nets)]
        parts = [net]
        for b in banned:
            nxt = []
            for p in parts:
                if not p.overlaps(b):
                    nxt.append(p)
                elif p.subnet_of(b):
                    continue
                else:
                    nxt.extend(p.address_exclude(b))
            parts = nxt
        return list(ipaddress.collapse_addresses(parts))


@dataclass
class Resolved:
    """What a policy means for one sandbox: static entries, gated names, environment."""
    entries: set[Entry] = field(default_factory=set)
    names: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # pattern->{(proto,port)}
    env: dict[str, str] = field(default_factory=dict)

    def name_ports(self, qname: str) -> set[tuple[int, int]]:
        """(proto, port) pairs opened for a queried name ('' set: not allowed)."""
        q = qname.rstrip(".").lower()
        out: set[tuple[int, int]] = set()
        for pattern, ports in self.names.items():
            if pattern == q or (pattern.startswith("*.") and q.endswith(pattern[1:])):
                out |= ports
        return out


def resolve(rules: list[Rule], gate_ip: str, settings: Settings,
            forbidden: Forbidden | None = None) -> Resolved:
    forbidden = forbidden or Forbidden.current(settings)
    res = Resolved()
    gate = ipaddress.IPv4Network(f"{gate_ip}/32")
    res.entries.add(Entry(PROTOS["udp"], DNS_PORT, gate))
    res.entries.add(Entry(PROTOS["tcp"], DNS_PORT, gate))
    for rule in rules:
        if rule.kind == "permission":
            perm = PERMISSIONS[rule.value]
            url = settings.mirror_url(perm.mirror)
            if not url:
                raise BadRequest(f"network permission {rule.value!r} has no mirror configured "
                                 f"on this node (ROLLBOX_MIRRORS)", permission=rule.value)
            try:
                host, port = split_url(url)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            seen = sandbox_url(url, gate_ip)
            if host in LOCAL_HOSTS:
                # A mirror on this host: the gate address, that port only (platform-installed,
                # so not cut by the forbidden ranges).
                res.entries.add(Entry(PROTOS["tcp"], port, gate))
                res.env.update(perm.env(seen, gate_ip))
                continue
            res.env.update(perm.env(seen, host))
            rule = Rule("cidr", host, port, PROTOS["tcp"]) if re.match(
                r"^[0-9.]+$", host) else Rule("host", host, port, PROTOS["tcp"])
        if rule.kind == "cidr":
            for n in forbidden.cut(ipaddress.IPv4Network(rule.value), rule.port, explicit=True):
                res.entries.add(Entry(rule.proto, rule.port, n))
        elif rule.kind == "host":
            res.names.setdefault(rule.value, set()).add((rule.proto, rule.port))
    return res


def local_mirror_ports(resolved: Resolved, gate_ip: str) -> set[int]:
    """TCP ports at the gate address that lead to a mirror on this host."""
    gate = ipaddress.IPv4Network(f"{gate_ip}/32")
    return {e.port for e in resolved.entries
            if e.net == gate and e.proto == PROTOS["tcp"] and e.port != DNS_PORT}
