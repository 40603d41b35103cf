"""Rule parsing and resolution: typed errors, forbidden destinations cut out, mirror env."""
from __future__ import annotations

import ipaddress

import pytest

from rollbox.config import Settings
from rollbox.errors import BadRequest
from rollbox.netpolicy.policy import Forbidden, parse_rule, parse_rules, resolve


@pytest.mark.parametrize("bad", ["nosuch", "x:0", "x:70000", "1.2.3.4/33:80", "1.2.3.4/8:80",
                                 "a b:80", "1.2.3.4:80/icmp", "", "*.:80"])
def test_bad_rules(bad: str) -> None:
    with pytest.raises(BadRequest):
        parse_rule(bad)


def test_resolution_cuts_forbidden_and_maps_mirror() -> None:
    s = Settings()
    s.mirrors = {"pypi": "http://127.0.0.1:3141/simple/"}
    forb = Forbidden([ipaddress.IPv4Network("10.213.0.0/16"),
                      ipaddress.IPv4Network("127.0.0.0/8")],
                     {ipaddress.IPv4Address("192.0.2.2")}, {7420})
    res = resolve(parse_rules(["pypi", "0.0.0.0/0:7420", "*.example.org:443/udp"]),
                  "10.213.0.1", s, forb)
    assert res.env["PIP_INDEX_URL"] == "http://10.213.0.1:3141/simple/"
    nets = [e.net for e in res.entries if e.port == 7420]
    host = ipaddress.IPv4Address("192.0.2.2")
    assert not any(host in n for n in nets)
    assert not any(ipaddress.IPv4Address("10.213.5.6") in n for n in nets)
    assert any(ipaddress.IPv4Address("8.8.8.8") in n for n in nets)
    assert res.name_ports("a.example.org.") == {(17, 443)}
    assert res.name_ports("example.org") == set()


def test_permission_without_mirror_is_bad_request() -> None:
    s = Settings()
    s.mirrors = {}
    with pytest.raises(BadRequest, match="no mirror"):
        resolve(parse_rules(["npm"]), "10.213.0.1", s, Forbidden([], set(), set()))


def test_host_addresses_and_metadata_cut_unless_named_exactly() -> None:
    host = ipaddress.IPv4Address("192.0.2.2")
    forb = Forbidden([ipaddress.IPv4Network("10.213.0.0/16"),
                      ipaddress.IPv4Network("169.254.0.0/16")], {host}, {7420})
    wide = forb.cut(ipaddress.IPv4Network("0.0.0.0/0"), 22, explicit=True)
    assert not any(host in n for n in wide)  # a host service on 0.0.0.0:22: not via /0
    assert not any(ipaddress.IPv4Address("169.254.169.254") in n for n in wide)
    exact = ipaddress.IPv4Network("192.0.2.2/32")
    assert forb.cut(exact, 22, explicit=True) == [exact]  # named exactly: deliberate
    assert forb.cut(exact, 7420, explicit=True) == []  # never the platform's port
    assert forb.cut(exact, 22) == []  # a DNS answer naming a host address
    s = Settings()
    res = resolve(parse_rules(["0.0.0.0/0:80"]), "10.213.0.1", s)  # the real forbidden set
    assert not any(ipaddress.IPv4Address("169.254.169.254") in e.net for e in res.entries)
