"""Packet-level enforcement of a sandbox's allow-list at a guest's tap: nftables in the
sandbox's own network namespace (for microVMs, whose packets QEMU writes to a tap, where the
containers' cgroup-BPF socket filters never see them).

Inside the namespace the guest port (``tap0``, QEMU's end) and the uplink (``eth0``, the
namespace end of the host link, see link.py) carry no address: one netdev table
``rollbox_vm`` joins them with two ingress chains that forward (``fwd``) what passes, so the
namespace's own stack never sees a guest packet, and drops the rest (policy drop):

* from the guest: only frames from the guest's MAC; ARP only as the guest's own IP and MAC;
  only IPv4 (IPv6, VLAN tags and any other ethertype dropped) from the guest's IP (spoofed
  sources dropped), no fragments, only TCP/UDP whose (protocol, destination port, destination
  address) is in the ``allow`` set;
* to the guest: ARP, and IPv4 TCP/UDP to the guest's IP whose (protocol, source port, source
  address) is in the same set (answers from allowed destinations only).

Packets are checked one by one (no connection tracking), so removing an element cuts a
connection opened earlier at once, as the containers' skb programs do. The set is replaced as a
whole in one nft transaction (atomic: never empty in between) with disjoint elements (prefixes
collapsed per protocol and port; nft's interval sets misbehave on overlapping elements).
Each forwarded guest packet refreshes its destination in the ``active`` set (dynamic, 30 s
timeout): what :meth:`TapFilter.active` reports as in use (the guest's sockets are not visible
from the host). Named counters count drops: ``out_tcp`` (TCP connection attempts, SYN without
ACK, IPv4 or IPv6), ``out_udp`` (IPv4 or IPv6), ``out_other`` (any other IPv4 from the guest:
ICMP, fragments; and frames from another MAC, address or spoofed ARP), ``in_drop`` (IPv4
towards the guest). Other frames are dropped uncounted: the guest kernel's own IPv6 neighbour
discovery would be noise in the audit trail.

Owns: the ``netdev rollbox_vm`` table inside a sandbox's namespace. Must not touch anything in
the host's namespace (the host end of the link and the node-wide table are link.py's).
"""
from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollbox.errors import InfraError
from rollbox.netpolicy.bpf import COUNTERS, PROTO_TCP, PROTO_UDP, Entry
from rollbox.netpolicy.link import SANDBOX_IFACE

TABLE = "rollbox_vm"
GUEST_IFACE = "tap0"
ACTIVE_TIMEOUT_S = 30
# Named counters of the table, in the order of the chains' rules.
NFT_COUNTERS = ("out_tcp", "out_udp", "out_other", "in_drop")
# Rules that can be left out of the ruleset: only for tests proving each one matters.
MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
RULES = ("mac", "arp", "saddr", "allow_out", "daddr", "allow_in")


