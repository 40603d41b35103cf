"""Builds the full VM's guest artifacts (``make vmguest``: ``python -m rollbox.guest.vmbuild``).

The same recipe as the microVM guest (``rollbox.guest.build``, whose functions it calls) for a
kernel that can draw and take input: the bzImage of Debian's generic ``linux-image-amd64``
(the cloud kernel has no DRM and no USB), booted as is by SeaBIOS (no vmlinux extraction, no
PVH note needed), and an initramfs with the agent as ``/init``, the platform's tools and the
modules of :data:`WANTED_MODULES` (virtio over PCI, USB HID, the VGA device's DRM driver).
The deb is fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` (never
installed), cached by version beside the manifest. The contract these artifacts meet is
docs/backends/vm.md ("Guest boot contract").

Owns ``Settings.vm_full_kernel``, ``vm_full_initrd``, ``vm_full_guest_manifest`` and the cache
beside the manifest; must not touch the microVM guest's artifacts.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import InfraError
from rollbox.guest.build import build_guest, run_build

# Module -> the virtio device id it drives when only that device needs it (0: always loaded),
# as rollbox.guest.build. virtio_pci is the transport on q35; bochs is the DRM driver of
# `-device VGA` (Xorg's modesetting needs it; the text-mode guest loads it too, which puts
# the console on a framebuffer); xhci/usbhid/hid_generic the tablet and keyboard;
# crc32c_generic first: libcrc32c (erofs, overlay need it) asks the crypto API for crc32c at
# load, which this kernel has as a module (the cloud kernel builds it in); ext4 is a module
# here too (the writable disk).
WANTED_MODULES = {
    "crc32c_generic": 0, "ext4": 0, "virtio_pci": 0, "virtio_blk": 0, "virtio_console": 0,
    "erofs": 0, "overlay": 0,
    "virtio_balloon": 5, "virtio_net": 1, "virtio_rng": 4,
    "xhci_pci": 0, "usbhid": 0, "hid_generic": 0, "evdev": 0, "bochs": 0,
}


def install_bzimage(vmlinuz: Path, dest: Path) -> None:
    """The bzImage as it is (SeaBIOS boots it), checked to be one."""
    with open(vmlinuz, "rb") as f:
        head = f.read(0x206)
    if head[0x202:0x206] != b"HdrS":
        raise InfraError(f"{vmlinuz}: not a bzImage (no HdrS setup header)")
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(vmlinuz, tmp)
    os.replace(tmp, dest)


def build(settings: Settings) -> dict[str, object]:
    return build_guest(settings, package=settings.vm_full_kernel_package,
                       kernel=settings.vm_full_kernel, initrd=settings.vm_full_initrd,
                       manifest_path=settings.vm_full_guest_manifest, wanted=WANTED_MODULES,
                       install_kernel=install_bzimage, kernel_key="bzimage_sha256")


def main() -> int:
    return run_build("vmguest", build)


if __name__ == "__main__":
    raise SystemExit(main())
