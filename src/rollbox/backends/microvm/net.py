"""Network of one microVM: no NIC at all without a policy; with one, a tap in the sandbox's own
network namespace (the one QEMU's jail runs in), joined to the host by the same veth link as a
container's (netpolicy/link.py: /30 from the pool, gate = host end, node-wide nftables table),
enforced at the tap by nftables in that namespace (netpolicy/tapfilter.py), with the same
named permissions, DNS gate and live policy changes as containers (netpolicy/sandbox_net.py).

Layout inside ``rollbox-<id>``: ``eth0`` (namespace end of the link, no address) and ``tap0``
(QEMU's end, opened here and handed to QEMU as a descriptor, so the jail needs no /dev/net/tun
and the tap goes away with the last descriptor); the namespace's own stack never sees a guest
packet (the filter forwards between the two devices). The guest holds the sandbox address of
the /30 and the fixed MAC GUEST_MAC (every VM is alone on its segment, and two sandboxes of one
template keep identical QEMU command lines); its interface, route and resolver are set by the
platform's own tools through the agent (``guest_commands``; the Debian cloud kernel has no
``ip=`` autoconfiguration, and virtio_net is a module the agent loads).

Inside a VM the guest's root owns the guest's network stack (raw sockets, IPv6, spoofed
addresses, another MAC): the tap filter is the only layer, and assumes nothing of the guest.

Owns: the VM's tap, its filter table and its link (through link.py). Must not touch QEMU's
process, jail or command line (qemu.py puts the NIC on the tap's descriptor, TAP_FD).
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import struct
import ipaddress
import subprocess
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from rollbox.backends.microvm.qemu import GUEST_MAC
from rollbox.config import Settings
from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import netns
from rollbox.netpolicy import link
from rollbox.netpolicy.bpf import COUNTERS, Entry
from rollbox.netpolicy.policy import parse_rules
from rollbox.netpolicy.sandbox_net import RESOLV_CONF, SandboxNetwork, close_stale
from rollbox.netpolicy.tapfilter import GUEST_IFACE, TapFilter

log = logging.getLogger(__name__)
COUNTS_MAX_AGE_S = 2.0  # audit(): drop counters older than this are read again (off the loop)
GUEST_IFACE_IN_VM = "eth0"  # virtio_net's first interface in the guest
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def netns_name(sandbox_id: str) -> str:
    return netns.PREFIX + sandbox_id


@dataclass(frozen=True)
class GuestConfig:
    """What the guest's interface must be set to (the sandbox end of the link)."""
    address: str  # A.B.C.D/30
    gateway: str
    iface: str = GUEST_IFACE_IN_VM

    def commands(self) -> list[list[str]]:
        """argv of the platform's own busybox applets (EXEC_PLATFORM_TOOL), in order."""
        return [["ip", "link", "set", self.iface, "up"],
                ["ip", "-4", "addr", "flush", "dev", self.iface],  # a template's, after a restore
                ["ip", "addr", "replace", self.address, "dev", self.iface],
                ["ip", "route", "replace", "default", "via", self.gateway, "dev", self.iface]]

    def resolv_conf(self) -> bytes:
        return f"nameserver {self.gateway}\noptions timeout:2 attempts:2\n".encode()


