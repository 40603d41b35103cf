"""The microVM network on real jailed QEMU guests (TCG): the backend's NIC, tap, filter, DNS
gate and live policy change, with QEMU writing the guest's packets to the tap in the sandbox's
namespace. The guest is a busybox init (tests/helpers/vm_guest.py) that loads virtio_net and
runs one shell command per line it reads on the agent's port (a stand-in for the agent in a
test of the network around it); the guest's interface is set by the same GuestConfig commands
the backend runs through the real agent's platform tools. Its root is the guest's root: raw
sockets, another address, another MAC are all its to try."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.microvm import net as vmnet
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.config import REPO_ROOT
from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import netns
from rollbox.models import Resources
from rollbox.netpolicy import link
from rollbox.netpolicy.tapfilter import TABLE
from tests.conftest import TEST_NODE
from tests.helpers.vm_guest import MODULES, guest_or_skip, started_guest_backend
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

NET_MODULES = MODULES + ["net/core/failover.ko", "drivers/net/net_failover.ko",
                         "drivers/net/virtio_net.ko"]
SHELL_INIT = """#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_mmio virtio_console virtio_blk virtio_balloon failover \\
         net_failover virtio_net; do
  $B insmod /lib/modules/$m.ko
done
$B --install -s /bin
export PATH=/bin
ip link set lo up
n=0
while [ ! -e /sys/class/virtio-ports ] && [ $n -lt 100 ]; do sleep 0.05; n=$((n+1)); done
port=/dev/$(grep -l org.rollbox.agent /sys/class/virtio-ports/*/name | cut -d/ -f5)
exec 3<>$port
echo READY >&3
while IFS= read -r line <&3; do
  sh -c "$line" >&3 2>&3 </dev/null
  echo "END $?" >&3
done
"""


class GuestShell:
    """The host end of the test guest's command loop on the agent's port."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.lock = asyncio.Lock()

    async def _line(self) -> bytes:
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buf:
            chunk = await loop.sock_recv(self.sock, 65536)
            if not chunk:
                raise InfraError("guest port closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    async def sh(self, cmd: str, timeout: float = 30) -> tuple[int, str]:
        assert "\n" not in cmd
        async with self.lock:
            await asyncio.get_running_loop().sock_sendall(self.sock, cmd.encode() + b"\n")
            out: list[str] = []

            async def collect() -> int:
                while True:
                    line = (await self._line()).decode(errors="replace")
                    if line.startswith("END "):
                        return int(line[4:])
                    out.append(line)
            rc = await asyncio.wait_for(collect(), timeout)
        return rc, "\n".join(out)

    async def boot_info(self) -> SimpleNamespace:  # the agent's BOOT_INFO: no failed step
        return SimpleNamespace(errno=0, error="")

    def close(self) -> None:
        self.sock.close()


async def shell_connect(path: str, timeout: float) -> GuestShell:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    await loop.sock_connect(sock, path)
    shell = GuestShell(sock)
    try:
        assert await asyncio.wait_for(shell._line(), timeout) == b"READY"
    except BaseException:
        sock.close()
        raise
    return shell


class ShellGuestBackend(MicroVMBackend):
    """The backend, with the guest's network set through the test guest's shell (the same
    commands the real agent's platform tools run)."""

    async def configure_guest_network(self, vm: MicroVM, guest: vmnet.GuestConfig) -> None:
        for argv in guest.commands():
            rc, out = await vm.channel.sh(" ".join(argv))
            assert rc == 0, (argv, out)
        conf = guest.resolv_conf().decode().replace("\n", "\\n")
        rc, out = await vm.channel.sh(f"mkdir -p /etc; printf '{conf}' > {vmnet.RESOLV_CONF}")
        assert rc == 0, out


@pytest.fixture(scope="module")
def net_guest(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return guest_or_skip(tmp_path_factory.mktemp("netguest"), REPO_ROOT / "build" / "guest",
                         init=SHELL_INIT, modules=NET_MODULES)


@pytest.fixture
async def backend(tmp_node_dir: Path, net_guest: tuple[Path, Path]):  # noqa: ANN201
    async with started_guest_backend(tmp_node_dir, net_guest, shell_connect,
                                     ShellGuestBackend) as b:
        yield b


def spec(rules: list[str] | None) -> ResolvedSpec:
    return ResolvedSpec(image="test", layers=(), env={},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64),
                        network_rules=tuple(rules) if rules is not None else None)


async def tcp(vm: MicroVM, ip: str, port: int) -> str:
    """'ok <echo>' or 'fail' from inside the guest (busybox nc, 2 s connect timeout)."""
    rc, out = await vm.channel.sh(f"echo hi | timeout 4 nc -w 2 {ip} {port}")
    return f"ok {out.strip()}" if rc == 0 and out.strip() == "hi" else "fail"


def in_ns(sid: str, *argv: str) -> str:
    return subprocess.run(["nsenter", f"--net=/run/netns/{vmnet.netns_name(sid)}", *argv],
                          capture_output=True, text=True).stdout


@pytest.mark.microvm_slow  # (the default tier has the red team D25/D26 on a real guest)
async def test_vm_network_at_the_tap(backend: ShellGuestBackend, internet: FakeInternet,  # noqa: F811
                                     upstream: FakeUpstream) -> None:  # noqa: F811
    """One VM with a policy: allowed and refused destinations, the DNS gate opening a name,
    ICMP and spoofing by the guest's root, a live change cutting an open connection, and a
    teardown that leaves no tap, namespace, table or link."""
    a, b = internet.ips[0], internet.ips[1]
    sid = f"{TEST_NODE}vm{os.urandom(3).hex()}"
    vm = await backend.create(sid, spec([f"{a}:8080", "allowed.example:80"]))
    try:
        internet.route_from(sid)
        assert isinstance(vm.network, vmnet.VmNetwork)
        rc, out = await vm.channel.sh("ls /sys/class/net")
        assert sorted(out.split()) == ["eth0", "lo"], out
        # QEMU runs in the sandbox's namespace, where the tap and the filter are.
        assert os.stat(f"/proc/{vm.pid}/ns/net").st_ino == os.stat(
            netns.netns_path(vmnet.netns_name(sid))).st_ino
        assert f"netdev {TABLE}" in in_ns(sid, "nft", "list", "tables")
        assert await tcp(vm, a, 8080) == "ok hi"
        assert await tcp(vm, a, 443) == "fail"
        assert await tcp(vm, b, 8080) == "fail"
        # D25: the gated name's address is closed until the gate answered for it.
        assert await tcp(vm, a, 80) == "fail"
        rc, out = await vm.channel.sh(f"nslookup -type=a allowed.example "
                                      f"{vm.network.link.gate_ip}")
        assert rc == 0 and a in out, (out, upstream.log)
        rc, out = await vm.channel.sh(
            f"nslookup -type=a secret.exfil.example {vm.network.link.gate_ip}")
        assert rc != 0 and a not in out, out  # D26: REFUSED, never asked upstream
        assert upstream.names() == ["allowed.example"]
        assert await tcp(vm, a, 80) == "ok hi"
        # D30/ICMP and spoofing with the guest's root: nothing of it passes the tap.
        rc, out = await vm.channel.sh(f"ping -c 1 -W 2 {a}")
        assert rc != 0, out
        rc, out = await vm.channel.sh(
            f"ip addr add {b}/32 dev eth0 && echo hi | timeout 4 nc -w 2 -s {b} {a} 8080;"
            f" ip addr del {b}/32 dev eth0")
        assert "hi" not in out, out
        await asyncio.to_thread(vm.network.refresh_counts)
        audit = vm.network.audit()
        assert audit["connect_denied"] >= 3 and audit["dns_refused"] == 1, audit
        # D29: a connection open across a phase change is cut at once (it echoes a byte
        # every 0.1 s into /tmp/hold; it grows while allowed, and not after the change).
        rc, _ = await vm.channel.sh(
            f"((while true; do echo x; sleep 0.1; done) | nc {a} 8080 > /tmp/hold 2>&1 &)")
        assert rc == 0

        async def held() -> int:
            return int((await vm.channel.sh("wc -c < /tmp/hold"))[1].strip())
        await asyncio.sleep(2.0)
        before = await held()
        await asyncio.sleep(1.0)
        grown = await held()
        assert grown > before > 0, (before, grown)  # twin: alive while the policy allows it
        await backend.set_network(vm, [])
        await asyncio.sleep(0.5)  # what was in flight
        cut = await held()
        await asyncio.sleep(2.0)
        assert await held() == cut, "bytes still came through after the phase change"
        assert await tcp(vm, a, 8080) == "fail"
    finally:
        await backend.destroy(vm)
    assert backend.leftovers(sid) == []
    assert not netns.netns_path(vmnet.netns_name(sid)).exists()
    assert sid not in link.list_links().values()


@pytest.mark.microvm_slow  # (the default tier checks the argv has no NIC: unit test)
async def test_vm_without_policy_has_no_nic(backend: ShellGuestBackend) -> None:
    sid = f"{TEST_NODE}vm{os.urandom(3).hex()}"
    vm = await backend.create(sid, spec(None))
    try:
        rc, out = await vm.channel.sh("ls /sys/class/net")
        assert out.split() == ["lo"], out
        assert vm.network is None
        assert not link.exists(sid)
        with pytest.raises(BadRequest, match="without a network policy"):
            await backend.set_network(vm, ["1.2.3.4:80"])
    finally:
        await backend.destroy(vm)
    assert backend.leftovers(sid) == []


async def test_bad_rules_refused_before_anything(backend: ShellGuestBackend) -> None:
    sid = f"{TEST_NODE}vm{os.urandom(3).hex()}"
    with pytest.raises(BadRequest):
        await backend.create(sid, spec(["not a rule"]))
    assert backend.leftovers(sid) == []
    assert backend.slots._used == set()
