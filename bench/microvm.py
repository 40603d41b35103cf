"""``rollbox bench microvm [--quick] [--json]``: microVM sandboxes on this node, with a plain
QEMU cold boot of the same guest as the peer, in one run.

Against ``rollbox serve`` in its own process on a scratch node (its own data dir, run dir,
cgroup parent, node id, uid range; the node's images and guest artifacts read-only), image
``IMAGE``, one vCPU per VM. Phases:

1. ``restore``: create -> first ``exec(["true"])`` with templates (the template of the key is
   built by a warm-up create first, not timed), p50/p99 over ``n`` sequential creates, and
   ``restore_breakdown_p50_ms``: the p50 of each step of the backend's create (the server's
   ``vm_step_log``: template lookup, disk clone, jail, cgroups, jailer, QMP up, or
   ``spare_claim`` for a restore into a spare QEMU (``restore_into_spare`` counts those),
   state load, cont, agent connect, make_unique, ...), ``edge_and_api`` (the client's create
   time minus the backend's), the client's ``create`` and ``first_exec``, and ``second_exec``
   (the same command again: first - second is what a fresh QEMU pays to translate the
   guest's code again under TCG).
2. ``exec``: ``exec(["true"])`` round trip through the SDK in one live VM, p50/p99; beside it
   the guest-side cost of one fork+exec+wait of ``/bin/true`` (a busybox shell loop timed inside
   the guest with its own clock), which no host-side change can take away.
3. ``cycles``: create -> exec ``true`` -> destroy at concurrency 1 and 8 (restore path).
4. ``cold``: the same create -> first exec with templates off (a second server,
   ``ROLLBOX_VM_TEMPLATES=0``), p50/p99, and the boot breakdown the guest reports (QEMU
   start, kernel, modules, mounts, agent ready) from the agent's timestamps.
5. ``idle``: host memory per idle VM = drop of MemAvailable / N after 10 s idle, with the
   balloon's free-page reporting (the default) and without (a server with
   ``ROLLBOX_VM_FREE_PAGE_REPORTING=0``).
6. ``density``: idle VMs created at most ``DENSITY_CONCURRENCY`` at a time until
   ``DENSITY_MAX``, until MemAvailable less what the creates in flight will take would cross
   the host reserve (``HOST_RESERVE_MIB``), or after ``DENSITY_FAILURES`` failed creates in a
   row (the server waits ``DENSITY_BOOT_TIMEOUT_S`` for a guest); a VM counts only if it
   answers an exec within 5 s; the MemAvailable drop per VM after 10 s idle and host CPU while
   they idle (``/proc/stat``, cores busy) are reported; every VM of the run is deleted.
7. ``pmem``: 16 VMs running the same Python workload (``PY_WORKLOAD``) with the layers as
   read-only virtio-blk and as virtio-pmem + DAX (q35), the MemAvailable drop of each set, and
   the ratio pmem/blk.
8. ``plain``: the peer: ``qemu-system-x86_64 -M microvm`` started by this file (no rollbox, no
   jail, no template) with the best settings known (PVH vmlinux, RTC on, ``tsc_early_khz`` and
   ``lpj`` of this host), the same kernel, initramfs, agent and image layers; create -> first
   exec of ``true`` -> kill at concurrency 1 and 8. ``ratio_vs_plain_qemu_c8`` = rollbox c8 /
   plain c8.

``--only a,b`` runs just those phases (``PHASES``: restore, exec, cycles, idle, density,
cold, no_reporting, plain, pmem; the template is built first either way). The last line of
``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.rl import scratch_server_settings  # noqa: E402
from rollbox.backends.microvm.qemu import (  # noqa: E402
    FAST_BOOT_CMDLINE, TCG_CPU, TSC_RELIABLE, firmware_args,
)
from rollbox.backends.microvm.qemu import HZ as KERNEL_HZ  # noqa: E402
from rollbox.backends.microvm.qemu import host_tsc_khz, private_file_ram  # noqa: E402
from rollbox.backends.microvm.qemu import version as qemu_version  # noqa: E402
from rollbox.benchkit import (  # noqa: E402
    emit, find_pids, machine_busy_s, mem_available, percentile, process_cpu_s, ratio,
    round_trips, run_cycles, say, smaps_rollup,
)
from rollbox.config import Settings  # noqa: E402
from rollbox.embedded import ServerProcess  # noqa: E402
from rollbox.errors import CapacityExceeded, InfraError  # noqa: E402

IMAGE = "busybox:test"
PY_IMAGE = "python:3.11"
BACKEND = "microvm"
# Every VM, rollbox's and the peer's: one vCPU, this much guest memory and writable disk.
VM_MEMORY_MIB = 256
VM_DISK_MIB = 256
VM = {"cpus": 1, "memory_mib": VM_MEMORY_MIB, "disk_mib": VM_DISK_MIB}
HOST_RESERVE_MIB = 2048  # density stops before MemAvailable would cross this
DENSITY_MAX, DENSITY_QUICK = 160, 8  # idle VMs tried at most (the target: 100)
DENSITY_CONCURRENCY = 2  # creates in flight in the density phase (2 cores here)
DENSITY_FAILURES = 4  # failed creates in a row that end the density phase
# The benchmark's server waits this long for a guest to answer (the node's default is 60 s):
# a restore next to 100 idle VMs on a host others load too can take more than a minute.
DENSITY_BOOT_TIMEOUT_S = 180
IDLE_SETTLE_S = 10.0  # idle time before MemAvailable is read (balloon, free-page reporting)
EXEC_ANSWER_S = 5.0  # a VM counts as held only if it answers an exec within this
# Same work in every VM: import a few modules and keep 40 MiB of Python objects alive.
PY_WORKLOAD = ("import json, decimal, sqlite3, email.parser, xml.dom.minidom, time\n"
               "x = [bytes(1024) for _ in range(40 * 1024)]\nprint('ready', flush=True)\n"
               "time.sleep(600)\n")
# The guest-side cost of fork+exec: N runs of /bin/true timed by the guest's own clock (a
# command string runs under the platform shell, bash: $EPOCHREALTIME).
FORK_EXEC_N = 100
FORK_EXEC_LOOP = (f"t0=$EPOCHREALTIME; for ((i = 0; i < {FORK_EXEC_N}; i++)); do /bin/true; "
                  "done; echo $t0 $EPOCHREALTIME")


# ---- the server ------------------------------------------------------------------------------

class Server(ServerProcess):
    """``rollbox serve`` on a scratch node of its own (as ``bench/rl.py``'s), with extra
    ``ROLLBOX_*`` variables (the microVM switches this benchmark compares)."""

    def __init__(self, root: Path, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(scratch_server_settings(root, "vm", 48, 1024))
        assert self.env is not None
        self.step_log = root / "vm-steps.jsonl"  # one line per create (backends/microvm/steps.py)
        self.env.update({"ROLLBOX_VM_STEP_LOG": str(self.step_log),
                         "ROLLBOX_VM_BOOT_TIMEOUT": str(DENSITY_BOOT_TIMEOUT_S),
                         **(extra_env or {})})

    def step_lines(self) -> list[dict[str, Any]]:
        try:
            text = self.step_log.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def accel(self) -> tuple[str, str]:
        """The accelerator the server's node picked and why (``rollbox serve`` prints it)."""
        for line in self.log.read_text(errors="replace").splitlines():
            m = re.search(r"backend microvm: accelerator (\S+) \((.*)\)", line)
            if m:
                return m.group(1), m.group(2)
        return "unknown", "not printed by rollbox serve"

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(OSError):
            self.settings.run_dir.rmdir()


@contextlib.contextmanager
def server(extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-vm-"))
    srv = Server(root, extra_env)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        drop_scratch(root)


def drop_scratch(root: Path) -> None:
    """Remove a scratch node's dir: its disk pool stays mounted after the server stops (the
    template cache keeps subvolumes in it), so unmount what is below ``root`` first."""
    from rollbox.isolation.syscalls import read_mountinfo
    from rollbox.isolation import syscalls

    for mnt, _, _ in reversed(read_mountinfo()):
        if mnt.startswith(f"{root}/"):
            syscalls.umount(mnt, syscalls.MNT_DETACH)
    shutil.rmtree(root, ignore_errors=True)


# ---- rollbox phases --------------------------------------------------------------------------

async def first_exec(client: Any, image: str, n: int) -> dict[str, Any]:
    """n sequential creates: create -> first exec ``true`` (then a second one and the
    delete, not timed in the latency); per create the client's ``create``, ``first_exec``
    and ``second_exec`` ms by sandbox id."""
    lat: list[float] = []
    errors = 0
    client_ms: dict[str, dict[str, float]] = {}
    for _ in range(n):
        t = time.monotonic()
        sb = await client.create(image, backend=BACKEND, **VM, ttl_s=300)
        try:
            t1 = time.monotonic()
            r = await sb.exec(["true"])
            t2 = time.monotonic()
            if r.exit_code == 0:
                lat.append(t2 - t)
                await sb.exec(["true"])
                client_ms[sb.id] = {"create": (t1 - t) * 1000, "first_exec": (t2 - t1) * 1000,
                                    "second_exec": (time.monotonic() - t2) * 1000}
            else:
                errors += 1
        finally:
            await sb.delete()
    return {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000, "n": n,
            "errors": errors, "client_ms": client_ms}


def create_breakdown(lines: list[dict[str, Any]], client_ms: dict[str, dict[str, float]],
                     kind: str) -> dict[str, float]:
    """p50 per step of the measured creates of ``kind`` (the server's step log joined with
    the client's times by sandbox id); ``edge_and_api`` = client create - backend total."""
    per: dict[str, list[float]] = {}
    for line in lines:
        mine = client_ms.get(line.get("id", ""))
        if mine is None or line.get("kind") != kind:
            continue
        for step, ms in {**line["steps"], "backend_total": line["total_ms"], **mine,
                         "edge_and_api": mine["create"] - line["total_ms"]}.items():
            per.setdefault(step, []).append(ms)
    return {step: round(percentile(v, 50), 1) for step, v in per.items()}


async def exec_rtt(client: Any, image: str, n: int) -> dict[str, float]:
    sb = await client.create(image, backend=BACKEND, **VM, ttl_s=600)
    try:
        lat = await round_trips(lambda: sb.exec(["true"]), n)
        r = await sb.exec(FORK_EXEC_LOOP)
        if r.exit_code == 0:
            t0, t1 = (float(x) for x in r.stdout.split())
            guest_ms = (t1 - t0) * 1000 / FORK_EXEC_N
        else:
            say(f"  guest fork+exec loop failed: {r.stderr[-300:]}")
            guest_ms = float("nan")
    finally:
        await sb.delete()
    return {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
            "guest_fork_exec_ms": guest_ms}


async def cycles(client: Any, image: str, n: int, conc: int) -> dict[str, Any]:
    async def cycle() -> bool:
        sb = await client.create(image, backend=BACKEND, **VM, ttl_s=300)
        try:
            r = await sb.exec(["true"])
        finally:
            await sb.delete()
        return r.exit_code == 0

    return await run_cycles(cycle, n, conc)


async def answers(sb: Any) -> bool:
    """True if the VM runs ``true`` within EXEC_ANSWER_S."""
    try:
        r = await asyncio.wait_for(sb.exec(["true"]), EXEC_ANSWER_S)
        return r.exit_code == 0
    except Exception:  # noqa: BLE001 - a VM that fails to answer is just not held
        return False


async def delete_all(boxes: list[Any], conc: int = 8) -> None:
    sem = asyncio.Semaphore(conc)

    async def rm(sb: Any) -> None:
        async with sem:
            with contextlib.suppress(Exception):
                await sb.delete()

    await asyncio.gather(*(rm(sb) for sb in boxes))


async def idle_memory(client: Any, image: str, n: int) -> dict[str, Any]:
    """MemAvailable drop / n after IDLE_SETTLE_S of n idle VMs."""
    await asyncio.sleep(2)
    before = mem_available()
    boxes: list[Any] = []
    try:
        for _ in range(n):
            boxes.append(await client.create(image, backend=BACKEND, **VM, ttl_s=900))
        await asyncio.sleep(IDLE_SETTLE_S)
        after = mem_available()
        alive = sum([await answers(sb) for sb in boxes])
    finally:
        await delete_all(boxes)
    return {"n": n, "alive": alive, "mib_per_vm": (before - after) / n / (1 << 20)}


def vms_cpu_s(cgroup_parent: str) -> float:
    """CPU seconds of the QEMU processes in the node's cgroups (this benchmark's VMs)."""
    return sum(process_cpu_s(pid)
               for pid in find_pids(comm_prefix="qemu", cgroup_part=f"/{cgroup_parent}/"))


async def density(client: Any, image: str, limit: int, cgroup_parent: str,
                  conc: int = DENSITY_CONCURRENCY) -> dict[str, Any]:
    """Create idle VMs, at most ``conc`` at a time (restores are CPU under TCG: more in flight
    only queue on the host's cores), until ``limit``, until MemAvailable less what the VMs in
    flight will take (the mean cost so far) would cross the host reserve, or after
    ``DENSITY_FAILURES`` failed creates in a row; each create may take the server's boot bound
    (``DENSITY_BOOT_TIMEOUT_S``). After IDLE_SETTLE_S the MemAvailable drop per VM and host CPU
    over 10 s; then each VM in turn must answer ``true`` in 5 s to count as held. Every VM of
    the run (found by its label, whether or not its create answered) is deleted at the end."""
    reserve = HOST_RESERVE_MIB << 20
    label = {"bench": f"density-{secrets.token_hex(4)}"}
    boxes: list[Any] = []
    create_s: list[float] = []
    failed = in_a_row = 0
    stop_reason = "limit"
    flying: set[asyncio.Task[Any]] = set()
    await asyncio.sleep(2)
    avail0 = mem_available()
    t_start = time.monotonic()

    async def create() -> Any:
        t = time.monotonic()
        sb = await client.create(image, backend=BACKEND, **VM, ttl_s=3600, labels=label)
        create_s.append(time.monotonic() - t)
        return sb

    def per_vm_bytes() -> int:
        """Mean host memory per VM so far (the guest's size before the first one)."""
        return (max(0, avail0 - mem_available()) // len(boxes) if boxes
                else VM_MEMORY_MIB << 20)

    try:
        while True:
            while (stop_reason == "limit" and len(flying) < conc
                   and len(boxes) + len(flying) < limit):
                if mem_available() - per_vm_bytes() * (len(flying) + 1) < reserve:
                    stop_reason = "host reserve"
                    break
                flying.add(asyncio.ensure_future(create()))
            if not flying:
                break
            done, flying = await asyncio.wait(flying, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None:
                    boxes.append(t.result())
                    in_a_row = 0
                    if len(boxes) % 10 == 0:
                        say(f"  density: {len(boxes)} VMs, {mem_available() >> 20} MiB "
                            f"available, create p50 {percentile(create_s, 50):.1f} s")
                    continue
                failed += 1
                in_a_row += 1
                say(f"  density create failed: {type(exc).__name__}: {str(exc)[:300]}")
                if isinstance(exc, CapacityExceeded):
                    stop_reason = f"admission ({exc.details.get('reason', exc)})"
                elif in_a_row >= DENSITY_FAILURES and stop_reason == "limit":
                    stop_reason = "create failures"
        created_s = time.monotonic() - t_start
        await asyncio.sleep(IDLE_SETTLE_S)
        after = mem_available()
        b0, v0, t0 = machine_busy_s(), vms_cpu_s(cgroup_parent), time.monotonic()
        await asyncio.sleep(10)
        wall = time.monotonic() - t0
        idle_cores = (machine_busy_s() - b0) / wall
        vm_cores = (vms_cpu_s(cgroup_parent) - v0) / wall
        held = 0
        for sb in boxes:  # sequential: each answer timed on its own
            held += await answers(sb)
        return {"created": len(boxes), "held": held, "create_failed": failed,
                "stop": stop_reason, "concurrency": conc, "create_wall_s": created_s,
                "create_p50_s": percentile(create_s, 50), "create_p99_s": percentile(create_s, 99),
                "create_max_s": max(create_s, default=0.0),
                "mib_per_vm": (avail0 - after) / max(1, len(boxes)) / (1 << 20),
                "mem_available_mib": after >> 20,
                "idle_host_cpu_cores": idle_cores, "idle_vms_cpu_cores": vm_cores}
    finally:
        for t in flying:
            t.cancel()
        for r in await asyncio.gather(*flying, return_exceptions=True):
            if not isinstance(r, BaseException):
                boxes.append(r)
        with contextlib.suppress(Exception):  # creates whose answer never came back
            known = {sb.id for sb in boxes}
            boxes += [sb for sb in await client.list(labels=label) if sb.id not in known]
        await delete_all(boxes)


def boot_breakdown(info: Any, connected_s: float, info_s: float) -> dict[str, float]:
    """ms per boot step from the guest's own CLOCK_BOOTTIME stamps (``BOOT_INFO``) and two host
    times since QEMU was spawned: when the channel was up, when the boot record came back.
    The record's ``now`` against the host's time of its arrival gives when the guest's clock
    started: before that is QEMU's start (process, kernel and initrd loaded); ``host_wait``
    is how long after the agent was ready the host's channel was up."""
    ms = 1e-6
    clock0 = info_s * 1000 - info.now_ns * ms
    return {"qemu_start_ms": clock0,
            "kernel_ms": info.init_ns * ms,
            "modules_ms": (info.modules_ns - info.init_ns) * ms,
            "disks_ms": (info.disks_ns - info.modules_ns) * ms,
            "mounts_ms": (info.mounts_ns - info.disks_ns) * ms,
            "agent_ms": (info.ready_ns - info.mounts_ns) * ms,
            "host_wait_ms": connected_s * 1000 - clock0 - info.ready_ns * ms}


async def exec_true_over_stream(sock: Path, spawned: float, timeout: float
                                ) -> tuple[int, dict[str, float]]:
    """Connect to an agent over its byte stream (waiting while the guest boots), read its boot
    record and run ``true``: (exit code, boot breakdown). ``spawned``: monotonic time QEMU was
    started."""
    from rollbox.agent import protocol as P
    from rollbox.agent.channel import AgentChannel

    deadline = time.monotonic() + timeout
    while True:  # QEMU binds its socket before it listens: refused for a moment
        try:
            ch = await AgentChannel.connect_stream(str(sock), timeout=timeout)
            break
        except InfraError as exc:
            if "refused" not in str(exc) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)
    try:
        # one deadline for the whole boot: a guest that connects but never answers (seen once
        # in 14 concurrent boots) must count as an error, not hang the run
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            connected = time.monotonic() - spawned
            info = await ch.boot_info()
            breakdown = boot_breakdown(info, connected, time.monotonic() - spawned)
            sess = await ch.exec(P.ExecRequest(argv=["true"], env=["PATH=/usr/bin:/bin"]))
            return (await sess.wait()).exit_code, breakdown
    finally:
        ch.close()


# ---- the peer: plain QEMU --------------------------------------------------------------------

class PlainQemu:
    """One cold boot of the guest by plain QEMU, no rollbox: the same PVH vmlinux, initramfs
    (agent as init), image layers (read-only virtio-blk) and a fresh writable ext4 disk, with
    the best settings known for microvm under TCG (RTC on, ``tsc_early_khz``/``lpj`` so the
    kernel skips PIT calibration, no option ROMs, no console output, the backend's guest CPU
    model and boot parameters ``qemu.TCG_CPU``, ``qemu.FAST_BOOT_CMDLINE``). No jail, no
    seccomp, no balloon, no template: what one would run by hand."""

    def __init__(self, workdir: Path, layers: list[Path], memory_mib: int, disk_mib: int) -> None:
        s = Settings()
        self.kernel, self.initrd = s.vm_kernel, s.vm_initrd
        self.layers, self.memory_mib, self.disk_mib = layers, memory_mib, disk_mib
        self.dir = Path(tempfile.mkdtemp(prefix="vm-", dir=workdir))
        self.sock = self.dir / "agent.sock"
        self.rw = self.dir / "rw.img"
        self.proc: asyncio.subprocess.Process | None = None
        self.breakdown: dict[str, float] = {}

    def argv(self) -> list[str]:
        khz = host_tsc_khz()
        cmdline = ["quiet", "panic=-1", "reboot=t", "pci=off", *FAST_BOOT_CMDLINE,
                   f"rollbox.layers={len(self.layers)}", "rollbox.rw=1"]
        if khz:
            cmdline += [f"tsc_early_khz={khz}", f"lpj={khz * 1000 // KERNEL_HZ}",
                        TSC_RELIABLE]
        args = ["qemu-system-x86_64", "-M", "microvm,rtc=on,x-option-roms=off,isa-serial=off",
                "-accel", "tcg,tb-size=64", "-cpu", TCG_CPU, "-smp", "1",
                "-m", str(self.memory_mib), *firmware_args(shutil.which("qemu-system-x86_64") or ""),
                "-nodefaults", "-no-user-config",
                "-nographic", "-no-reboot", "-global", "virtio-mmio.force-legacy=false",
                "-kernel", str(self.kernel), "-initrd", str(self.initrd),
                "-append", " ".join(cmdline),
                "-device", "virtio-serial-device,max_ports=2",
                "-chardev", f"socket,id=agent,path={self.sock},server=on,wait=off",
                "-device", "virtserialport,chardev=agent,name=org.rollbox.agent"]
        for i, layer in enumerate(self.layers):
            args += ["-drive", f"id=layer{i},file={layer},format=raw,if=none,readonly=on",
                     "-device", f"virtio-blk-device,drive=layer{i},serial=layer{i}"]
        args += ["-drive", f"id=rw,file={self.rw},format=raw,if=none",
                 "-device", "virtio-blk-device,drive=rw,serial=rw"]
        return args

    async def boot_and_exec(self) -> float:
        """Seconds from start until ``true`` ran in the guest (exit 0)."""
        t0 = time.monotonic()
        with open(self.rw, "wb") as f:
            f.truncate(self.disk_mib << 20)
        mkfs = await asyncio.create_subprocess_exec(
            "mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=1", str(self.rw),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        if await mkfs.wait() != 0:
            raise RuntimeError("mkfs.ext4 failed")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        spawned = time.monotonic()
        while not self.sock.exists():
            if self.proc.returncode is not None:
                raise RuntimeError(f"qemu exited {self.proc.returncode}")
            await asyncio.sleep(0.005)
        code, self.breakdown = await exec_true_over_stream(self.sock, spawned, timeout=120)
        if code != 0:
            raise RuntimeError(f"true exited {code}")
        self.breakdown["host_prep_ms"] = (spawned - t0) * 1000  # writable disk + mkfs.ext4
        return time.monotonic() - t0

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def plain_cycles(layers: list[Path], n: int, conc: int, memory_mib: int,
                       disk_mib: int, workdir: Path) -> dict[str, Any]:
    first: list[float] = []
    steps: list[dict[str, float]] = []

    async def cycle() -> bool:
        vm = PlainQemu(workdir, layers, memory_mib, disk_mib)
        try:
            first.append(await vm.boot_and_exec())
            steps.append(vm.breakdown)
            return True
        finally:
            await vm.close()

    res = await run_cycles(cycle, n, conc)
    res["first_exec_p50_ms"] = percentile(first, 50) * 1000
    res["first_exec_p99_ms"] = percentile(first, 99) * 1000
    res["boot_p50_ms"] = {k: percentile([s[k] for s in steps], 50)
                          for k in (steps[0] if steps else {})}
    return res


# ---- layers as virtio-blk vs virtio-pmem + DAX (q35) ----------------------------------------

# /init of the layer-device probe guest, appended to the guest's own initramfs (a later cpio
# member replaces an earlier one): the guest's modules plus virtio-pci, the image's layers
# mounted read-only from /dev/pmemN (EROFS with dax=always: reads map the host's page cache)
# or /dev/vdX (read through the guest's own page cache), an overlay with a tmpfs upper, and
# the Python workload chrooted there. "probe-ready" on the console when it has run.
PROBE_INIT = r"""#!/platform/busybox sh
B=/platform/busybox
$B mount -t proc proc /proc; $B mount -t sysfs sys /sys; $B mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk \
         virtio_balloon libnvdimm nd_virtio virtio_pmem nd_btt nd_pmem libcrc32c erofs overlay; do
  $B insmod /probe/$m.ko 2>/dev/null || $B insmod /lib/modules/$m.ko 2>/dev/null
done
mode=$($B sed -n 's/.*probe.mode=\([a-z]*\).*/\1/p' /proc/cmdline)
n=$($B sed -n 's/.*probe.layers=\([0-9]*\).*/\1/p' /proc/cmdline)
i=0; lower=""
for d in a b c d e f g h; do
  [ $i -lt $n ] || break
  if [ "$mode" = pmem ]; then dev=/dev/pmem$i; opt=ro,dax=always; else dev=/dev/vd$d; opt=ro; fi
  k=0; while [ ! -b $dev ] && [ $k -lt 200 ]; do $B sleep 0.05; k=$((k+1)); done
  $B mkdir -p /layers/$i && $B mount -t erofs -o $opt $dev /layers/$i || echo "probe-fail mount $dev"
  lower="/layers/$i${lower:+:$lower}"; i=$((i+1))
done
$B mount -t tmpfs -o size=64m none /rw && $B mkdir /rw/u /rw/w
$B mount -t overlay overlay -o lowerdir=$lower,upperdir=/rw/u,workdir=/rw/w /sandbox
$B mount -t proc proc /sandbox/proc; $B mount -t devtmpfs dev /sandbox/dev
export PATH=/usr/local/bin:/usr/bin:/bin
$B chroot /sandbox python3 -c "$($B cat /probe/workload.py)" > /dev/ttyS0 2>&1
echo probe-fail exit > /dev/ttyS0
while true; do $B sleep 1000; done
"""
PROBE_MODULES = ("drivers/virtio/virtio_pci.ko", "drivers/virtio/virtio_pci_modern_dev.ko",
                 "drivers/virtio/virtio_pci_legacy_dev.ko")


def kernel_modules_dir() -> Path:
    """The unpacked guest kernel's modules (what ``make guest`` unpacked from the deb)."""
    cache = Settings().vm_guest_manifest.parent / "cache"  # rollbox.guest.build's
    found = sorted(cache.glob("*/lib/modules/*/kernel"))
    if not found:
        raise RuntimeError(f"no unpacked guest kernel below {cache} (make guest)")
    return found[-1]


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc archive of (name, mode, data), owned by root, ending with the trailer."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        out += ("070701" + "".join(f"{v:08X}" for v in fields)).encode() + raw
        out += b"\0" * (-(110 + len(raw)) % 4)
        out += data + b"\0" * (-len(data) % 4)
    return bytes(out)


def probe_initrd(dest: Path) -> Path:
    mods = kernel_modules_dir()
    extra = [("probe", 0o40755, b""), ("init", 0o100755, PROBE_INIT.encode()),
             ("probe/workload.py", 0o100644,
              PY_WORKLOAD.replace("print('ready'", "print('probe-ready'").encode())]
    extra += [(f"probe/{Path(m).name}", 0o100644, (mods / m).read_bytes()) for m in PROBE_MODULES]
    out = dest / "probe-initrd.cpio"
    out.write_bytes(Settings().vm_initrd.read_bytes() + cpio_newc(extra))
    return out


def padded_layers(layers: list[Path], dest: Path) -> list[Path]:
    """Copies of the layer files padded to 2 MiB (virtio-pmem's alignment), used by both
    variants so that they read the very same files."""
    out = []
    for i, layer in enumerate(layers):
        dst = dest / f"layer{i}.erofs"
        shutil.copyfile(layer, dst)
        size = dst.stat().st_size
        os.truncate(dst, -(-size // (2 << 20)) * (2 << 20))
        out.append(dst)
    return out


class LayerProbeVM:
    """One q35 guest of the probe (same kernel, one vCPU, ``VM_MEMORY_MIB``, balloon with
    free-page reporting as rollbox's VMs) with the layers as ``mode`` ("blk" | "pmem")."""

    def __init__(self, workdir: Path, kernel: Path, initrd: Path, layers: list[Path],
                 mode: str, index: int) -> None:
        self.console = workdir / f"{mode}-{index}.console"
        self.kernel, self.initrd, self.layers, self.mode = kernel, initrd, layers, mode
        self.proc: asyncio.subprocess.Process | None = None

    def argv(self) -> list[str]:
        khz = host_tsc_khz()
        # no_timer_check: with 16 guests booting under TCG the kernel's IO-APIC timer check can
        # miss its ticks and panic in setup_IO_APIC (seen twice on 2026-12-01); a VM's timer
        # needs no such check.
        cmdline = ["console=ttyS0", "quiet", "panic=-1", "no_timer_check",
                   f"probe.mode={self.mode}", f"probe.layers={len(self.layers)}"]
        if khz:
            cmdline += [f"tsc_early_khz={khz}", f"lpj={khz * 1000 // KERNEL_HZ}",
                        TSC_RELIABLE]
        total = sum(p.stat().st_size for p in self.layers) >> 20
        args = ["qemu-system-x86_64", "-M", "q35", "-accel", "tcg,tb-size=64", "-cpu", "max",
                "-smp", "1", "-m", f"{VM_MEMORY_MIB},slots=8,maxmem={VM_MEMORY_MIB + total + 64}M",
                "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
                "-kernel", str(self.kernel), "-initrd", str(self.initrd),
                "-append", " ".join(cmdline), "-serial", f"file:{self.console}",
                "-device", "virtio-balloon-pci,free-page-reporting=on,addr=0x9"]
        for i, layer in enumerate(self.layers):
            addr = f"addr={0x10 + i:#x}"
            if self.mode == "pmem":
                args += ["-object", f"memory-backend-file,id=mem{i},share=on,readonly=on,"
                         f"mem-path={layer},size={layer.stat().st_size}",
                         "-device", f"virtio-pmem-pci,memdev=mem{i},id=pmem{i},{addr}"]
            else:
                args += ["-drive", f"id=layer{i},file={layer},format=raw,if=none,readonly=on",
                         "-device", f"virtio-blk-pci,drive=layer{i},{addr}"]
        return args

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)

    async def ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.console.read_text(errors="replace") if self.console.exists() else ""
            if "probe-ready" in text:
                return
            if "probe-fail" in text or (self.proc is not None and self.proc.returncode is not None):
                raise RuntimeError(f"layer probe ({self.mode}) failed: {text[-500:]}")
            await asyncio.sleep(0.2)
        raise RuntimeError(f"layer probe ({self.mode}) not ready in {timeout}s")

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def layer_device_memory(n: int, quick: bool) -> dict[str, Any]:
    """n VMs per variant running PY_WORKLOAD; MemAvailable drop and QEMU PSS per variant."""
    out: dict[str, Any] = {"n": n}
    s = Settings()
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-pmem-") as d:
        work = Path(d)
        layers = padded_layers(image_layers(PY_IMAGE), work)
        initrd = probe_initrd(work)
        for mode in ("blk", "pmem"):
            await asyncio.sleep(2)
            before = mem_available()
            vms = [LayerProbeVM(work, s.vm_kernel, initrd, layers, mode, i) for i in range(n)]
            try:
                for vm in vms:
                    await vm.start()
                await asyncio.gather(*(vm.ready(600) for vm in vms))
                await asyncio.sleep(IDLE_SETTLE_S)
                drop = before - mem_available()
                pss = sum(smaps_rollup(vm.proc.pid).get("Pss", 0) for vm in vms if vm.proc)
            finally:
                await asyncio.gather(*(vm.close() for vm in vms))
            out[f"{mode}_mem_available_drop_mib"] = drop / (1 << 20)
            out[f"{mode}_qemu_pss_mib"] = pss / (1 << 20)
            say(f"{n} VMs, layers as {mode}: MemAvailable -{drop / (1 << 20):.0f} MiB, "
                f"QEMU PSS {pss / (1 << 20):.0f} MiB")
    # The key ratio is of the QEMUs' PSS (shared pages split among their sharers, so the one
    # host copy of a DAX-mapped layer counts once): on a host others use at the same time,
    # MemAvailable moves by more than these VMs' difference. Both are reported.
    out["ratio"] = out["pmem_qemu_pss_mib"] / out["blk_qemu_pss_mib"]
    out["mem_available_ratio"] = (out["pmem_mem_available_drop_mib"]
                                  / max(1e-9, out["blk_mem_available_drop_mib"]))
    return out


# ---- the run ---------------------------------------------------------------------------------

# The phases (``--only``): those on the default server, then the other servers' and the peers'.
ROLLBOX_PHASES = frozenset({"restore", "exec", "cycles", "idle", "density"})
PHASES = ROLLBOX_PHASES | {"cold", "no_reporting", "plain", "pmem"}
# The switches compared (read by the microVM backend through config.py).
TEMPLATES_OFF = {"ROLLBOX_VM_TEMPLATES": "0"}
FREE_PAGE_REPORTING_OFF = {"ROLLBOX_VM_FREE_PAGE_REPORTING": "0"}


def image_layers(image: str) -> list[Path]:
    from rollbox.images.store import ImageStore

    store = ImageStore(Settings().images_dir)
    return [store.layer_path(d) for d in store.resolve(image).layers]


async def rollbox_phases(srv: Server, quick: bool, res: dict[str, Any],
                         phases: frozenset[str] = PHASES) -> None:
    """Everything on the default server (templates and free-page reporting on); of
    restore/exec/cycles/idle/density those in ``phases``."""
    from rollbox.sdk import AsyncClient

    res["accel"], res["accel_reason"] = srv.accel()
    say(f"accelerator: {res['accel']} ({res['accel_reason']})")
    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=300) as client:
        warm = await first_exec(client, IMAGE, 2)  # builds the template of the key
        say(f"warm-up (template build): p50 {warm['p50_ms']:.0f} ms errors {warm['errors']}")
        if "restore" in phases:
            await restore_phase(srv, client, quick, res)
        if "exec" in phases:
            await exec_phase(client, quick, res)
        if "cycles" in phases:
            await cycles_phase(client, quick, res)
        if "idle" in phases:
            idle = await idle_memory(client, IMAGE, 4 if quick else 16)
            res["idle_mib_per_vm"], res["idle_alive"] = idle["mib_per_vm"], idle["alive"]
            say(f"idle (free-page reporting on): {idle['mib_per_vm']:.1f} MiB per VM "
                f"({idle['alive']}/{idle['n']} answer)")
        if "density" in phases:
            d = await density(client, IMAGE, DENSITY_QUICK if quick else DENSITY_MAX,
                              srv.settings.cgroup_parent)
            res["idle_vms"] = d["held"]
            res["density"] = d
            say(f"density: {d}")


async def restore_phase(srv: Server, client: Any, quick: bool, res: dict[str, Any]) -> None:
    """create -> first exec on the restore path (the template is built)."""
    r = await first_exec(client, IMAGE, 8 if quick else 20)
    res["restore_first_exec_p50_ms"], res["restore_first_exec_p99_ms"] = r["p50_ms"], r["p99_ms"]
    res["restore_errors"] = r["errors"]
    say(f"restore -> first exec p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms")
    lines = srv.step_lines()
    res["restore_breakdown_p50_ms"] = create_breakdown(lines, r["client_ms"], "restore")
    # how many of them restored into a spare QEMU of the template (backends/microvm/spares.py)
    res["restore_into_spare"] = sum(1 for x in lines if x.get("id") in r["client_ms"]
                                    and "spare_claim" in x.get("steps", {}))
    say(f"restore breakdown p50 ms: {res['restore_breakdown_p50_ms']} "
        f"({res['restore_into_spare']} of {len(r['client_ms'])} into a spare QEMU)")


async def exec_phase(client: Any, quick: bool, res: dict[str, Any]) -> None:
    """``exec(["true"])`` round trips, and the guest's own fork+exec beside them."""
    rtt = await exec_rtt(client, IMAGE, 50 if quick else 300)
    res["exec_p50_ms"], res["exec_p99_ms"] = rtt["p50_ms"], rtt["p99_ms"]
    res["guest_fork_exec_ms"] = rtt["guest_fork_exec_ms"]
    say(f"exec true p50 {rtt['p50_ms']:.2f} ms p99 {rtt['p99_ms']:.2f} ms; guest-side "
        f"fork+exec {rtt['guest_fork_exec_ms']:.2f} ms")


async def cycles_phase(client: Any, quick: bool, res: dict[str, Any]) -> None:
    """create -> exec -> destroy at c1 and c8."""
    for c, n in ((1, 6 if quick else 10), (8, 16 if quick else 32)):
        r = await cycles(client, IMAGE, n, c)
        res[f"per_s_c{c}"], res[f"cycle_p50_ms_c{c}"] = r["per_s"], r["p50_ms"]
        res[f"cycle_errors_c{c}"] = r["errors"]
        say(f"create/exec/destroy c{c}: {r['per_s']:.2f}/s p50 {r['p50_ms']:.0f} ms "
            f"errors {r['errors']}")


async def cold_phases(srv: Server, quick: bool, res: dict[str, Any]) -> None:
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=300) as client:
        r = await first_exec(client, IMAGE, 3 if quick else 8)
        res["cold_first_exec_p50_ms"], res["cold_first_exec_p99_ms"] = r["p50_ms"], r["p99_ms"]
        res["cold_errors"] = r["errors"]
        res["cold_breakdown_p50_ms"] = create_breakdown(srv.step_lines(), r["client_ms"], "cold")
        say(f"cold boot -> first exec p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms")


async def no_reporting_phase(srv: Server, quick: bool, res: dict[str, Any]) -> None:
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=300) as client:
        await first_exec(client, IMAGE, 1)  # the template of this key
        idle = await idle_memory(client, IMAGE, 4 if quick else 16)
        res["idle_mib_per_vm_no_reporting"] = idle["mib_per_vm"]
        say(f"idle (free-page reporting off): {idle['mib_per_vm']:.1f} MiB per VM")


async def plain_phase(quick: bool, res: dict[str, Any]) -> None:
    layers = image_layers(IMAGE)
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-plain-") as d:
        for c, n in ((1, 3 if quick else 5), (8, 8 if quick else 16)):
            r = await plain_cycles(layers, n, c, VM_MEMORY_MIB, VM_DISK_MIB, Path(d))
            res[f"plain_qemu_per_s_c{c}"] = r["per_s"]
            res[f"plain_qemu_first_exec_p50_ms_c{c}"] = r["first_exec_p50_ms"]
            res[f"plain_qemu_errors_c{c}"] = r["errors"]
            if c == 1:
                res["plain_qemu_boot_breakdown_p50_ms"] = r["boot_p50_ms"]
            say(f"plain QEMU c{c}: {r['per_s']:.2f}/s first exec p50 "
                f"{r['first_exec_p50_ms']:.0f} ms errors {r['errors']}")


def main(quick: bool = False, json_out: bool = False,
         only: frozenset[str] | None = None) -> dict[str, Any]:
    """The whole benchmark, or with ``only`` just those phases (``PHASES``)."""
    phases = PHASES if only is None else only
    if not phases or not phases <= PHASES:
        raise SystemExit(f"bench microvm: phases are {', '.join(sorted(PHASES))}")
    node = Settings()
    res: dict[str, Any] = {"image": IMAGE, "quick": quick, "load_start": os.getloadavg()[0],
                           "cores": os.cpu_count(), "phases": sorted(phases),
                           "qemu": qemu_version(str(node.qemu_binary)),
                           # what the servers' templates do with their RAM (node capacity)
                           "template_ram": "shared" if node.vm_template_shared_ram
                           and private_file_ram(str(node.qemu_binary)) else "copied"}
    t0 = time.monotonic()
    if phases & ROLLBOX_PHASES:
        with server() as srv:
            asyncio.run(rollbox_phases(srv, quick, res, phases))
    if "cold" in phases:
        with server(TEMPLATES_OFF) as srv:
            asyncio.run(cold_phases(srv, quick, res))
    if "no_reporting" in phases:
        with server(FREE_PAGE_REPORTING_OFF) as srv:
            asyncio.run(no_reporting_phase(srv, quick, res))
    if "plain" in phases:
        asyncio.run(plain_phase(quick, res))
    if "pmem" in phases:
        layer = asyncio.run(layer_device_memory(4 if quick else 16, quick))
        res["pmem_vs_blk_mem_ratio"] = layer["ratio"]
        res["layer_devices"] = layer
    for c in (8, 1):
        if f"per_s_c{c}" in res and f"plain_qemu_per_s_c{c}" in res:
            res[f"ratio_vs_plain_qemu_c{c}"] = ratio(res[f"per_s_c{c}"],
                                                     res[f"plain_qemu_per_s_c{c}"])
    res["wall_s"] = time.monotonic() - t0
    res["load_end"] = os.getloadavg()[0]
    return emit(res, json_out)


def parse_only(text: str) -> frozenset[str] | None:
    """``--only a,b``: those phases; "" : all."""
    return frozenset(p.strip() for p in text.split(",") if p.strip()) or None


if __name__ == "__main__":
    only = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--only"), "")
    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv, only=parse_only(only))