def nft_in(netns_name: str, script: str, json_out: bool = False) -> str:
    """Run an nft script (json_out: one list command, JSON out) inside the named namespace;
    its stdout."""
    argv = ["nsenter", f"--net=/run/netns/{netns_name}", "nft"]
    args = ["-j", *script.split()] if json_out else ["-f", "-"]
    proc = subprocess.run([*argv, *args], input=None if json_out else script,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise InfraError(f"nft in {netns_name} failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def ruleset(guest_ip: str, guest_mac: str, guest_if: str = GUEST_IFACE,
            uplink_if: str = SANDBOX_IFACE, skip: frozenset[str] = frozenset()) -> str:
    """The table (without set elements). ``skip``: rule names of RULES to leave out (tests)."""
    ipaddress.IPv4Address(guest_ip)  # never format something else into the script
    mac = guest_mac.lower()
    if not MAC_RE.match(mac):
        raise ValueError(f"bad MAC {guest_mac!r}")
    up, gst = f'"{uplink_if}"', f'"{guest_if}"'

    def r(name: str, text: str) -> str:
        return "" if name in skip else f"    {text}\n"

    arp_ok = (f"arp htype 1 arp ptype ip arp hlen 6 arp plen 4 "
              f"arp saddr ether {mac} arp saddr ip {guest_ip} fwd to {up}")
    return (
        f"table netdev {TABLE} {{\n"
        "  set allow { type inet_proto . inet_service . ipv4_addr; flags interval; }\n"
        f"  set active {{ type ipv4_addr; flags dynamic,timeout; timeout {ACTIVE_TIMEOUT_S}s;"
        " size 4096; }\n"
        + "".join(f"  counter {c} {{}}\n" for c in NFT_COUNTERS)
        + "  chain from_guest {\n"
        f"    type filter hook ingress device {gst} priority filter; policy drop;\n"
        + r("mac", f'ether saddr != {mac} counter name "out_other" drop')
        + (r("arp", arp_ok) if "arp" not in skip else f"    ether type arp fwd to {up}\n")
        + r("saddr", f'ip saddr != {guest_ip} counter name "out_other" drop')
        # (meta protocol ip is implied: IPv6 and every other ethertype never match; nor do
        # non-first fragments, which have no transport header)
        + (r("allow_out", "meta l4proto . th dport . ip daddr @allow "
             f"update @active {{ ip daddr }} fwd to {up}")
           if "allow_out" not in skip else f"    fwd to {up}\n")
        # Counted refusals: TCP connects and UDP sends (IPv4 or IPv6), any other IPv4. Other
        # frames (the guest kernel's own IPv6 neighbour discovery...) drop uncounted (noise).
        + '    tcp flags & (syn | ack) == syn counter name "out_tcp" drop\n'
        + '    meta l4proto udp counter name "out_udp" drop\n'
        + '    meta protocol ip counter name "out_other" drop\n'
        + "  }\n"
        "  chain to_guest {\n"
        f"    type filter hook ingress device {up} priority filter; policy drop;\n"
        f"    ether type arp fwd to {gst}\n"
        + r("daddr", f'ip daddr != {guest_ip} counter name "in_drop" drop')
        + (r("allow_in", f"meta l4proto . th sport . ip saddr @allow fwd to {gst}")
           if "allow_in" not in skip else f"    fwd to {gst}\n")
        + '    meta protocol ip counter name "in_drop" drop\n'
        + "  }\n"
        "}\n")


def elements(entries: Iterable[Entry]) -> list[str]:
    """Disjoint set elements for entries (TCP/UDP only), sorted."""
    by_port: dict[tuple[int, int], list[ipaddress.IPv4Network]] = {}
    for e in entries:
        if e.proto in (PROTO_TCP, PROTO_UDP) and 0 < e.port < 65536:
            by_port.setdefault((e.proto, e.port), []).append(e.net)
    out = []
    for (proto, port), nets in sorted(by_port.items()):
        for n in ipaddress.collapse_addresses(nets):
            addr = str(n.network_address) if n.prefixlen == 32 else str(n)
            out.append(f"{proto} . {port} . {addr}")
    return out


def replace_script(entries: Iterable[Entry]) -> str:
    elems = elements(entries)
    script = f"flush set netdev {TABLE} allow\n"
    if elems:
        script += f"add element netdev {TABLE} allow {{ {', '.join(elems)} }}\n"
    return script


@dataclass
class TapFilter:
    """The table of one sandbox's namespace; ``add``/``remove`` keep the allow set equal to
    the entries given so far (the interface of bpf.AllowMap that SandboxNetwork uses)."""
    netns_name: str
    guest_ip: str
    guest_mac: str
    entries: set[Entry] = field(default_factory=set)
    closed: bool = False

    @classmethod
    def install(cls, netns_name: str, guest_ip: str, guest_mac: str,
                skip: frozenset[str] = frozenset()) -> TapFilter:
        """Create the table (both devices must exist in the namespace) with an empty set:
        everything but ARP dropped until entries are added."""
        nft_in(netns_name, _DROP_TABLE + ruleset(guest_ip, guest_mac, skip=skip))
        return cls(netns_name, guest_ip, guest_mac)

    @classmethod
    def find(cls, netns_name: str, guest_ip: str, guest_mac: str) -> TapFilter | None:
        """The table made by an earlier edge process, with the entries its set holds."""
        try:
            out = nft_in(netns_name, f"list set netdev {TABLE} allow\n", json_out=True)
        except InfraError:
            return None
        f = cls(netns_name, guest_ip, guest_mac)
        f.entries = parse_set(out)
        return f

    def _push(self) -> None:
        if self.closed:
            raise InfraError(f"network filter of {self.netns_name} is closed")
        nft_in(self.netns_name, replace_script(self.entries))

    def replace(self, entries: Iterable[Entry]) -> None:
        self.entries = set(entries)
        self._push()

    def add(self, entries: Iterable[Entry]) -> None:
        new = set(entries) - self.entries
        if new:
            self.entries |= new
            self._push()

    def remove(self, entries: Iterable[Entry]) -> None:
        gone = set(entries) & self.entries
        if gone:
            self.entries -= gone
            self._push()

    def counters(self) -> dict[str, int]:
        """Packets dropped per named counter."""
        out = nft_in(self.netns_name, f"list counters table netdev {TABLE}\n", json_out=True)
        got = dict.fromkeys(NFT_COUNTERS, 0)
        for item in json.loads(out).get("nftables", []):
            c = item.get("counter")
            if c and c.get("name") in got:
                got[c["name"]] = int(c.get("packets", 0))
        return got

    def read(self) -> dict[str, int]:
        """The counters under the names of bpf.COUNTERS (what SandboxNetwork.audit reads):
        a dropped TCP SYN is a refused connect, a dropped UDP datagram a refused send."""
        c = self.counters()
        out = dict.fromkeys(COUNTERS, 0)
        out["connect4"] = c["out_tcp"]
        out["sendmsg4"] = c["out_udp"]
        out["egress"] = c["out_tcp"] + c["out_udp"] + c["out_other"]
        out["ingress"] = c["in_drop"]
        return out

    @property
    def is_open(self) -> bool:
        return not self.closed

    def active(self) -> set[ipaddress.IPv4Address]:
        """Destinations the guest sent allowed packets to in the last ACTIVE_TIMEOUT_S."""
        out = nft_in(self.netns_name, f"list set netdev {TABLE} active\n", json_out=True)
        got: set[ipaddress.IPv4Address] = set()
        for item in json.loads(out).get("nftables", []):
            for el in (item.get("set") or {}).get("elem", []):
                val = el.get("elem", {}).get("val") if isinstance(el, dict) else el
                if isinstance(val, str):
                    got.add(ipaddress.IPv4Address(val))
        return got

    def close(self) -> None:
        """Forget the table (it goes with the namespace); later changes are refused."""
        self.closed = True

    def delete(self) -> None:
        """Remove the table now (the namespace stays)."""
        nft_in(self.netns_name, _DROP_TABLE)
        self.closed = True


# Delete the table whether or not it exists (nft 1.0.6 has no "destroy"): add, then delete.
_DROP_TABLE = f"table netdev {TABLE} {{}}\ndelete table netdev {TABLE}\n"
_PROTO_NAMES = {"tcp": PROTO_TCP, "udp": PROTO_UDP}


def parse_set(nft_json: str) -> set[Entry]:
    """Entries of the allow set as ``nft -j list set`` shows them."""
    out: set[Entry] = set()
    for item in json.loads(nft_json).get("nftables", []):
        for el in (item.get("set") or {}).get("elem", []):
            concat = el.get("concat") if isinstance(el, dict) else None
            if concat is None and isinstance(el, dict):
                concat = (el.get("elem", {}).get("val") or {}).get("concat")
            if not concat or len(concat) != 3:
                continue
            proto_v, port, addr = concat
            proto = _PROTO_NAMES.get(proto_v, proto_v) if isinstance(proto_v, str) else proto_v
            if isinstance(addr, dict) and "prefix" in addr:
                net = ipaddress.IPv4Network(f"{addr['prefix']['addr']}/{addr['prefix']['len']}")
            elif isinstance(addr, dict) and "range" in addr:
                lo, hi = (ipaddress.IPv4Address(a) for a in addr["range"])
                for n in ipaddress.summarize_address_range(lo, hi):
                    out.add(Entry(int(proto), int(port), n))
                continue
            else:
                net = ipaddress.IPv4Network(str(addr))
            out.add(Entry(int(proto), int(port), net))
    return out
