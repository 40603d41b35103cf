"""The pure parts of the microVM network: set elements, nft JSON parsing, ruleset input checks,
the guest's configuration and QEMU's NIC arguments."""
from __future__ import annotations

import dataclasses
import ipaddress
import json

import pytest

from rollbox.backends.microvm import net as vmnet
from rollbox.backends.microvm import qemu
from rollbox.netpolicy import tapfilter
from rollbox.netpolicy.bpf import PROTO_TCP, PROTO_UDP, Entry


def e(proto: int, port: int, net: str) -> Entry:
    return Entry(proto, port, ipaddress.IPv4Network(net))


def test_elements_are_disjoint_per_protocol_and_port() -> None:
    got = tapfilter.elements([
        e(PROTO_TCP, 80, "198.18.0.0/24"), e(PROTO_TCP, 80, "198.18.0.5/32"),  # inside
        e(PROTO_TCP, 80, "198.18.1.0/24"),  # adjacent: merged
        e(PROTO_UDP, 80, "198.18.0.5/32"), e(PROTO_TCP, 443, "10.0.0.1/32"),
        e(1, 0, "0.0.0.0/0"),  # not TCP/UDP: never an element
    ])
    assert got == ["6 . 80 . 198.18.0.0/23", "6 . 443 . 10.0.0.1", "17 . 80 . 198.18.0.5"]


def test_replace_script_is_one_transaction() -> None:
    assert tapfilter.replace_script([]) == "flush set netdev rollbox_vm allow\n"
    s = tapfilter.replace_script([e(PROTO_TCP, 80, "1.2.3.4/32")])
    assert s.splitlines() == ["flush set netdev rollbox_vm allow",
                              "add element netdev rollbox_vm allow { 6 . 80 . 1.2.3.4 }"]


def test_parse_set_reads_what_nft_lists() -> None:
    listing = {"nftables": [{"metainfo": {}}, {"set": {"name": "allow", "elem": [
        {"concat": ["tcp", 8080, {"prefix": {"addr": "198.18.0.0", "len": 24}}]},
        {"concat": ["udp", 53, "10.0.0.1"]},
        {"concat": ["tcp", 80, {"range": ["10.0.0.0", "10.0.0.2"]}]},
        {"concat": ["tcp", 80]},  # malformed: ignored
    ]}}]}
    assert tapfilter.parse_set(json.dumps(listing)) == {
        e(PROTO_TCP, 8080, "198.18.0.0/24"), e(PROTO_UDP, 53, "10.0.0.1/32"),
        e(PROTO_TCP, 80, "10.0.0.0/31"), e(PROTO_TCP, 80, "10.0.0.2/32")}


@pytest.mark.parametrize("ip,mac", [("10.0.0.2; flush ruleset", "52:54:00:00:00:01"),
                                    ("10.0.0.2", "52:54:00:00:00:01 drop"),
                                    ("::1", "52:54:00:00:00:01"), ("10.0.0.2", "52:54:00")])
def test_ruleset_refuses_what_is_not_an_address(ip: str, mac: str) -> None:
    with pytest.raises(ValueError):
        tapfilter.ruleset(ip, mac)


def test_ruleset_skip_removes_only_that_rule() -> None:
    full = tapfilter.ruleset("10.0.0.2", vmnet.GUEST_MAC)
    for rule in tapfilter.RULES:
        less = tapfilter.ruleset("10.0.0.2", vmnet.GUEST_MAC, skip=frozenset({rule}))
        assert less != full
        assert len(less.splitlines()) == len(full.splitlines()) - (
            0 if rule in ("arp", "allow_out", "allow_in") else 1)  # those become "pass all"
    assert "policy drop" in full and full.count("fwd to") == 4


def test_guest_config_and_qemu_args() -> None:
    g = vmnet.GuestConfig("10.213.0.6/30", "10.213.0.5")
    assert g.commands()[-1] == ["ip", "route", "replace", "default", "via", "10.213.0.5",
                                "dev", "eth0"]
    assert g.resolv_conf().startswith(b"nameserver 10.213.0.5\n")
    m = qemu.MachineSpec(cpus=1, memory_mib=256, layers=1)
    assert "-netdev" not in qemu.argv(m)  # no policy: no network device at all
    with_nic = qemu.argv(dataclasses.replace(m, nic=True))
    assert with_nic[-4:] == ["-netdev", f"tap,id=net0,fd={qemu.TAP_FD},vhost=off", "-device",
                             f"virtio-net-device,netdev=net0,mac={vmnet.GUEST_MAC}"]
