"""Host side of a sandbox's network link: a veth pair, a /30 from the link pool, NAT.

The host end is ``rbx<hash of the sandbox id>`` with the alias ``rollbox:<id>`` (so a leaked
link names its sandbox); the sandbox end is ``eth0`` inside ``rollbox-<id>``. The host end's
address is the sandbox's gate (DNS gate, local mirrors). One host-wide nftables table
per host range (``ip rollbox`` for the default ``net_host_range``; the same for every edge of
that range) holds: local-mirror DNAT (gate:port ->
127.0.0.1:port, ports listed in a set), sandbox-to-sandbox forward drop (any two ``rbx`` links,
of one edge or two, and anything into the host's ``net_host_range``), masquerade to the
outside. Each edge takes its links' /30s from its own subnet (``net_pool``). Forwarding to the outside needs
``net.ipv4.ip_forward=1``, written only when the node's ``net_forward`` is on
(``ROLLBOX_NET_FORWARD``, the operator's choice).
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from rollbox.config import VARS, Settings
from rollbox.errors import InfraError
from rollbox.netpolicy.policy import host_addresses

LOCK_NAME = "net.lock"  # in the host dir (ROLLBOX_HOST_DIR): one lock for every edge of the host
LINK_PREFIX = "rbx"
ALIAS_PREFIX = "rollbox:"
SANDBOX_IFACE = "eth0"
NFT_TABLE = "rollbox"
NETNS_PREFIX = "rollbox-"  # rollbox.isolation.netns.PREFIX
DEFAULT_HOST_RANGE = VARS["net_host_range"].default
_thread_lock = threading.Lock()
_nft_ready: set[str] = set()  # tables made by this process


def link_name(sandbox_id: str) -> str:
    return LINK_PREFIX + hashlib.sha1(sandbox_id.encode()).hexdigest()[:11]


@dataclass(frozen=True)
class Link:
    sandbox_id: str
    host_if: str
    gate_ip: str
    sandbox_ip: str


def _ip(args: list[str], batch: str | None = None) -> str:
    proc = subprocess.run(["ip", *args], input=batch, capture_output=True, text=True)
    if proc.returncode != 0:
        raise InfraError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _nft(script: str) -> None:
    proc = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
    if proc.returncode != 0:
        raise InfraError(f"nft failed: {proc.stderr.strip()}")


def table_name(settings: Settings) -> str:
    """The nftables table of the node's host range: ``rollbox`` for the default range, else
    one named after the range (edges of other ranges on the host keep their own rules)."""
    rng = settings.net_host_range
    if rng == DEFAULT_HOST_RANGE:
        return NFT_TABLE
    return f"{NFT_TABLE}_{str(rng).replace('.', '_').replace('/', '_')}"


def ensure_node_tables(settings: Settings) -> None:
    """The table of the node's host range (idempotent; kept for the host's uptime, it only
    names rbx links and the range every edge of the range takes its subnet from, so every
    such edge writes the same rules)."""
    table = table_name(settings)
    if table in _nft_ready:
        return
    pool = settings.net_host_range
    _nft(f"""
