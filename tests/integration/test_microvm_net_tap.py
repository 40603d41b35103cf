"""The microVM network path without a VM: the real link, tap, nftables filter and DNS gate of
backends/microvm/net.py, with a stand-in for QEMU (a relay between the VM's tap descriptor and
a tap in a "guest" namespace whose kernel stack plays the guest, as root: raw sockets, IPv6,
any address). Crafted frames are written to the VM's tap descriptor directly, as QEMU writes
what a guest sends. Targets are the fake internet and resolver of test_netpolicy_targets.

Each rule of the tap filter is tested on its own: the attack it stops is shown to pass with
the ruleset minus that rule (tapfilter.ruleset(skip=...))."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from rollbox.backends.microvm import net as vmnet
from rollbox.isolation import netns
from rollbox.netpolicy import link, tapfilter
from rollbox.netpolicy.tapfilter import TABLE, TapFilter
from tests.conftest import TEST_NODE, node_settings
from tests.redteam.test_container_network import HOLD, HostListener
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    DNS_CLIENT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)")

# Guest-side probes, all at once (threads), short timeouts: a dropped packet is a timeout.
PROBE = r"""
import json, socket, sys, threading
specs = json.loads(sys.argv[1]); out = [None] * len(specs)
def one(i, proto, ip, port):
    fam = socket.AF_INET6 if ':' in ip else socket.AF_INET
    try:
        if proto == 'tcp':
            s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(1.5)
            s.connect(socket.getaddrinfo(ip, port, fam, socket.SOCK_STREAM)[0][4]); s.sendall(b'hi'); out[i] = 'ok ' + s.recv(10).decode()
        else:
            s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(1.5)
            s.sendto(b'hi', (ip, port)); out[i] = 'ok ' + s.recv(10).decode()
    except socket.timeout:
        out[i] = 'timeout'
    except OSError as e:
        out[i] = f'err {e.errno}'
