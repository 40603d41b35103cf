"""The DNS gate alone (loopback, free port, a logging fake upstream): refused names never go
upstream over UDP or TCP, only A questions are forwarded, admitted addresses bound the TTL, a
large answer is truncated over UDP and whole over TCP."""
from __future__ import annotations

import ipaddress

import dns.asyncquery
import dns.flags
import dns.message
import dns.rcode

from rollbox.netpolicy.gate import DnsGate, upstream
from tests.integration.test_netpolicy_targets import FakeUpstream


async def test_gate_refuses_forwards_truncates() -> None:
    up = FakeUpstream("198.18.0.1", ttl=3600)
    admitted: list[tuple[str, int]] = []

    def admit(name: str, addrs: list[ipaddress.IPv4Address],
              ttl: int) -> tuple[list[ipaddress.IPv4Address], int]:
        admitted.append((name, ttl))
        return addrs, 40

    gate = DnsGate("127.0.0.1", lambda n: n.endswith("ok.example"), admit, up.addr, port=0)
    await gate.start()
    try:
        async def ask(name: str, rdtype: str, tcp: bool = False) -> dns.message.Message:
            q = dns.message.make_query(name, rdtype, use_edns=False)
            f = dns.asyncquery.tcp if tcp else dns.asyncquery.udp
            return await f(q, "127.0.0.1", port=gate.port, timeout=3)

        for tcp in (False, True):
            for rdtype in ("A", "AAAA", "TXT", "ANY"):
                r = await ask("leak.secret.example", rdtype, tcp)
                assert r.rcode() == dns.rcode.REFUSED and not r.answer
        r = await ask("ok.example", "A", tcp=True)
        assert r.rcode() == dns.rcode.NOERROR and r.answer[0].ttl == 40
        assert r.answer[0][0].address == "198.18.0.1"
        r = await ask("ok.example", "AAAA")
        assert r.rcode() == dns.rcode.NOERROR and not r.answer
        assert up.log == [("udp", "A", "ok.example")]
        assert admitted == [("ok.example", 300)]  # upstream TTL capped before admission
        # 60 addresses do not fit 512 bytes: TC over UDP, the whole answer over TCP.
        up.answers["big.ok.example"] = "198.18.0.2"
        many = [ipaddress.IPv4Address(f"198.18.1.{i}") for i in range(60)]
        gate.admit = lambda n, a, t: (many, 40)  # type: ignore[method-assign]
        r = await ask("big.ok.example", "A")
        assert r.flags & dns.flags.TC and not r.answer
        r = await ask("big.ok.example", "A", tcp=True)
        assert len(r.answer[0]) == 60
        assert gate.refused[-1] == "leak.secret.example"
    finally:
        gate.close()
        up.close()


def test_the_upstream_is_the_configured_one_else_resolv_conf() -> None:
    assert upstream("10.0.0.53:5353") == ("10.0.0.53", 5353)
    assert upstream("10.0.0.53") == ("10.0.0.53", 53)
    host, port = upstream(None)
    assert port == 53 and ipaddress.ip_address(host)
