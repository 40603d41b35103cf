"""Which accelerator microVMs use on this node: KVM only if it really boots a guest.

``/dev/kvm`` existing is not enough: on this machine type it is PVM, under which an unmodified
guest kernel hangs or crawls and dies on an emulation failure. So at node start, with
``vm_accel = "auto"``, a short probe boot under KVM (no layers, a 16 MiB disk, jailed like any
VM) must reach the agent within ``KVM_PROBE_TIMEOUT_S``; otherwise VMs run under TCG. The
result is cached per (kernel, initramfs, QEMU version, /dev/kvm device) in
``vm_accel_cache`` (a tmpfs: a reboot probes again) and in the process, so node starts and test
edges do not pay the probe again. ``vm_accel = "tcg" | "kvm"`` skips the probe.

Owns the choice and its cache; the boot itself is the backend's ``create``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.microvm import qemu
from rollbox.errors import RollboxError
from rollbox.models import Resources

if TYPE_CHECKING:
    from rollbox.backends.microvm.backend import MicroVMBackend

log = logging.getLogger(__name__)

KVM_PROBE_TIMEOUT_S = 10.0
_memo: dict[str, "AccelChoice"] = {}


@dataclass(frozen=True)
class AccelChoice:
    accel: str                 # "kvm" | "tcg"
    reason: str
    probe_s: float | None = None


def _kvm_openable() -> str | None:
    """None if /dev/kvm opens read-write, else why not."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kvm: {exc.strerror}"
    os.close(fd)
    return None


def _file_id(path: Path) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def probe_key(backend: MicroVMBackend) -> str:
    s = backend.settings
    parts = [_file_id(s.vm_kernel), _file_id(s.vm_initrd), qemu.version(str(s.qemu_binary)),
             str(os.stat("/dev/kvm").st_rdev)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


async def probe_accel(backend: MicroVMBackend) -> AccelChoice:
    s = backend.settings
    if s.vm_accel in ("tcg", "kvm"):
        return AccelChoice(s.vm_accel, "set by ROLLBOX_VM_ACCEL")
    why = _kvm_openable()
    if why is not None:
        return AccelChoice("tcg", f"no usable KVM ({why})")
    key = probe_key(backend)
    if key in _memo:
        return _memo[key]
    cache = s.vm_accel_cache / f"{key}.json"
    try:
        choice = AccelChoice(**json.loads(cache.read_text()))
        _memo[key] = choice
        return choice
    except (OSError, ValueError, TypeError):
        pass
    choice = await _probe_boot(backend)
    _memo[key] = choice
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(choice)))
        os.replace(tmp, cache)
    except OSError as exc:
        log.warning("accelerator probe result not cached: %s", exc)
    return choice


async def _probe_boot(backend: MicroVMBackend) -> AccelChoice:
    spec = ResolvedSpec(image="(accelerator probe)", layers=(),
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=16), env={})
    machine = qemu.MachineSpec(cpus=1, memory_mib=256, layers=0, accel="kvm",
                               tsc_khz=qemu.host_tsc_khz())
    sandbox_id = f"{backend.settings.node_id}-accelprobe-{secrets.token_hex(3)}"
    t0 = time.monotonic()
    try:
        vm = await backend.create(sandbox_id, spec, boot_timeout_s=KVM_PROBE_TIMEOUT_S,
                                  machine=machine, check_boot=False)
    except RollboxError as exc:
        log.info("KVM probe boot failed (%s): microVMs use TCG", exc)
        why = exc.message.split(": ", 1)[-1].replace("\n", " ")[:200]
        return AccelChoice("tcg", f"a KVM probe guest did not reach its agent within "
                                  f"{KVM_PROBE_TIMEOUT_S:.0f} s ({why})",
                           round(time.monotonic() - t0, 2))
    took = round(time.monotonic() - t0, 2)
    await backend.destroy(vm)
    return AccelChoice("kvm", f"a KVM guest reached its agent in {took:.2f} s", took)
