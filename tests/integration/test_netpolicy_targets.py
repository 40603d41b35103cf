"""Targets for network-policy tests that stay on this machine: a "fake internet" network
namespace made here (TEST-NET and benchmark addresses, echo servers inside), reached from a
sandbox by forwarding on the two links involved only (the host's ip_forward stays off), and a
fake upstream DNS server on loopback that logs every question it gets (UDP and TCP).
Also a self-test of both, so a broken target shows up as such and not as a policy bug."""
from __future__ import annotations

import secrets
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rdatatype
import dns.rrset
import pytest

from rollbox.netpolicy import link

PORTS = (80, 443, 8080)

SERVER = r"""
import socket, sys, threading
log = open(sys.argv[1], 'a', buffering=1)
ports = [int(p) for p in sys.argv[2].split(',')]
def echo(c, peer, port):
    with c:
        try:
            while data := c.recv(4096):
                c.sendall(data)
        except OSError:
            pass
def tcp(port):
    s = socket.create_server(('0.0.0.0', port), backlog=64)
    while True:
        c, peer = s.accept()
        log.write(f'tcp {c.getsockname()[0]}:{port} from {peer[0]}\n')
        threading.Thread(target=echo, args=(c, peer, port), daemon=True).start()
def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_IP, 8, 1)  # IP_PKTINFO: answer from the address asked
    s.bind(('0.0.0.0', port))
    while True:
        data, anc, _, peer = s.recvmsg(4096, 256)
        log.write(f'udp :{port} from {peer[0]} {data[:40]!r}\n')
        s.sendmsg([data], anc, 0, peer)
for p in ports:
    threading.Thread(target=tcp, args=(p,), daemon=True).start()
    threading.Thread(target=udp, args=(p,), daemon=True).start()
print('ready', flush=True)
threading.Event().wait()
"""


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