table ip {table} {{
  set mirror_ports {{ type inet_service; }}
  chain prerouting {{ type nat hook prerouting priority dstnat; }}
  chain postrouting {{ type nat hook postrouting priority srcnat; }}
  chain forward {{ type filter hook forward priority filter; }}
}}
flush chain ip {table} prerouting
flush chain ip {table} postrouting
flush chain ip {table} forward
add rule ip {table} prerouting iifname "{LINK_PREFIX}*" fib daddr type local tcp dport @mirror_ports dnat to 127.0.0.1
add rule ip {table} forward iifname "{LINK_PREFIX}*" oifname "{LINK_PREFIX}*" drop
add rule ip {table} forward iifname "{LINK_PREFIX}*" ip daddr {pool} drop
add rule ip {table} postrouting ip saddr {pool} oifname != "{LINK_PREFIX}*" masquerade
""")
    if settings.net_forward:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    _nft_ready.add(table)


def allow_local_mirror_ports(ports: set[int], settings: Settings) -> None:
    if ports:
        ensure_node_tables(settings)
        _nft(f"add element ip {table_name(settings)} mirror_ports "
             f"{{ {', '.join(map(str, sorted(ports)))} }}\n")


def _sysctl_iface(name: str, key: str, value: str) -> None:
    Path(f"/proc/sys/net/ipv4/conf/{name}/{key}").write_text(value)


def create(sandbox_id: str, netns_name: str, settings: Settings,
           inner_address: bool = True) -> Link:
    """veth pair + addresses + default route inside; the /30 is chosen under a host lock in
    the node's own subnet (``net_pool``; the lock and the check against the host's addresses
    keep even edges that share a subnet from taking one /30 twice). inner_address=False: the namespace end is only brought up (a
    microVM's guest holds the sandbox address, its packets forwarded to this end by
    tapfilter.py)."""
    ensure_node_tables(settings)
    name = link_name(sandbox_id)
    pool = settings.net_pool
    blocks = pool.num_addresses // 4
    start = int(hashlib.sha1(sandbox_id.encode()).hexdigest(), 16) % blocks
    lock_path = settings.host_dir / LOCK_NAME  # not in a run dir: a run tmpfs would hide it
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with _thread_lock, open(lock_path, "a") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        used = host_addresses()
        for k in range(blocks):
            base = int(pool.network_address) + ((start + k) % blocks) * 4
            gate = ipaddress.IPv4Address(base + 1)
            if gate not in used:
                break
        else:
            raise InfraError("network link pool exhausted")
        inner = ipaddress.IPv4Address(base + 2)
        try:
            _ip(["-b", "-"], batch=(
                f"link add {name} type veth peer name {SANDBOX_IFACE} netns {netns_name}\n"
                f"link set {name} alias {ALIAS_PREFIX}{sandbox_id}\n"
                f"addr add {gate}/30 dev {name}\n"
                f"link set {name} up\n"))
        except BaseException:
            delete(sandbox_id)
            raise
    try:
        _sysctl_iface(name, "route_localnet", "1")  # only for the mirror DNAT above
        _ip(["-n", netns_name, "-b", "-"], batch=(
            f"addr add {inner}/30 dev {SANDBOX_IFACE}\n"
            f"link set {SANDBOX_IFACE} up\n"
            f"route add default via {gate}\n") if inner_address else (
            f"link set {SANDBOX_IFACE} up\n"))
    except BaseException:
        delete(sandbox_id)
        raise
    return Link(sandbox_id, name, str(gate), str(inner))


def find(sandbox_id: str) -> Link | None:
    """The link of a sandbox started by an earlier edge process, if it still exists."""
    name = link_name(sandbox_id)
    try:
        info = json.loads(_ip(["-j", "-4", "addr", "show", "dev", name]))
    except InfraError:
        return None
    for it in info:
        for a in it.get("addr_info", []):
            gate = ipaddress.IPv4Address(a["local"])
            return Link(sandbox_id, name, str(gate), str(gate + 1))
    return None


def delete(sandbox_id: str) -> None:
    """Destroy the sandbox's remaining sockets, remove the host end (the peer goes with it);
    no error if it is already gone. Call with no process of the sandbox left."""
    if not exists(sandbox_id):
        return  # the common case (no network): no subprocess
    drop_sockets(NETNS_PREFIX + sandbox_id)
    subprocess.run(["ip", "link", "del", link_name(sandbox_id)], capture_output=True)


def drop_sockets(netns_name: str) -> None:
    """Abort every TCP/UDP socket left in the namespace (SOCK_DESTROY). A closed connection
    whose FIN the allow-list drops stays an orphan retransmitting for minutes, and it holds
    the sandbox's cgroup, so its BPF programs and map, and its netns, long after deletion."""
    if Path(f"/run/netns/{netns_name}").exists():
        subprocess.run(["ip", "netns", "exec", netns_name, "ss", "-K", "-a", "-t", "-u"],
                       capture_output=True)


def exists(sandbox_id: str) -> bool:
    return Path(f"/sys/class/net/{link_name(sandbox_id)}").exists()


def list_links() -> dict[str, str]:
    """Every rollbox link on the host: interface name -> sandbox id (from its alias)."""
    out: dict[str, str] = {}
    for d in Path("/sys/class/net").iterdir():
        if d.name.startswith(LINK_PREFIX):
            try:
                alias = (d / "ifalias").read_text().strip()
            except OSError:
                alias = ""
            out[d.name] = alias[len(ALIAS_PREFIX):] if alias.startswith(ALIAS_PREFIX) else ""
    return out