def open_tap(ns_name: str, name: str = GUEST_IFACE, ipv6_off: bool = True) -> int:
    """A new tap ``name`` inside the namespace, up; returns its descriptor (the tap lives as
    long as a descriptor of it: QEMU's, after the caller hands it over and closes its own).
    ipv6_off: IPv6 switched off in the namespace (no link-local addresses on its devices)."""
    def work() -> int:
        for key in ("all", "default") if ipv6_off else ():
            Path(f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6").write_text("1")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
        except BaseException:
            os.close(fd)
            raise
        return fd

    try:
        fd = netns.run_inside(ns_name, work)
    except OSError as exc:
        raise InfraError(f"tap in {ns_name} can not be made: {exc}") from None
    try:
        link._ip(["-n", ns_name, "link", "set", name, "up"])
    except BaseException:
        os.close(fd)
        raise
    return fd


class VmNetwork(SandboxNetwork):
    """A SandboxNetwork whose allow-list is the tap filter's set (no cgroup: the guest's
    sockets are not visible from the host, so what is in use is what the filter saw pass)."""

    filter: TapFilter

    def __init__(self, sandbox_id: str, lnk: link.Link, tap_filter: TapFilter,
                 settings: Settings) -> None:
        super().__init__(sandbox_id, lnk, tap_filter, settings, None, tap_filter)
        self.filter = tap_filter
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._counted_at = float("-inf")
        self._reading: asyncio.Future[dict[str, int]] | None = None
        self._lock = threading.RLock()

    def refresh_counts(self) -> dict[str, int]:
        """Read the filter's drop counters now (a subprocess in the namespace: blocking, call
        off the event loop); later audit() calls return them."""
        try:
            self._counts = self.filter.read()
        except InfraError as exc:  # the namespace is going: the last known counts
            log.debug("sandbox %s: counters: %s", self.sandbox_id, exc)
        self._counted_at = time.monotonic()
        return self._counts

    def audit(self) -> dict[str, int]:
        """As SandboxNetwork.audit, from the drop counters as last read: the edge calls this on
        its event loop (GET, its audit sweep), so a read older than COUNTS_MAX_AGE_S starts a
        new one off the loop instead of blocking (the figures lag by at most one read)."""
        if time.monotonic() - self._counted_at > COUNTS_MAX_AGE_S and self._reading is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.refresh_counts()  # no loop: a plain caller, read at once
            else:
                self._reading = loop.run_in_executor(None, self.refresh_counts)
                self._reading.add_done_callback(self._read_done)
        c = self._counts
        return {"dns_refused": self.gate.refused_count if self.gate is not None else 0,
                "connect_denied": c["connect4"] + c["connect6"],
                "sendmsg_denied": c["sendmsg4"] + c["sendmsg6"],
                "packets_dropped": c["egress"] + c["ingress"]}

    def _read_done(self, fut: asyncio.Future[dict[str, int]]) -> None:
        self._reading = None
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("sandbox %s: counters: %s", self.sandbox_id, fut.exception())

    @property
    def guest(self) -> GuestConfig:
        return GuestConfig(f"{self.link.sandbox_ip}/30", self.link.gate_ip)

    # The set's updates run nft (blocking): off the event loop, in threads (a DNS answer, the
    # expiry sweep, a policy change), one at a time.
    def _sync(self) -> None:
        with self._lock:
            want = self._desired()
            if want != self.filter.entries:
                self.filter.replace(want)  # one nft transaction
            self.current = want

    def apply(self, rules: list[str], sync: bool = True) -> dict[str, str]:
        with self._lock:
            return super().apply(rules, sync)

    def expire(self, now: float | None = None) -> int:
        with self._lock:
            return super().expire(now)

    def _admit(self, qname: str, addrs: list[ipaddress.IPv4Address],  # type: ignore[override]
               ttl: int) -> Awaitable[tuple[list[ipaddress.IPv4Address], int]]:
        """The gate's callback: the set updated in a thread before the answer leaves."""
        return asyncio.to_thread(super()._admit, qname, addrs, ttl)

    def in_use(self):  # type: ignore[no-untyped-def]
        try:
            return self.filter.active()
        except InfraError as exc:  # the namespace is going: nothing in use any more
            log.debug("sandbox %s: active set: %s", self.sandbox_id, exc)
            return set()


async def attach(sandbox_id: str, rules: list[str], settings: Settings
                 ) -> tuple[VmNetwork, int]:
    """Link, tap, filter, policy and DNS gate of a VM whose namespace exists (before QEMU
    starts). Returns the network and the tap's descriptor for QEMU (the caller closes its copy
    once QEMU has it). On any failure nothing is left but the namespace."""
    parse_rules(rules)  # bad input before anything is made
    ns = netns_name(sandbox_id)
    if not netns.netns_path(ns).exists():
        raise InfraError(f"sandbox {sandbox_id} has no network namespace")
    lnk = await asyncio.to_thread(link.create, sandbox_id, ns, settings, False)
    tap_fd = -1
    net: VmNetwork | None = None
    try:
        tap_fd = await asyncio.to_thread(open_tap, ns)
        flt = await asyncio.to_thread(TapFilter.install, ns, lnk.sandbox_ip, GUEST_MAC)
        net = VmNetwork(sandbox_id, lnk, flt, settings)
        await asyncio.to_thread(net.apply, rules)
        await net.start_gate()
        return net, tap_fd
    except BaseException:
        if net is not None:
            net.close()
        if tap_fd >= 0:
            os.close(tap_fd)
        await asyncio.to_thread(delete, sandbox_id)
        raise


async def adopt(sandbox_id: str, rules: list[str], settings: Settings) -> VmNetwork | None:
    """After an edge restart: the link and the filter table again (their set as it was), the
    policy re-resolved, addresses learned before kept for MAX_TTL, the gate restarted.
    None when the link or the table is gone (the caller tears the sandbox down: fail closed)."""
    close_stale(sandbox_id)
    lnk = await asyncio.to_thread(link.find, sandbox_id)
    if lnk is None:
        return None
    flt = await asyncio.to_thread(TapFilter.find, netns_name(sandbox_id), lnk.sandbox_ip,
                                  GUEST_MAC)
    if flt is None:
        return None
    net = VmNetwork(sandbox_id, lnk, flt, settings)
    try:
        old: set[Entry] = set(flt.entries)
        await asyncio.to_thread(net.apply, rules, False)
        net.current = old
        await asyncio.to_thread(net.relearn, old - net.resolved.entries)  # syncs the set
        await net.start_gate()
    except BaseException:
        net.close()
        raise
    return net


def refuse_late_attach(sandbox_id: str) -> BadRequest:
    """set_network on a VM created without a policy: it has no NIC (microvm has no hotplug)."""
    return BadRequest(f"microVM sandbox {sandbox_id} was created without a network policy, so "
                      "it has no network device; create it with a policy (allow=[] denies "
                      "everything) to change the policy later", sandbox_id=sandbox_id)


def delete(sandbox_id: str) -> list[str]:
    """With QEMU gone (its tap with it): remove the host end of the link (its peer goes with
    it) and the namespace (the filter table with it); returns what is left."""
    if link.exists(sandbox_id):
        subprocess.run(["ip", "link", "del", link.link_name(sandbox_id)], capture_output=True)
    netns.delete(netns_name(sandbox_id))
    left = leftovers(sandbox_id)
    if netns.netns_path(netns_name(sandbox_id)).exists():
        left.append(str(netns.netns_path(netns_name(sandbox_id))))
    return left


def leftovers(sandbox_id: str) -> list[str]:
    """What of the VM's network is still on the host (the namespace itself is lane vmm's)."""
    left = []
    if link.exists(sandbox_id):
        left.append(f"link {link.link_name(sandbox_id)}")
    return left


__all__ = ["GUEST_MAC", "GuestConfig", "RESOLV_CONF", "VmNetwork", "adopt", "attach",
           "delete", "leftovers", "netns_name", "open_tap", "refuse_late_attach"]