ts = [threading.Thread(target=one, args=(i, *s)) for i, s in enumerate(specs)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"""

PING = r"""
import socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(1.5)
pkt = struct.pack('!BBHHH', 8, 0, 0, 7, 1) + b'rollbox!'
pkt = pkt[:2] + struct.pack('!H', csum(pkt)) + pkt[4:]
s.sendto(pkt, (sys.argv[1], 0))
try:
    while True:
        data, peer = s.recvfrom(200)
        if peer[0] == sys.argv[1] and data[20] == 0:
            print('reply'); break
except socket.timeout:
    print('no reply')
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class QemuStandIn:
    """Relays frames between the VM's tap descriptor (what QEMU holds) and a tap ``eth0`` in
    a guest namespace configured as the guest would be (GuestConfig)."""

    def __init__(self, vm_tap_fd: int, guest: vmnet.GuestConfig) -> None:
        self.ns = f"rbtg{secrets.token_hex(3)}"
        self.vm_fd = vm_tap_fd
        self.guest_fd = -1
        self.stop_r, self.stop_w = os.pipe()
        self.thread: threading.Thread | None = None
        _ip("netns", "add", self.ns)
        try:
            self.guest_fd = vmnet.open_tap(self.ns, "eth0", ipv6_off=False)
            _ip("-n", self.ns, "link", "set", "lo", "up")
            _ip("-n", self.ns, "link", "set", "eth0", "down")
            _ip("-n", self.ns, "link", "set", "eth0", "address", vmnet.GUEST_MAC)
            # A link-local IPv6 address at once (no duplicate detection): the guest's root
            # tries IPv6 too.
            subprocess.run(["ip", "netns", "exec", self.ns, "sysctl", "-qw",
                            "net.ipv6.conf.all.accept_dad=0",
                            "net.ipv6.conf.eth0.accept_dad=0"], check=True)
            for argv in guest.commands():
                _ip("-n", self.ns, *argv[1:])
            self.thread = threading.Thread(target=self._relay, daemon=True)
            self.thread.start()
            self._wait_link_local()
        except BaseException:
            self.close()
            raise

    def _wait_link_local(self) -> None:
        """Until eth0 has its IPv6 link-local address (the guest's IPv6 attempts must leave)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "-n", self.ns, "-6", "addr", "show", "dev", "eth0",
                                  "scope", "link"], capture_output=True, text=True).stdout
            if "fe80" in out and "tentative" not in out:
                return
            time.sleep(0.05)
        raise AssertionError("the guest's eth0 got no IPv6 link-local address")

    def _relay(self) -> None:
        peer = {self.vm_fd: self.guest_fd, self.guest_fd: self.vm_fd}
        while True:
            ready, _, _ = select.select([self.vm_fd, self.guest_fd, self.stop_r], [], [])
            if self.stop_r in ready:
                return
            for fd in ready:
                try:
                    frame = os.read(fd, 65536)
                    os.write(peer[fd], frame)
                except OSError:
                    pass  # a frame the other side refused (e.g. its device went down)

    def inject(self, frame: bytes) -> None:
        """A frame as the guest's driver would send it (written where QEMU writes)."""
        os.write(self.vm_fd, frame)

    async def run(self, code: str, *args: str, timeout: float = 20) -> str:
        """Python code in the guest (off the event loop: the DNS gate runs on it)."""
        p = await asyncio.to_thread(
            subprocess.run, ["ip", "netns", "exec", self.ns, sys.executable, "-c", code, *args],
            capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()

    async def probe(self, *specs: tuple[str, str, int]) -> list[str]:
        return json.loads(await self.run(PROBE, json.dumps(specs)))

    def close(self) -> None:
        os.write(self.stop_w, b"x")
        if self.thread is not None:
            self.thread.join(5)
        for fd in (self.guest_fd, self.stop_r, self.stop_w):
            if fd >= 0:
                os.close(fd)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class VmBox:
    """One microVM's network (everything but the VM): its namespace, link, tap, filter, gate."""

    def __init__(self, sid: str, net: vmnet.VmNetwork, tap_fd: int,
                 internet: FakeInternet) -> None:  # noqa: F811
        self.sid = sid
        self.net = net
        self.tap_fd = tap_fd
        self.guest = QemuStandIn(tap_fd, net.guest)
        internet.route_from(sid)

    @property
    def ns(self) -> str:
        return vmnet.netns_name(self.sid)

    def host_mac(self) -> bytes:
        text = Path(f"/sys/class/net/{self.net.link.host_if}/address").read_text().strip()
        return bytes.fromhex(text.replace(":", ""))

    def reinstall(self, skip: frozenset[str]) -> None:
        """The filter minus the rules in skip, with the same set (tests of one rule)."""
        flt = TapFilter.install(self.ns, self.net.link.sandbox_ip, vmnet.GUEST_MAC, skip=skip)
        flt.replace(self.net.current)
        self.net.filter = flt
        self.net.map = flt
        self.net.counters = flt

    async def close(self) -> None:
        self.guest.close()
        self.net.close()
        os.close(self.tap_fd)
        await asyncio.to_thread(vmnet.delete, self.sid)


@pytest.fixture
async def vmboxes(tmp_path: Path, internet: FakeInternet  # noqa: F811
                  ) -> AsyncIterator[Callable]:  # type: ignore[type-arg]
    made: list[VmBox] = []

    async def make(rules: list[str]) -> VmBox:
        sid = f"{TEST_NODE}vn{secrets.token_hex(4)}"
        netns.create(vmnet.netns_name(sid))
        try:  # settings made now: the test's fixtures (a DNS upstream) are set up
            net, fd = await vmnet.attach(sid, rules, node_settings(tmp_path))
        except BaseException:
            netns.delete(vmnet.netns_name(sid))
            raise
        try:
            box = VmBox(sid, net, fd, internet)
        except BaseException:
            net.close()
            os.close(fd)
            await asyncio.to_thread(vmnet.delete, sid)
            raise
        made.append(box)
        return box

    try:
        yield make
    finally:
        for b in made:
            await b.close()
        for b in made:
            left = vmnet.leftovers(b.sid)
            if netns.netns_path(b.ns).exists():
                left.append(b.ns)
            assert not left, f"leaked: {left}"


def HostListener6() -> HostListener:  # noqa: N802 - a dual-stack host service
    return HostListener("::", socket.AF_INET6)


def host_link_local(host_if: str) -> str:
    """The IPv6 link-local address of a link's host end."""
    info = json.loads(subprocess.run(["ip", "-j", "-6", "addr", "show", "dev", host_if],
                                     capture_output=True, text=True).stdout or "[]")
    for it in info:
        for a in it.get("addr_info", []):
            if a["local"].startswith("fe80"):
                return str(a["local"])
    raise AssertionError("the host end has no IPv6 link-local address")


def reached(internet: FakeInternet, what: str) -> bool:  # noqa: F811
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if any(what in line for line in internet.log()):
            return True
        time.sleep(0.05)
    return False


# ---- frames as a guest's driver sends them -------------------------------------------------
def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF


def mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def udp_frame(dst_mac: bytes, src_mac: bytes, src: str, dst: str, sport: int, dport: int,
              payload: bytes, frag_off: int = 0) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 7, frag_off, 64, 17, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return dst_mac + src_mac + b"\x08\x00" + hdr + udp


def udp6_frame(dst_mac: bytes, src_mac: bytes, src: str, dst: str, sport: int, dport: int,
               payload: bytes) -> bytes:
    s6, d6 = socket.inet_pton(socket.AF_INET6, src), socket.inet_pton(socket.AF_INET6, dst)
    length = 8 + len(payload)
    pseudo = s6 + d6 + struct.pack("!IxxxB", length, 17)
    udp = struct.pack("!HHHH", sport, dport, length, 0) + payload
    udp = udp[:6] + struct.pack("!H", _csum(pseudo + udp) or 0xFFFF) + udp[8:]
    hdr = struct.pack("!IHBB", 6 << 28, length, 17, 64) + s6 + d6
    return dst_mac + src_mac + b"\x86\xdd" + hdr + udp


def arp_request(src_mac: bytes, sender_mac: bytes, sender_ip: str, target_ip: str) -> bytes:
    body = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, sender_mac,
                       socket.inet_aton(sender_ip), b"\0" * 6, socket.inet_aton(target_ip))
    return b"\xff" * 6 + src_mac + b"\x08\x06" + body


def neighbours(ifname: str) -> list[str]:
    out = subprocess.run(["ip", "-j", "neigh", "show", "dev", ifname], capture_output=True,
                         text=True).stdout
    return [n["dst"] for n in json.loads(out or "[]")]


# ---- the policy itself through the tap -----------------------------------------------------
async def test_allow_list_at_the_tap(vmboxes, internet: FakeInternet) -> None:  # noqa: F811
    a, b, c = internet.ips[:3]
    box = await vmboxes([f"{a}:8080", f"{b}:443/udp"])
    got = await box.guest.probe(("tcp", a, 8080), ("tcp", a, 80), ("udp", a, 8080),
                          ("udp", b, 443), ("tcp", b, 443), ("tcp", c, 8080))
    assert got == ["ok hi", "timeout", "timeout", "ok hi", "timeout", "timeout"], got
    # On the event loop audit() never waits for nft: it starts a read and answers from the
    # last one; the next call sees the new counts.
    t0 = time.monotonic()
    box.net.audit()
    assert time.monotonic() - t0 < 0.005
    assert box.net._reading is not None
    await box.net._reading
    audit = box.net.audit()
    # a:80, b:443 and c:8080 were TCP connects (each SYN retried within the timeout).
    assert audit["connect_denied"] >= 3 and audit["sendmsg_denied"] >= 1, audit
    assert audit["packets_dropped"] >= audit["connect_denied"] + audit["sendmsg_denied"]


async def test_dns_gate_and_direct_ip(vmboxes, internet: FakeInternet,  # noqa: F811
                                      upstream: FakeUpstream) -> None:  # noqa: F811
    """D25 and D26 at the tap: the name's address is closed until the gate answered for it;
    other names are REFUSED and never asked upstream; other resolvers are unreachable."""
    named, direct = internet.ips[0], internet.ips[1]
    box = await vmboxes(["allowed.example:8080"])
    gate = box.net.link.gate_ip
    assert await box.guest.probe(("tcp", named, 8080), ("tcp", direct, 8080)) == ["timeout"] * 2
    dns = DNS_CLIENT.replace("open('/etc/resolv.conf').read().split()[1]", repr(gate))
    got = json.loads(await box.guest.run(dns, json.dumps([
        ["secret.exfil.example", 1, False], ["secret.exfil.example", 16, True],
        ["allowed.example", 1, False]])))
    assert list(got.values()) == ["rcode 5 answers 0", "rcode 5 answers 0",
                                  "rcode 0 answers 1"], got
    assert upstream.names() == ["allowed.example"]
    assert await box.guest.probe(("tcp", named, 8080), ("tcp", direct, 8080),
                           ("udp", "8.8.8.8", 53), ("tcp", internet.host_ip, 53),
                           ("udp", internet.ips[2], 53)) == ["ok hi"] + ["timeout"] * 4
    assert box.net.audit()["dns_refused"] == 2
    # The learned address leaves the set when it expires (nothing uses it any more).
    await asyncio.sleep(0)
    assert box.net.expire(now=time.monotonic() + 3600) == 0  # in use: the probe just ran
    box.net.filter.active = lambda: set()  # type: ignore[method-assign]
    assert box.net.expire(now=time.monotonic() + 3600) == 1
    assert await box.guest.probe(("tcp", named, 8080)) == ["timeout"]


async def test_phase_change_cuts_open_connections(vmboxes, internet: FakeInternet  # noqa: F811
                                                  ) -> None:
    """D29 at the tap: a TCP connection and a connected UDP flow opened while the policy
    allowed them stop the moment a new policy leaves them out (twin: the same change that
    keeps them leaves them alive)."""
    target = internet.ips[3]
    setup = [f"{target}:8080", f"{target}:8080/udp"]
    for keep in (False, True):
        box = await vmboxes(setup)
        proc = subprocess.Popen(["ip", "netns", "exec", box.guest.ns, sys.executable, "-c",
                                 HOLD, target, "3"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "open"
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await asyncio.to_thread(box.net.apply, setup if keep else [])
            assert time.monotonic() - t0 < 1.0
            rest = await asyncio.to_thread(proc.communicate, timeout=15)
        finally:
            proc.kill()
            proc.wait()
        if keep:
            assert rest[0].startswith("alive"), rest
        else:
            assert rest[0].startswith("cut"), rest
            assert await box.guest.probe(("tcp", target, 8080)) == ["timeout"]


async def test_guest_root_tricks(vmboxes, internet: FakeInternet) -> None:  # noqa: F811
    """D27/D28/D30 with the guest's root: metadata, the gate's other ports, another sandbox,
    IPv6 to the host's link-local address, ICMP, UDP around a TCP rule, TCP around a UDP rule."""
    ip = internet.ips[0]
    v6 = HostListener6()
    box = await vmboxes([f"{ip}:443", f"{ip}:8080/udp", "0.0.0.0/0:9999",
                         f"0.0.0.0/0:{v6.port}"])
    other = await vmboxes(["0.0.0.0/0:9999"])
    srv = subprocess.Popen(["ip", "netns", "exec", other.guest.ns, sys.executable, "-c",
                            "import socket\ns=socket.create_server(('0.0.0.0',9999))\n"
                            "print('up',flush=True)\nwhile True:\n c,_=s.accept();"
                            "c.sendall(c.recv(10));c.close()"], stdout=subprocess.PIPE)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == b"up"
        gate = box.net.link.gate_ip
        lla = host_link_local(box.net.link.host_if)
        got = await box.guest.probe(
            ("tcp", "169.254.169.254", 80), ("tcp", gate, 22), ("tcp", gate, 7420),
            ("tcp", other.net.link.sandbox_ip, 9999), ("tcp", other.net.link.gate_ip, 9999),
            ("udp", ip, 443), ("tcp", ip, 8080), ("tcp", f"{lla}%eth0", v6.port),
            ("tcp", ip, 443), ("udp", ip, 8080))
        assert got[:8] == ["timeout"] * 8, got
        assert got[8:] == ["ok hi", "ok hi"], got  # twins: the rules' own protocols
        assert await box.guest.run(PING, ip) == "no reply"
        assert v6.conns == 0
        # Twin: the other sandbox's listener answers from inside it.
        assert await other.guest.probe(("tcp", "127.0.0.1", 9999)) == ["ok hi"]
    finally:
        srv.kill()
        srv.wait()
        v6.close()


# ---- each rule of the filter on its own ----------------------------------------------------
async def _attack(rule: str, box: VmBox, internet: FakeInternet) -> bool:  # noqa: F811
    """The attack the rule stops; True if it got through."""
    allowed = internet.ips[1]
    marker = secrets.token_hex(4)
    gm = mac(vmnet.GUEST_MAC)
    sip = box.net.link.sandbox_ip
    if rule == "mac":  # another MAC (the guest's root can set any)
        box.guest.inject(udp_frame(box.host_mac(), mac("52:54:00:00:00:99"), sip, allowed,
                                   4000, 8080, marker.encode()))
        return reached(internet, marker)
    if rule == "saddr":  # a spoofed source address
        box.guest.inject(udp_frame(box.host_mac(), gm, "192.0.2.77", allowed, 4000, 8080,
                                   marker.encode()))
        return reached(internet, marker)
    if rule == "arp":  # claim another address (here: one of the pool) to the host
        claimed = str(__import__("ipaddress").IPv4Address(sip) + 256)
        box.guest.inject(arp_request(gm, gm, claimed, box.net.link.gate_ip))
        await asyncio.sleep(0.3)
        return claimed in neighbours(box.net.link.host_if)
    if rule == "allow_out":  # a destination not in the set, and IPv6 to the host
        # (only the way out is tested: without this rule the answers are still dropped,
        # IPv6 neighbour discovery's too, so the IPv6 frame goes to the host's MAC directly)
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as v6:
            v6.bind(("::", 0))
            v6.settimeout(1.5)
            box.guest.inject(udp6_frame(box.host_mac(), gm, "fe80::5054:ff:fe72:6278",
                                        host_link_local(box.net.link.host_if), 4000, v6.getsockname()[1],
                                        marker.encode()))
            out = await box.guest.run(
                "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                "s.sendto(sys.argv[1].encode(),(sys.argv[2],8080))", marker, internet.ips[2])
            assert out == "", out
            try:
                got6 = v6.recv(100) == marker.encode()
            except socket.timeout:
                got6 = False
        got4 = reached(internet, marker)
        assert got4 == got6, (got4, got6)  # both pass, or neither
        return got4
    if rule == "allow_in":  # the outside reaching a guest port nothing allows
        code = ("import socket\nu=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                "u.bind(('0.0.0.0',7777));u.settimeout(2)\n"
                "try: print(u.recv(100).decode())\nexcept socket.timeout: print('none')")
        p = subprocess.Popen(["ip", "netns", "exec", box.guest.ns, sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
        await asyncio.sleep(0.5)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((box.net.link.gate_ip, 0))
            for _ in range(5):
                s.sendto(marker.encode(), (sip, 7777))
        return (await asyncio.to_thread(p.communicate))[0].strip() == marker
    if rule == "daddr":  # towards the guest but not to its address (the /30's broadcast)
        code = ("import socket\nu=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                "u.setsockopt(socket.SOL_SOCKET,socket.SO_BROADCAST,1)\n"
                "u.bind(('0.0.0.0',7777));u.settimeout(2)\n"
                "try: print(u.recv(100).decode())\nexcept socket.timeout: print('none')")
        p = subprocess.Popen(["ip", "netns", "exec", box.guest.ns, sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
        await asyncio.sleep(0.5)
        bcast = str(__import__("ipaddress").IPv4Address(sip) + 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.bind((box.net.link.gate_ip, 53))  # a source port the set allows (the gate)
            for _ in range(5):
                s.sendto(marker.encode(), (bcast, 7777))
        return (await asyncio.to_thread(p.communicate))[0].strip() == marker
    raise AssertionError(rule)


@pytest.mark.parametrize("rule", tapfilter.RULES)
async def test_each_rule_on_its_own(rule: str, vmboxes, internet: FakeInternet  # noqa: F811
                                    ) -> None:
    box = await vmboxes([f"{internet.ips[1]}:8080/udp"])
    if rule == "daddr":
        # The gate's DNS socket holds port 53 on the gate address; borrow it for the test.
        assert box.net.gate is not None
        box.net.gate.close()
    assert not await _attack(rule, box, internet), f"{rule}: blocked with the full ruleset"
    box.reinstall(frozenset({rule}))
    assert await _attack(rule, box, internet), f"{rule}: the attack needs this rule to fail"
    # And the legitimate path still works through the reduced ruleset.
    assert await box.guest.probe(("udp", internet.ips[1], 8080)) == ["ok hi"]


async def test_adopt_after_an_edge_restart(vmboxes, internet: FakeInternet,  # noqa: F811
                                           upstream: FakeUpstream, tmp_path: Path) -> None:  # noqa: F811
    """A new edge finds the link and the table again: the set as it was (a name's learned
    address still open), the gate answering again; a changed policy converges the set. The
    filter keeps enforcing while no edge runs."""
    named = internet.ips[0]
    rules = ["allowed.example:8080", f"{internet.ips[1]}:8080"]
    box = await vmboxes(rules)
    gate = box.net.link.gate_ip
    dns = DNS_CLIENT.replace("open('/etc/resolv.conf').read().split()[1]", repr(gate))
    await box.guest.run(dns, json.dumps([["allowed.example", 1, False]]))
    assert await box.guest.probe(("tcp", named, 8080)) == ["ok hi"]
    box.net.close()  # the edge stops (its gate with it); the VM and its filter stay
    assert await box.guest.probe(("tcp", named, 8080), ("tcp", internet.ips[2], 8080)) == [
        "ok hi", "timeout"]
    adopted = await vmnet.adopt(box.sid, rules, node_settings(tmp_path))
    assert adopted is not None
    box.net = adopted
    assert adopted.current == box.net.filter.entries
    assert await box.guest.probe(("tcp", named, 8080), ("tcp", internet.ips[1], 8080)) == [
        "ok hi", "ok hi"]
    got = json.loads(await box.guest.run(dns, json.dumps([["nope.example", 1, False]])))
    assert list(got.values()) == ["rcode 5 answers 0"]  # the gate is back
    await asyncio.to_thread(adopted.apply, [f"{internet.ips[1]}:8080"])
    assert await box.guest.probe(("tcp", named, 8080), ("tcp", internet.ips[1], 8080)) == [
        "timeout", "ok hi"]
    # No table (or no link): nothing to adopt, the caller tears down (fail closed).
    box.net.close()
    box.net.filter.delete()
    assert await vmnet.adopt(box.sid, rules, node_settings(tmp_path)) is None


async def test_teardown_leaves_nothing(tmp_path: Path, internet: FakeInternet  # noqa: F811
                                       ) -> None:
    sid = f"{TEST_NODE}vn{secrets.token_hex(4)}"
    ns = vmnet.netns_name(sid)
    netns.create(ns)
    net, fd = await vmnet.attach(sid, [f"{internet.ips[0]}:80"], node_settings(tmp_path))
    try:
        tables = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "nft", "list", "tables"],
                                capture_output=True, text=True).stdout
        assert f"netdev {TABLE}" in tables
        assert Path(f"/sys/class/net/{net.link.host_if}").exists()
    finally:
        net.close()
        os.close(fd)  # QEMU's descriptor going: the tap goes
        assert await asyncio.to_thread(vmnet.delete, sid) == []
    assert vmnet.leftovers(sid) == []
    assert not netns.netns_path(ns).exists()
    assert sid not in link.list_links().values()


async def test_bad_rules_make_nothing(tmp_path: Path) -> None:
    from rollbox.errors import BadRequest, InfraError
    sid = f"{TEST_NODE}vn{secrets.token_hex(4)}"
    with pytest.raises(BadRequest):
        await vmnet.attach(sid, ["no such:rule"], node_settings(tmp_path))
    with pytest.raises(InfraError):  # no namespace: nothing made either
        await vmnet.attach(sid, ["1.2.3.4:80"], node_settings(tmp_path))
    assert vmnet.leftovers(sid) == []