class FakeInternet:
    """A namespace with addresses ``ips`` (198.18.K.1-4) behind a veth, echo servers on
    PORTS (TCP and UDP) on all of them; ``log()`` lists what reached them."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns = f"rbtnet{tag}"
        self.host_if = f"rbtn{tag}"
        k = secrets.randbelow(256)
        base = secrets.randbelow(64) * 4
        self.host_ip = f"203.0.113.{base + 1}"
        self.far_ip = f"203.0.113.{base + 2}"
        self.ips = [f"198.18.{k}.{i}" for i in range(1, 5)]
        self.logfile = Path(tempfile.mkstemp(prefix="rbtnet-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            _run("ip", "netns", "add", self.ns)
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0",
                 "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            batch = (f"addr add {self.far_ip}/30 dev eth0\nlink set eth0 up\nlink set lo up\n"
                     + "".join(f"addr add {ip}/32 dev lo\n" for ip in self.ips)
                     + f"route add default via {self.host_ip}\n")
            subprocess.run(["ip", "-n", self.ns, "-b", "-"], input=batch.encode(), check=True,
                           capture_output=True)
            _run("ip", "route", "add", f"198.18.{k}.0/29", "via", self.far_ip)
            self._forwarding(self.host_if)
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, sys.executable, "-c", SERVER,
                 str(self.logfile), ",".join(map(str, PORTS))], stdout=subprocess.PIPE)
            assert self.proc.stdout is not None
            assert self.proc.stdout.readline().strip() == b"ready"
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _forwarding(ifname: str) -> None:
        # Per-link forwarding (IPv4 decides by the input link): only our own links forward.
        Path(f"/proc/sys/net/ipv4/conf/{ifname}/forwarding").write_text("1")

    def route_from(self, sandbox_id: str) -> None:
        """Let the sandbox's link forward to here (what ip_forward=1 does on a real node)."""
        self._forwarding(link.link_name(sandbox_id))

    def log(self) -> list[str]:
        return self.logfile.read_text().splitlines()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        subprocess.run(["ip", "route", "del", f"{self.ips[0].rsplit('.', 1)[0]}.0/29"],
                       capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        self.logfile.unlink(missing_ok=True)


class FakeUpstream:
    """A DNS server on loopback (UDP and TCP, one port) answering every A query with
    ``answer_ip`` (per-name overrides in ``answers``) and AAAA with ``2001:db8::1``; logs
    (transport, type, name) of every question."""

    def __init__(self, answer_ip: str, ttl: int = 60) -> None:
        self.answer_ip = answer_ip
        self.answers: dict[str, str] = {}
        self.ttl = ttl
        self.log: list[tuple[str, str, str]] = []
        upstream = self

        class Tcp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    n = struct.unpack(">H", self.request.recv(2))[0]
                    out = upstream._answer(self.request.recv(n), "tcp")
                    self.request.sendall(struct.pack(">H", len(out)) + out)
                except (OSError, struct.error):
                    pass

        # UDP and TCP on one port number: the UDP port is ephemeral, the same TCP port may be
        # taken by something else on the host, so pick again until both are free.
        for attempt in range(50):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.addr = self.udp.getsockname()
            self.tcp = socketserver.ThreadingTCPServer(self.addr, Tcp, bind_and_activate=False)
            self.tcp.allow_reuse_address = True
            try:
                self.tcp.server_bind()
                break
            except OSError:
                self.tcp.server_close()
                self.udp.close()
                if attempt == 49:
                    raise
        self.tcp.server_activate()
        threading.Thread(target=self.tcp.serve_forever, daemon=True).start()
        threading.Thread(target=self._serve_udp, daemon=True).start()

    def _answer(self, data: bytes, transport: str) -> bytes:
        q = dns.message.from_wire(data)
        qq = q.question[0]
        name = qq.name.to_text().rstrip(".")
        self.log.append((transport, dns.rdatatype.to_text(qq.rdtype), name))
        r = dns.message.make_response(q)
        if qq.rdtype == dns.rdatatype.A:
            r.answer.append(dns.rrset.from_text(qq.name, self.ttl, "IN", "A",
                                                self.answers.get(name, self.answer_ip)))
        elif qq.rdtype == dns.rdatatype.AAAA:
            r.answer.append(dns.rrset.from_text(qq.name, self.ttl, "IN", "AAAA", "2001:db8::1"))
        return r.to_wire()

    def _serve_udp(self) -> None:
        while True:
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            try:
                self.udp.sendto(self._answer(data, "udp"), peer)
            except Exception:  # noqa: BLE001 - a test server: keep serving
                pass

    def names(self) -> list[str]:
        return [n for _, _, n in self.log]

    def close(self) -> None:
        self.udp.close()
        self.tcp.shutdown()
        self.tcp.server_close()


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    net = FakeInternet()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def upstream(internet: FakeInternet, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> Iterator[FakeUpstream]:
    """A fake resolver the sandboxes' gates use (every name -> internet.ips[0]): the node's
    dns_upstream in the settings made from now on (ROLLBOX_DNS_UPSTREAM) and in those of the
    test's ``edge`` fixture, made before."""
    up = FakeUpstream(internet.ips[0])
    addr = f"{up.addr[0]}:{up.addr[1]}"
    monkeypatch.setenv("ROLLBOX_DNS_UPSTREAM", addr)
    if "edge" in request.fixturenames:
        monkeypatch.setattr(request.getfixturevalue("edge").settings, "dns_upstream", addr)
    try:
        yield up
    finally:
        up.close()


def test_targets_answer_from_the_host(internet: FakeInternet) -> None:
    """The namespace's servers answer (here from the host itself, no sandbox involved)."""
    with socket.create_connection((internet.ips[1], 8080), timeout=3) as s:
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(3)
        u.sendto(b"quic?", (internet.ips[2], 443))
        assert u.recvfrom(100)[0] == b"quic?"
    deadline = time.monotonic() + 2
    while len(internet.log()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(line.startswith(f"tcp {internet.ips[1]}:8080") for line in internet.log())


def test_fake_upstream_logs_udp_and_tcp() -> None:
    up = FakeUpstream("198.18.0.9")
    try:
        q = dns.message.make_query("a.example", "A")
        r = dns.query.udp(q, up.addr[0], port=up.addr[1], timeout=2)
        assert r.answer[0][0].address == "198.18.0.9"
        r = dns.query.tcp(dns.message.make_query("b.example", "TXT"), up.addr[0],
                          port=up.addr[1], timeout=2)
        assert up.log == [("udp", "A", "a.example"), ("tcp", "TXT", "b.example")]
    finally:
        up.close()


# Sandbox-side scripts (python3 inside the sandbox; argv after -c).
DNS_CLIENT = r"""
import json, random, socket, struct, sys
def query(name, qtype, tcp=False, timeout=3.0):
    server = open('/etc/resolv.conf').read().split()[1]
    msg = (struct.pack('>HHHHHH', random.randrange(65536), 0x0100, 1, 0, 0, 0)
           + b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0'
           + struct.pack('>HH', qtype, 1))
    try:
        if tcp:
            s = socket.create_connection((server, 53), timeout=timeout)
            s.sendall(struct.pack('>H', len(msg)) + msg)
            n = struct.unpack('>H', s.recv(2))[0]
            data = b''
            while len(data) < n:
                data += s.recv(n - len(data))
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(timeout)
            s.sendto(msg, (server, 53))
            data = s.recv(4096)
    except socket.timeout:
        return 'timeout'
    except OSError as e:
        return f'err {e.errno}'
    return f'rcode {data[3] & 15} answers {struct.unpack(">H", data[6:8])[0]}'
out = {}
for spec in json.loads(sys.argv[1]):
    name, qtype, tcp = spec[0], spec[1], spec[2]
    out[f"{name}/{qtype}/{'tcp' if tcp else 'udp'}"] = query(name, qtype, tcp, *spec[3:])
print(json.dumps(out))
"""

CONNECT = r"""
import socket, sys
proto = sys.argv[3] if len(sys.argv) > 3 else 'tcp'
try:
    if proto == 'tcp':
        s = socket.socket(); s.settimeout(3)
        s.connect((sys.argv[1], int(sys.argv[2]))); s.sendall(b'hi'); print('ok', s.recv(10).decode())
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        s.sendto(b'hi', (sys.argv[1], int(sys.argv[2]))); print('ok', s.recv(10).decode())
except socket.timeout:
    print('timeout')
except OSError as e:
    print('err', e.errno)
"""
