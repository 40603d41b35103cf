"""QEMU's command line for one microVM, with every per-sandbox file at a fixed path.

The command line names only jail paths and inherited descriptors, never a host path or a
sandbox id, so two sandboxes of the same image, layers and resources get the *same* argv
(a saved template restores into any of them: lane template keys on :func:`argv`):

- ``/vm/kernel`` the PVH vmlinux, ``/vm/initrd`` the initramfs (agent as /init),
- ``/vm/layer0`` .. ``/vm/layer{N-1}`` the EROFS layers, read-only virtio-blk with serial
  ``layer<i>`` (i = index in the spec's layer list, lowest first), ``/vm/rw.img`` the
  writable ext4 disk, virtio-blk serial ``rw``,
- fd 3: the agent's virtio-serial port ``org.rollbox.agent`` (listening unix socket the edge
  bound), fd 4: QMP, fd 5: the serial console (read by the edge during boot only),
- fd 6 with a network policy only: the tap of the VM's NIC (``net.py``); without one the VM
  has no network device at all,
- ``/vm/ram`` with a template's shared RAM only (``MachineSpec.ram``): the guest's RAM as a
  file. A template's build VM (:data:`RAM_SHARED`) maps it shared and writable, so the RAM
  *is* the file when it is saved (with ``x-ignore-shared``: the state file carries the
  devices only); a VM restored from it (:data:`RAM_CLONE`) maps it private and copy-on-write
  from a descriptor opened read-only (``readonly=on,rom=off``, QEMU >= 8.2: QEMU 7.2 would
  open it read-write, which a file shared by sandboxes must never be): the pages a clone
  never writes stay the host page cache's, one copy for every clone.

Guest kernel command line (read by the agent as init): ``rollbox.layers=N`` and
``rollbox.rw=1`` say which disks exist (the agent finds them by their virtio serial, not by
probe order); ``rollbox.pids=N`` is the sandbox's pids limit, set by the agent on the parent of
its session cgroups (on the command line, so it is part of a template's key);
``tsc_early_khz``/``lpj`` skip the PIT calibration microvm can hang on under TCG (with
``tsc=reliable``: :data:`TSC_RELIABLE`); ``quiet``
because every console byte costs an emulated UART write; the rest of
:data:`FAST_BOOT_CMDLINE` cuts boot work that costs much under TCG (measured, see there and
docs/backends/microvm.md); no tracefs for the guest's memory
(:data:`GUEST_MEMORY_CMDLINE`).

Owns the argv and the host facts it needs (TSC kHz, QEMU version); does not start processes
(``jail.py``) or know sandboxes (``backend.py``).
"""
from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass, field

KERNEL = "/vm/kernel"
RAM_FILE = "/vm/ram"
RAM_SHARED = "shared"  # MachineSpec.ram of a template's build VM
RAM_CLONE = "clone"    # ... of a VM restored from a template with shared RAM
# memory-backend-file with readonly=on,rom=off (a private mapping of a read-only fd)
PRIVATE_FILE_RAM_SINCE = (8, 2)
INITRD = "/vm/initrd"
RW_DISK = "/vm/rw.img"
AGENT_PORT = "org.rollbox.agent"
# Descriptors QEMU inherits from the jailer (listening sockets bound by the edge).
AGENT_FD, QMP_FD, CONSOLE_FD = 3, 4, 5
KEPT_FDS = 3
# With a network policy: the tap (net.py) at fd 6, the NIC's fixed MAC (every VM is alone on
# its segment; equal argvs for a template's sandboxes).
TAP_FD = 6
GUEST_MAC = "52:54:00:72:62:78"
HZ = 250  # CONFIG_HZ of Debian's cloud kernel: lpj = kHz * 1000 / HZ
# The guest CPU under TCG: QEMU's qemu64 (AMD vendor, x86-64 baseline) plus what makes it
# x86-64-v2 (SSSE3, SSE4.1, SSE4.2, POPCNT; qemu64 has CX16 and LAHF): glibc's
# hwcaps and Python wheels (numpy) or chromium built for v2 need no more. Not `max`: its many
# features make the kernel patch more alternatives at boot and glibc pick AVX2/ERMS string
# code that TCG emulates slowly (measured here, plain QEMU, interleaved: boot CPU 2025 vs
# 1770 ms, 100 fork+exec in the guest 1469 vs 776 ms). Not an Intel model (Nehalem...):
# the guest kernel then assumes Meltdown/MDS and turns on page table isolation, a TLB flush
# per syscall under TCG (100 fork+exec 1720 ms). Both QEMU 7.2 and 10 support every flag.
# +arat (the APIC timer keeps running in idle states): without it the guest's local APIC timer
# needs a broadcast device in deep idle, microvm has none, so the kernel never leaves periodic
# ticks for tickless idle: an idle VM woke 250 times a second (~0.03 host cores each, 100 idle
# VMs more than this host's 2 cores); with it and TSC_RELIABLE below ~8 a second, ~0.003.
TCG_CPU = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+arat"
# The guest's clock under TCG: QEMU's TSC follows the host's clock, so it is reliable; without
# saying so the kernel's clocksource watchdog compares it with jiffies during boot, and on a
# loaded host (late ticks) marks it unstable and falls back to refined-jiffies (4 ms clock
# resolution in the guest, and no high-resolution timers: no tickless idle either). A
# template saves that choice into every VM restored from it.
TSC_RELIABLE = "tsc=reliable"
# Kernel parameters that cut boot work (each measured under TCG, plain QEMU, interleaved;
# QEMU CPU to the first exec 2690 -> 2010 ms for the three):
# - cryptomgr.notests: no self-tests of the crypto algorithms at registration (RSA/DH
#   modular arithmetic, ~0.3 s of emulated CPU); they check implementations, not inputs;
# - noreplace-smp: keep the lock prefixes a one-vCPU kernel would rewrite, one `text_poke`
#   (a page-table switch, i.e. a full TCG TLB flush) per site; a lock prefix costs TCG
#   nothing with one vCPU;
# - init_on_alloc=0: no zeroing of every page and slab object the guest kernel allocates
#   (a hardening of the guest kernel against its own uninitialised-memory leaks; the memory
#   came zeroed from the host, and the guest's root is not trusted anyway: docs/security.md).
FAST_BOOT_CMDLINE = ("cryptomgr.notests", "noreplace-smp", "init_on_alloc=0")
# microvm's firmware from QEMU 8 on: qboot (in QEMU's data files since 4.0), which loads the
# PVH kernel from fw_cfg itself. The default bios-microvm.bin is Debian's SeaBIOS build, and
# the one bookworm-backports' QEMU 10 comes with (seabios 1.16.3) does not boot the kernel
# with x-option-roms=off ("No bootable device"). Not on 7.2: there the default (seabios
# 1.16.2) boots and qboot costs more (QEMU CPU to the first exec +110 ms, 4 of 4 pairs).
FIRMWARE = "qboot.rom"
QBOOT_SINCE = (8, 0)
# No tracefs in the guest (docs/backends/microvm.md, "Memory"): Debian's 6.1 makes ~10k
# tracefs inodes and dentries at boot, ~8.5 MiB of slab in every VM that nothing in a sandbox
# uses (tracing inside a guest is not offered).
GUEST_MEMORY_CMDLINE = ("initcall_blacklist=tracer_init_tracefs",)


