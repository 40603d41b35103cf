"""The DNS gate: one DNS server per sandbox, on the host end of its link (gate:53, UDP and TCP).

A query for a name the policy allows is resolved upstream (A records only), its addresses are
added to the sandbox's allow map for the name's ports *before* the answer is sent, and the
answer goes back with a TTL no longer than the addresses stay allowed. Any other name gets
REFUSED and is never sent upstream, whatever the transport or query type. AAAA, TXT, ANY and
other types of allowed names get an empty answer (NODATA) and are not forwarded either: the
sandbox link is IPv4 only and nothing but addresses is ever asked upstream. TCP DNS is served
the same way (bounded connections, idle timeout), so a host resolver listening on the wildcard
address never receives a sandbox's queries on the gate address.
"""
from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import struct
from collections.abc import Awaitable, Callable

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

log = logging.getLogger(__name__)
MAX_TTL = 300
UDP_PAYLOAD = 512  # a UDP answer larger than the client's limit is sent truncated (TC)
TCP_MAX_CONNS = 16  # per gate
TCP_IDLE_S = 10.0


def upstream(configured: str | None) -> tuple[str, int]:
    """``configured`` (``host[:port]``, the node's ``dns_upstream``), else the host's first
    resolv.conf nameserver."""
    if configured:
        host, _, port = (configured.rpartition(":") if configured.count(":") == 1
                         else (configured, "", "53"))
        return host, int(port or 53)
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return parts[1], 53
    except OSError:
        pass
    return "127.0.0.1", 53


# allowed(qname) -> whether the name may be resolved; admit(qname, addresses, ttl) -> (the
# addresses that may be answered (forbidden destinations left out), seconds they stay allowed),
# or an awaitable of it (an allow-list whose update blocks: a microVM's nft set).
Allowed = Callable[[str], bool]
Admitted = tuple[list[ipaddress.IPv4Address], int]
Admit = Callable[[str, list[ipaddress.IPv4Address], int], Admitted | Awaitable[Admitted]]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, gate: DnsGate) -> None:
        self.gate = gate
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        task = asyncio.ensure_future(self.gate.answer(data, tcp=False))
        self.gate.tasks.add(task)

        def done(t: asyncio.Future[bytes | None]) -> None:
            self.gate.tasks.discard(t)
            if not t.cancelled() and t.exception() is None and t.result() and self.transport:
                self.transport.sendto(t.result(), addr)
        task.add_done_callback(done)


class DnsGate:
    def __init__(self, bind_ip: str, allowed: Allowed, admit: Admit,
                 upstream_addr: tuple[str, int], port: int = 53) -> None:
        self.bind_ip = bind_ip
        self.port = port  # 0: a free one (tests), the same for UDP and TCP
        self.allowed = allowed
        self.admit = admit
        self.upstream = upstream_addr  # (host, port): upstream(settings.dns_upstream)
        self.transport: asyncio.DatagramTransport | None = None
        self.tcp: asyncio.Server | None = None
        self.tcp_conns = 0
        self.tasks: set[asyncio.Future] = set()  # type: ignore[type-arg]
        self.refused: list[str] = []  # recent refused names (bounded), for the audit trail
        self.refused_count = 0  # every REFUSED answer since the gate started

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.bind_ip, self.port))
        self.port = self.transport.get_extra_info("sockname")[1]
        try:
            self.tcp = await asyncio.start_server(self._serve_tcp, self.bind_ip, self.port,
                                                  reuse_address=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        for t in list(self.tasks):
            t.cancel()

    async def _serve_tcp(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.tcp_conns += 1
        try:
            if self.tcp_conns > TCP_MAX_CONNS:
                return
            while True:
                async with asyncio.timeout(TCP_IDLE_S):
                    head = await reader.readexactly(2)
                async with asyncio.timeout(TCP_IDLE_S):
                    wire = await reader.readexactly(struct.unpack(">H", head)[0])
                out = await self.answer(wire, tcp=True)
                if out is None:
                    return
                writer.write(struct.pack(">H", len(out)) + out)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.tcp_conns -= 1
            if task is not None:
                self.tasks.discard(task)
            writer.close()

    async def answer(self, wire: bytes, tcp: bool = False) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # noqa: BLE001 - garbage from the sandbox: no answer
            return None
        if len(query.question) != 1 or query.opcode() != 0:
            return _reply(query, dns.rcode.FORMERR)
        q = query.question[0]
        name = q.name.to_text().rstrip(".").lower()
        if not self.allowed(name):
            self.refused_count += 1
            self.refused.append(name)
            del self.refused[:-64]
            return _reply(query, dns.rcode.REFUSED)
        if q.rdtype != dns.rdatatype.A or q.rdclass != 1:
            return _reply(query, dns.rcode.NOERROR)  # NODATA, never forwarded
        up = dns.message.make_query(q.name, dns.rdatatype.A)
        try:
            resp = await dns.asyncquery.udp(up, self.upstream[0], port=self.upstream[1],
                                            timeout=3.0)
            if resp.flags & dns.flags.TC:
                resp = await dns.asyncquery.tcp(up, self.upstream[0], port=self.upstream[1],
                                                timeout=3.0)
        except Exception as exc:  # noqa: BLE001 - upstream trouble: SERVFAIL, the sandbox retries
            log.warning("DNS gate: upstream failed for %s: %s", name, exc)
            return _reply(query, dns.rcode.SERVFAIL)
        addrs: list[ipaddress.IPv4Address] = []
        ttl = MAX_TTL
        for rrset in resp.answer:
            if rrset.rdtype == dns.rdatatype.A:
                ttl = min(ttl, rrset.ttl)
                addrs.extend(ipaddress.IPv4Address(r.address) for r in rrset)
        # In the allow map before the answer leaves; answered TTL <= how long they stay allowed.
        admitted = self.admit(name, addrs, ttl)
        if inspect.isawaitable(admitted):
            admitted = await admitted
        addrs, keep = admitted
        out = _reply(query, dns.rcode.NOERROR if addrs or resp.rcode() == dns.rcode.NOERROR
                     else resp.rcode(), raw=True)
        if addrs:
            out.answer.append(dns.rrset.from_text_list(
                q.name, max(min(ttl, keep), 1), "IN", "A", [str(a) for a in addrs]))
        limit = 65535 if tcp else max(UDP_PAYLOAD, query.payload if query.edns >= 0 else 0)
        try:
            return out.to_wire(max_size=limit)
        except dns.exception.TooBig:
            out.answer.clear()
            out.flags |= dns.flags.TC  # the client retries over TCP
            return out.to_wire()


def _reply(query: dns.message.Message, rcode: int, raw: bool = False):
    r = dns.message.make_response(query)
    r.flags |= dns.flags.RA
    r.set_rcode(rcode)
    return r if raw else r.to_wire()
