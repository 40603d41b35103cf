"""What a microVM backend needs to know about the guest ``make guest`` built.

The contract between the host's QEMU command line and the agent running as the guest's init:

- disks are virtio-blk with serials: ``rbx-layer0`` .. ``rbx-layer<N-1>`` (EROFS, read-only;
  layer 0 is the lowest, the base) and ``rbx-rw`` (ext4 the host made with ``mkfs.ext4`` on a
  fresh file and never mounted: overlayfs's upper and work dirs go on it);
- the kernel command line says how many layers to wait for (``rollbox.layers=N``) and whether
  there is a writable disk (``rollbox.rw=1``; 0: the upper is a tmpfs in guest memory);
- the agent serves the protocol (``rollbox.agent``, stream framing) on the virtio-serial port
  named :data:`AGENT_PORT` (host side: a unix socket chardev).

Owns no process and no file: it reads ``manifest.json`` and formats command lines.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import InfraError

AGENT_PORT = "org.rollbox.agent"
RW_SERIAL = "rbx-rw"
HZ = 250  # Debian's cloud kernel (CONFIG_HZ_250): lpj = loops per jiffy at the TSC rate


def layer_serial(index: int) -> str:
    return f"rbx-layer{index}"


@dataclass(frozen=True)
class GuestArtifacts:
    kernel: Path
    initramfs: Path
    manifest: dict[str, object]

    @classmethod
    def load(cls, settings: Settings) -> "GuestArtifacts":
        try:
            manifest = json.loads(settings.guest_manifest.read_text())
        except (OSError, ValueError) as exc:
            raise InfraError(f"guest artifacts missing ({settings.guest_manifest}: {exc}); "
                             f"run `make guest`") from None
        for path in (settings.guest_kernel, settings.guest_initramfs):
            if not path.is_file():
                raise InfraError(f"guest artifact {path} missing; run `make guest`")
        return cls(settings.guest_kernel, settings.guest_initramfs, manifest)

    @property
    def kernel_version(self) -> str:
        return str(self.manifest["kernel_version"])

    @property
    def digest(self) -> str:
        """One digest of the kernel, initramfs and agent (part of a template's key)."""
        parts = [str(self.manifest[k]) for k in ("vmlinux_sha256", "initramfs_sha256",
                                                  "agent_sha256")]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def host_tsc_khz() -> int:
    """The host's TSC rate in kHz, as the guest should assume it (no PIT calibration)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    raise InfraError("cannot read the host's cpu MHz from /proc/cpuinfo")


def kernel_cmdline(layers: int, writable: bool = True, extra: tuple[str, ...] = ()) -> str:
    """The guest kernel's command line: serial console, a fixed TSC rate and loops-per-jiffy
    (under TCG ``-M microvm`` can hang calibrating against the PIT), quiet (every console line
    costs under TCG), and what the agent needs to know to build the sandbox root."""
    if layers < 1:
        raise ValueError("a guest needs at least one layer")
    khz = host_tsc_khz()
    args = ["console=ttyS0", "quiet", "panic=-1", f"tsc_early_khz={khz}",
            f"lpj={khz * 1000 // HZ}", f"rollbox.layers={layers}",
            f"rollbox.rw={1 if writable else 0}", *extra]
    return " ".join(args)
