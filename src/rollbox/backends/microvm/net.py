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
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollbox.backends.microvm.qemu import GUEST_MAC
from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import netns
from rollbox.netpolicy import link
from rollbox.netpolicy.bpf import Entry
from rollbox.netpolicy.policy import parse_rules
from rollbox.netpolicy.sandbox_net import RESOLV_CONF, SandboxNetwork, close_stale
from rollbox.netpolicy.tapfilter import GUEST_IFACE, TapFilter

log = logging.getLogger(__name__)
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
                 settings: object) -> None:
        super().__init__(sandbox_id, lnk, tap_filter, settings, None, tap_filter)
        self.filter = tap_filter

    @property
    def guest(self) -> GuestConfig:
        return GuestConfig(f"{self.link.sandbox_ip}/30", self.link.gate_ip)

    def _sync(self) -> None:
        want = self._desired()
        if want != self.filter.entries:
            self.filter.replace(want)  # one nft transaction
        self.current = want

    def in_use(self):  # type: ignore[no-untyped-def]
        try:
            return self.filter.active()
        except InfraError as exc:  # the namespace is going: nothing in use any more
            log.debug("sandbox %s: active set: %s", self.sandbox_id, exc)
            return set()


async def attach(sandbox_id: str, rules: list[str], settings: object
                 ) -> tuple[VmNetwork, int]:
    """Link, tap, filter, policy and DNS gate of a VM whose namespace exists (before QEMU
    starts). Returns the network and the tap's descriptor for QEMU (the caller closes its copy
    once QEMU has it). On any failure nothing is left but the namespace."""
    parse_rules(rules)  # bad input before anything is made
    ns = netns_name(sandbox_id)
    if not netns.netns_path(ns).exists():
        raise InfraError(f"sandbox {sandbox_id} has no network namespace")
    lnk = await asyncio.to_thread(link.create, sandbox_id, ns, False)
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


async def adopt(sandbox_id: str, rules: list[str], settings: object) -> VmNetwork | None:
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
