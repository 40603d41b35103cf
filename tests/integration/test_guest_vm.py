"""The agent as a real microVM's init: QEMU ``-M microvm`` (TCG, one vCPU, the PVH vmlinux and
initramfs of ``make guest``, the kernel command line of backends/microvm/qemu.py), the
busybox:test layer as read-only virtio-blk, an ext4 writable disk the host only mkfs'd, the
agent's virtio-serial port on a unix socket. Two boots: one serves every test of the
module, one with a layer that is not EROFS. QEMU here is unjailed on purpose: this tests the
guest side; the jailed launcher is backends/microvm (test_microvm_backend.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import signal
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel, Session, SpawnError
from rollbox.backends.microvm import qemu
from rollbox.config import Settings
from rollbox.errors import InfraError
from rollbox.guest import build as guest_build
from rollbox.guest.artifacts import GuestArtifacts
from rollbox.images.store import ImageStore
from tests.conftest import have_image
from tests.integration.test_agent_stream import reattach

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mkfs, QEMU devices)"),
    pytest.mark.skipif(not have_image("busybox:test"), reason="needs the busybox:test image"),
]
BOOT_TIMEOUT_S = 90.0  # TCG on a shared 2-core machine


@dataclass
class Guest:
    proc: subprocess.Popen[bytes]
    sock: Path
    console: Path

    async def connect(self, timeout: float = BOOT_TIMEOUT_S) -> AgentChannel:
        deadline = time.monotonic() + timeout
        while True:  # QEMU binds the path before it listens: refused until then
            assert self.proc.poll() is None, f"QEMU died: {self.console.read_text()}"
            assert time.monotonic() < deadline, "no agent socket"
            if self.sock.exists():
                try:
                    return await AgentChannel.connect_stream(
                        str(self.sock), timeout=max(1.0, deadline - time.monotonic()))
                except InfraError as exc:
                    if "ConnectionRefused" not in exc.message:
                        raise
            await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def artifacts() -> GuestArtifacts:
    settings = Settings()
    if not settings.vm_guest_manifest.exists():
        guest_build.build(settings)  # what `make guest` does (make test runs it first)
    return GuestArtifacts.load(settings)


@contextlib.contextmanager
def booted(artifacts: GuestArtifacts, workdir: Path, layers: list[Path]) -> Iterator[Guest]:
    """One microVM with these layer files and a fresh writable disk; killed and its files
    removed on exit, also when the test fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    rw, sock, console = workdir / "rw.img", workdir / "agent.sock", workdir / "console.log"
    with open(rw, "wb") as f:
        f.truncate(256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", str(rw)], check=True)
    spec = qemu.MachineSpec(cpus=1, memory_mib=256, layers=len(layers),
                            tsc_khz=qemu.host_tsc_khz())
    argv = ["qemu-system-x86_64", "-M", "microvm,rtc=on,x-option-roms=off", "-accel", "tcg",
            "-cpu", qemu.TCG_CPU, "-smp", "1", "-m", "256",
            *qemu.firmware_args(shutil.which("qemu-system-x86_64") or ""),
            "-nodefaults", "-no-user-config",
            "-nographic", "-no-reboot", "-serial", f"file:{console}",
            "-kernel", str(artifacts.kernel), "-initrd", str(artifacts.initramfs),
            "-append", qemu.kernel_cmdline(spec),
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=agent,path={sock},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={qemu.AGENT_PORT}"]
    for i, layer in enumerate(layers):
        argv += ["-drive", f"id=layer{i},file={layer},format=raw,if=none,readonly=on",
                 "-device", f"virtio-blk-device,drive=layer{i},serial=layer{i}"]
    argv += ["-drive", f"id=rw,file={rw},format=raw,if=none",
             "-device", "virtio-blk-device,drive=rw,serial=rw"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield Guest(proc, sock, console)
    finally:
        proc.kill()
        proc.wait()
        for f in (rw, sock):
            f.unlink(missing_ok=True)


def busybox_layers() -> list[Path]:
    store = ImageStore(Settings().images_dir)
    return [store.layer_path(d) for d in store.resolve("busybox:test").layers]


@pytest.fixture(scope="module")
def vm(artifacts: GuestArtifacts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    with booted(artifacts, tmp_path_factory.mktemp("vm"), busybox_layers()) as g:
        yield g


@pytest.fixture
async def ch(vm: Guest) -> AsyncIterator[AgentChannel]:
    channel = await vm.connect()
    try:
        yield channel
    finally:
        channel.close()


ENV = ["PATH=/bin"]
# Bounds on each command here (each ends within ~5 s under load, ~0.5 s alone): the agent's own
# deadline ends one that hangs in the guest (reported `timed_out`); the host's, past it, fails
# the test naming what did not end and how far it got: then the agent itself stopped answering.
COMMAND_MS = 30_000
HOST_WAIT_S = 60.0


class GuestStalled(AssertionError):
    """A command did not start or end within HOST_WAIT_S (the agent did not answer)."""


async def start(ch: AgentChannel, req: P.ExecRequest) -> Session:
    try:
        async with asyncio.timeout(HOST_WAIT_S):
            return await ch.exec(req)
    except TimeoutError:
        raise GuestStalled(f"{req.argv}: not started within {HOST_WAIT_S:.0f} s") from None


async def finish(sess: Session, what: object, stdin: bytes | None = None
                 ) -> tuple[bytes, P.Exited]:
    """Write ``stdin`` (then close it) and read the session to its exit: its stdout and exit."""
    out = bytearray()
    waiting = "for it to take its stdin" if stdin is not None else "for its exit"
    try:
        async with asyncio.timeout(HOST_WAIT_S):
            if stdin is not None:
                await sess.write_stdin(stdin)
                await sess.close_stdin()
                waiting = "for its exit"
            async for kind, value in sess.events():
                if kind == "exited":
                    return bytes(out), value
                if kind == "stdout":
                    out += value
    except TimeoutError:
        raise GuestStalled(
            f"{what} (pid {sess.pid} in the guest): waited {HOST_WAIT_S:.0f} s {waiting}, "
            f"{len(out)} bytes of stdout so far, {sess.stdin_unacked} bytes of stdin not "
            "acknowledged") from None
    raise AssertionError(f"{what}: no exit")


async def sh(ch: AgentChannel, cmd: str, **kw: object) -> tuple[bytes, P.Exited]:
    kw.setdefault("timeout_ms", COMMAND_MS)
    sess = await start(ch, P.ExecRequest(argv=["sh", "-c", cmd], env=ENV, **kw))  # type: ignore
    return await finish(sess, cmd)


async def test_boot_builds_the_sandbox_root_and_reports_its_steps(ch: AgentChannel) -> None:
    info = await ch.boot_info()
    assert info.errno == 0 and info.error == "", info
    assert 0 < info.init_ns <= info.modules_ns <= info.disks_ns <= info.mounts_ns <= \
        info.ready_ns <= info.now_ns
    print(f"guest boot (ms since kernel start): init {info.init_ns / 1e6:.0f}, "
          f"modules {info.modules_ns / 1e6:.0f}, disks {info.disks_ns / 1e6:.0f}, "
          f"mounts {info.mounts_ns / 1e6:.0f}, ready {info.ready_ns / 1e6:.0f}")
    out, ex = await sh(ch, "id -u; cat /proc/self/cgroup; ls /; grep ' / ' /proc/mounts; "
                           "test -e /platform || test -e /init || echo confined")
    lines = out.decode().splitlines()
    assert ex.exit_code == 0 and lines[0] == "0"
    assert lines[1].startswith("0::/rollbox/s")  # its own session cgroup, made in the guest
    assert "bin" in lines and "init" not in lines  # the image's root, not the initramfs
    root = next(line for line in lines if line.startswith("overlay / overlay"))
    assert "lowerdir=/layers/0" in root and "upperdir=/rw/upper" in root
    assert lines[-1] == "confined"
    # the writable layer is the ext4 disk: what a command writes lands there
    out, ex = await sh(ch, "echo kept > /root/f; cat /root/f; grep ' /rw ' /proc/mounts || "
                           "echo no-rw-in-sandbox")
    assert out.decode().splitlines() == ["kept", "no-rw-in-sandbox"]


async def test_guest_cpu_is_x86_64_v2(ch: AgentChannel) -> None:
    """The backend's TCG CPU model (qemu.TCG_CPU) gives guest userspace x86-64-v2 (wheels
    and browsers built for it), and is AMD: no page table isolation in the guest kernel."""
    out, ex = await sh(ch, "grep -m1 '^flags' /proc/cpuinfo; grep -m1 '^vendor_id' /proc/cpuinfo")
    flags, vendor = out.decode().splitlines()
    assert ex.exit_code == 0
    assert {"ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"} <= set(flags.split()), flags
    assert "AuthenticAMD" in vendor and "pti" not in flags.split()


async def test_stdin_timeout_and_oom_inside_the_guest(ch: AgentChannel) -> None:
    sess = await start(ch, P.ExecRequest(argv=["sha256sum"], env=ENV, stdin=True,
                                         timeout_ms=COMMAND_MS))
    data = os.urandom(300_000)  # past the stdin window: credit flows back over the port
    out, ex = await finish(sess, "sha256sum", stdin=data)
    assert not ex.timed_out and out.split()[0].decode() == hashlib.sha256(data).hexdigest()

    # A timeout kills the session's whole cgroup, background processes included.
    t0 = time.monotonic()
    _, ex = await sh(ch, "sleep 100 & sleep 100", timeout_ms=500)
    assert ex.timed_out and ex.signal == signal.SIGKILL and time.monotonic() - t0 < 20
    out, _ = await sh(ch, "ps -o comm | grep -c '^sleep' || true")
    assert out.strip() == b"0"

    # OOM in the session's cgroup is reported with the exit. awk holds 8 MiB, then sets a
    # 4 MiB limit on its own cgroup: the write's reclaim evicts the cgroup's file pages (every
    # other task of it waits), finds nothing more and OOM-kills the writer, the largest.
    # Not a limit first and a pipeline growing into it: a reused cgroup carries ~1.7 MiB of
    # busybox text earlier commands charged to it, which each charge's reclaim evicts and the
    # pipeline re-faults from the emulated disk, and a charge whose reclaim evicted anything
    # retries without the OOM killer (under load: 68k refaults, 400k pages scanned and 12 s
    # for one command; once the whole 30 s, no OOM).
    cg = "/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)"
    out, ex = await sh(ch, f"cat /proc/self/cgroup; echo 0 > {cg}/memory.swap.max 2>/dev/null; "
                           f"awk -v f={cg}/memory.max 'BEGIN {{ s = \"x\"; "
                           "while (length(s) < 6000000) s = s s; "
                           "printf \"4M\" > f; close(f); print \"survived\" }'; echo $?")
    assert ex.oom_kills == 1 and not ex.timed_out and ex.exit_code == 0, (out, ex)
    oom_cgroup, *status = out.split()
    assert status == [b"137"], out  # awk, SIGKILLed in its write
    # Session cgroups are reused once empty (making one costs ~35 ms under TCG): the next
    # command, in the same cgroup, gets the default limits back and counts only its own OOM
    # kills (the cgroup's memory.events still has the one above).
    out, ex = await sh(ch, f"cat /proc/self/cgroup {cg}/memory.max {cg}/pids.max; "
                           f"grep '^oom_kill ' {cg}/memory.events")
    path, mem_max, pids_max, _, kills = out.split()
    assert (path, mem_max, pids_max) == (oom_cgroup, b"max", b"max") and int(kills) >= 1, out
    assert ex.oom_kills == 0, ex
    # ... and its protection from reclaim, OOM grouping and CPU share back at their defaults.
    # (An idle group reads cpu.weight 0, so the weight is read before cpu.idle is set.)
    knobs = " ".join(f"{cg}/{k}" for k in ("memory.min", "memory.low", "memory.oom.group",
                                           "cpu.weight", "cpu.idle"))
    out, _ = await sh(ch, f"cat /proc/self/cgroup; echo 1M > {cg}/memory.min; "
                          f"echo 2M > {cg}/memory.low; echo 1 > {cg}/memory.oom.group; "
                          f"echo 50 > {cg}/cpu.weight; cat {knobs}; echo 1 > {cg}/cpu.idle; "
                          f"cat {cg}/cpu.idle")
    path, *changed = out.split()
    assert changed == [b"1048576", b"2097152", b"1", b"50", b"0", b"1"], out  # the writes took
    out, _ = await sh(ch, f"cat /proc/self/cgroup {knobs}")
    assert out.split() == [path, b"0", b"0", b"0", b"100", b"0"], out
    first, _ = await sh(ch, "cat /proc/self/cgroup")
    second, _ = await sh(ch, "cat /proc/self/cgroup")
    assert first == second and first.startswith(b"0::/rollbox/s")


async def test_platform_tool_and_uniqueness_commands(ch: AgentChannel) -> None:
    tool = P.ExecRequest(argv=["cat", "/etc/machine-id"], env=[], platform_tool=True,
                         timeout_ms=COMMAND_MS)
    await finish(await start(ch, tool), "cat")  # the image may have none: only that it runs
    mid = secrets.token_hex(16)
    await ch.set_machine_id(mid)
    await ch.set_hostname("clone-7")
    await ch.reseed(os.urandom(64))
    when = 1_900_000_000
    await ch.set_clock(when * 10**9)
    out, _ = await sh(ch, "cat /etc/machine-id; hostname; date +%s")
    got_mid, host, now = out.decode().split()
    assert (got_mid, host) == (mid, "clone-7") and when <= int(now) < when + 30
    await ch.set_clock()  # back to the host's time
    # the platform's busybox, by descriptor, chrooted in the sandbox root, as root
    out, _ = await finish(await start(ch, tool), "cat")
    assert out == f"{mid}\n".encode()


async def test_reconnect_resyncs_and_reattaches_a_running_session(vm: Guest) -> None:
    ch = await vm.connect()
    async with asyncio.timeout(HOST_WAIT_S):
        sess = await ch.exec(P.ExecRequest(
            argv=["sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done; "
                              "sleep 1; echo end"],
            env=ENV, tail_limit=P.RETAIN_LIMIT), collect=False)
    await asyncio.wait_for(sess.events().__anext__(), 30)
    ch.close()  # the guest sees POLLHUP on its port, output in flight is cut off
    await asyncio.sleep(0.2)
    ch2 = await vm.connect()
    try:
        async with asyncio.timeout(HOST_WAIT_S):
            out = await reattach(ch2, sess.id)
        assert out == b"".join(b"line %d\n" % i for i in range(2000)) + b"end\n"
    finally:
        ch2.close()


async def test_back_to_back_reconnects_each_get_a_working_channel(vm: Guest) -> None:
    # No pause between one host connection and the next: the guest may see the old
    # connection's hang-up after the new one's HELLO; every channel must still work.
    for i in range(4):
        ch = await vm.connect()
        try:
            out, ex = await sh(ch, f"echo round {i}")
            assert (out, ex.exit_code) == (f"round {i}\n".encode(), 0)
        finally:
            ch.close()


async def hello_until_sync(raw: socket.socket, nonce: bytes, after: bytes = b"") -> None:
    """Send HELLO (then ``after``) until the agent's SYNC for ``nonce`` comes back, resending
    as AgentChannel does: the guest learns of a new host connection asynchronously (its
    port's open/close events), so a HELLO can land in the previous connection's state."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    deadline = time.monotonic() + 60
    while P.SYNC_MAGIC + nonce not in got:
        assert time.monotonic() < deadline, "no SYNC"
        await loop.sock_sendall(raw, P.hello(nonce) + after)
        with contextlib.suppress(asyncio.TimeoutError):
            got += await asyncio.wait_for(loop.sock_recv(raw, 65536), 1)


async def test_garbage_from_the_host_side_then_a_new_connection(vm: Guest) -> None:
    loop = asyncio.get_running_loop()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.setblocking(False)
    try:
        await loop.sock_connect(raw, str(vm.sock))
        # A bad frame after HELLO makes the agent drop the connection's state (it can not
        # close a port); a fresh HELLO on the same byte stream is answered.
        await hello_until_sync(raw, secrets.token_bytes(P.NONCE_LEN),
                               after=P.FRAME_LEN.pack(7) + b"\xee" * 300)
        await hello_until_sync(raw, secrets.token_bytes(P.NONCE_LEN))
    finally:
        raw.close()
    ch = await vm.connect()
    try:
        out, ex = await sh(ch, "echo alive")
        assert (out, ex.exit_code) == (b"alive\n", 0)
    finally:
        ch.close()


async def test_a_layer_that_is_not_erofs_is_reported_not_hung(
        artifacts: GuestArtifacts, tmp_path: Path) -> None:
    bad = tmp_path / "bad.erofs"
    bad.write_bytes(os.urandom(1 << 20))
    with booted(artifacts, tmp_path / "vm", [bad]) as g:
        ch = await g.connect()
        try:
            info = await ch.boot_info()
            assert info.errno != 0 and "mount erofs on /layers/0" in info.error, info
            # Nothing runs in the initramfs instead (the agent's own root).
            with pytest.raises(SpawnError, match="no sandbox root .*mount erofs"):
                await start(ch, P.ExecRequest(argv=["true"], env=ENV))
        finally:
            ch.close()
