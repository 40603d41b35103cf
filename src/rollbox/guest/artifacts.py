"""What a microVM backend needs to know about the guest ``make guest`` built.

The contract between QEMU's command line (``backends/microvm/qemu.py``) and the agent running
as the guest's init (``native/agent/agent.c``, guest mode):

- disks are virtio-blk found by serial: ``layer0`` .. ``layer<N-1>`` (EROFS, read-only; layer 0
  is the lowest, the base, as the container backend stacks them) and ``rw`` (ext4 the host made
  with ``mkfs.ext4`` on a fresh file and never mounted: overlayfs's upper and work dirs);
- the kernel command line says how many layers to wait for (``rollbox.layers=N``) and whether
  there is a writable disk (``rollbox.rw=1``; absent: the upper is a tmpfs in guest memory);
- the agent serves the protocol (``rollbox.agent``, stream framing) on the virtio-serial port
  ``org.rollbox.agent`` (host side: a unix socket chardev).

Owns no process and no file: it reads ``manifest.json``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import InfraError


@dataclass(frozen=True)
class GuestArtifacts:
    kernel: Path
    initramfs: Path
    manifest: dict[str, object]

    @classmethod
    def load(cls, settings: Settings) -> "GuestArtifacts":
        try:
            manifest = json.loads(settings.vm_guest_manifest.read_text())
        except (OSError, ValueError) as exc:
            raise InfraError(f"guest artifacts missing ({settings.vm_guest_manifest}: {exc}); "
                             f"run `make guest`") from None
        for path in (settings.vm_kernel, settings.vm_initrd):
            if not path.is_file():
                raise InfraError(f"guest artifact {path} missing; run `make guest`")
        return cls(settings.vm_kernel, settings.vm_initrd, manifest)

    @property
    def kernel_version(self) -> str:
        return str(self.manifest["kernel_version"])

    @property
    def digest(self) -> str:
        """One digest of the kernel, initramfs and agent (part of a template's key)."""
        parts = [str(self.manifest[k]) for k in ("vmlinux_sha256", "initramfs_sha256",
                                                  "agent_sha256")]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()