def layer_path(index: int) -> str:
    return f"/vm/layer{index}"


@dataclass(frozen=True)
class MachineSpec:
    """Everything the argv depends on; equal specs give equal argvs."""
    cpus: int
    memory_mib: int
    layers: int
    rw_disk: bool = True
    accel: str = "tcg"           # "tcg" | "kvm"
    tsc_khz: int = 0             # 0: leave the kernel to calibrate
    tb_size_mib: int = 64        # TCG translation cache (QEMU's default, 1 GiB, costs RSS)
    incoming: bool = False       # start paused waiting for ``migrate-incoming`` (restore)
    nic: bool = False            # a virtio-net NIC on the tap at TAP_FD (network policy)
    free_page_reporting: bool = True  # off only to measure what it saves (bench microvm)
    mem_merge: bool = True       # guest RAM mergeable by the host's KSM (ksm.py)
    pids: int = 0                # the sandbox's pids limit in the guest (0: none)
    ram: str = ""                # "": anonymous RAM; RAM_SHARED | RAM_CLONE: /vm/ram (above)
    extra_cmdline: tuple[str, ...] = field(default=())
    # A full VM's disk image guest (backends/vm): the VM disk image's name (no layers and no
    # rw disk; the root the disk of serial ``root``), PID 1 handed to its ``init`` (an
    # absolute path). "": a layered guest.
    root_disk: str = ""
    init: str = ""


# The kernel command line of a disk image guest: the agent's hand-over (agent.c, hand_over)
# and eth0 kept as eth0 (the image's udev would rename it to enp0sN, and the platform sets up
# eth0 through the agent).
ROOT_DISK_CMDLINE = ("rollbox.root=1", "net.ifnames=0")


# The start of a microVM's kernel command line (a full VM's has its own: backends/vm/machine.py).
MICROVM_CMDLINE = ("console=ttyS0", "quiet", "panic=-1", "reboot=t", "pci=off")


def kernel_cmdline(spec: MachineSpec, base: tuple[str, ...] = MICROVM_CMDLINE) -> str:
    args = [*base, *FAST_BOOT_CMDLINE, *GUEST_MEMORY_CMDLINE]
    if spec.root_disk:
        args += [*ROOT_DISK_CMDLINE, f"rollbox.init={spec.init}"]
    else:
        args.append(f"rollbox.layers={spec.layers}")
    if spec.rw_disk:
        args.append("rollbox.rw=1")
    if spec.pids > 0:
        args.append(f"rollbox.pids={spec.pids}")
    if spec.tsc_khz > 0:
        args += [f"tsc_early_khz={spec.tsc_khz}", f"lpj={spec.tsc_khz * 1000 // HZ}",
                 TSC_RELIABLE]
    return " ".join(args + list(spec.extra_cmdline))


SANDBOX_ARG = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def accel_args(spec: MachineSpec) -> list[str]:
    """``-accel`` and ``-cpu`` of the spec's accelerator (also a full VM's)."""
    if spec.accel == "kvm":
        return ["-accel", "kvm", "-cpu", "host"]
    if spec.accel == "tcg":
        return ["-accel", f"tcg,tb-size={spec.tb_size_mib}", "-cpu", TCG_CPU]
    raise ValueError(f"unknown accelerator {spec.accel!r}")


def channel_args(transport: str) -> list[str]:
    """Serial console (fd 5), QMP (fd 4) and the agent's virtio-serial port (fd 3), the
    virtio devices on ``transport`` ("device": virtio-mmio, "pci": a full VM's PCI)."""
    return [
        "-chardev", f"socket,id=console,fd={CONSOLE_FD},server=on,wait=off",
        "-serial", "chardev:console",
        "-chardev", f"socket,id=qmp,fd={QMP_FD},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-device", f"virtio-serial-{transport},max_ports=2",
        "-chardev", f"socket,id=agent,fd={AGENT_FD},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,name={AGENT_PORT}",
    ]


def device_args(spec: MachineSpec, transport: str) -> list[str]:
    """The balloon, layers, writable disk, NIC and ``-incoming`` of ``spec`` on
    ``transport`` (see :func:`channel_args`)."""
    args = ["-device", f"virtio-balloon-{transport},free-page-reporting="
            f"{'on' if spec.free_page_reporting else 'off'},deflate-on-oom=on"]
    for i in range(spec.layers):
        args += ["-drive", f"id=layer{i},file={layer_path(i)},format=raw,if=none,readonly=on",
                 "-device", f"virtio-blk-{transport},drive=layer{i},serial=layer{i}"]
    if spec.rw_disk:
        args += ["-drive", f"id=rw,file={RW_DISK},format=raw,if=none,discard=unmap,"
                 "detect-zeroes=unmap",
                 "-device", f"virtio-blk-{transport},drive=rw,serial=rw"]
    if spec.nic:
        args += ["-netdev", f"tap,id=net0,fd={TAP_FD},vhost=off",
                 "-device", f"virtio-net-{transport},netdev=net0,mac={GUEST_MAC}"]
    if spec.incoming:
        args += ["-incoming", "defer"]
    return args


def argv(spec: MachineSpec, binary: str = "/usr/bin/qemu-system-x86_64") -> list[str]:
    accel = accel_args(spec)
    machine = f"microvm,rtc=on,x-option-roms=off,mem-merge={'on' if spec.mem_merge else 'off'}"
    ram: list[str] = []
    if spec.ram:
        if spec.ram not in (RAM_SHARED, RAM_CLONE):
            raise ValueError(f"unknown RAM kind {spec.ram!r}")
        backing = ("share=on" if spec.ram == RAM_SHARED
                   else "share=off,readonly=on,rom=off")
        ram = ["-object", f"memory-backend-file,id=ram,size={spec.memory_mib}M,"
               f"mem-path={RAM_FILE},{backing}"]
        machine += ",memory-backend=ram"
    return [
        binary, "-M", machine, *accel, *ram,
        "-smp", str(spec.cpus), "-m", str(spec.memory_mib),
        *firmware_args(binary), "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        # modern virtio-mmio: free page reporting is a feature bit above 32
        "-global", "virtio-mmio.force-legacy=false",
        "-sandbox", SANDBOX_ARG,
        "-kernel", KERNEL, "-initrd", INITRD, "-append", kernel_cmdline(spec),
        *channel_args("device"), *device_args(spec, "device"),
    ]


@functools.lru_cache(maxsize=1)
def host_tsc_khz() -> int:
    """The host's TSC rate in kHz (TCG's guest TSC runs at the host's); 0 if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 0


@functools.lru_cache(maxsize=8)
def _version(binary: str, mtime_ns: int) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else ""


def version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a ``QEMU emulator version X.Y.Z ...`` line; (0, 0) if none."""
    words = text.split()
    try:
        major, minor = words[words.index("version") + 1].split(".")[:2]
        return int(major), int(minor)
    except (ValueError, IndexError):
        return 0, 0


def firmware_args(binary: str) -> list[str]:
    """``-bios`` for this QEMU's microvm (:data:`FIRMWARE` from :data:`QBOOT_SINCE`), or none."""
    return ["-bios", FIRMWARE] if version_tuple(version(binary)) >= QBOOT_SINCE else []


def private_file_ram(binary: str) -> bool:
    """Whether this QEMU maps a read-only file private and copy-on-write as guest RAM
    (``memory-backend-file,readonly=on,rom=off``): a template's RAM can then be shared."""
    return version_tuple(version(binary)) >= PRIVATE_FILE_RAM_SINCE


def version(binary: str) -> str:
    """``QEMU emulator version ...`` of the binary (part of a template's key); "" if it does
    not run."""
    try:
        return _version(binary, os.stat(binary).st_mtime_ns)
    except (OSError, subprocess.SubprocessError):
        return ""
