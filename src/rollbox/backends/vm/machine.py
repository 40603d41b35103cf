"""QEMU's command line for one full VM (``q35``, SeaBIOS, VGA, USB tablet and keyboard).

The same rules as a microVM's (``rollbox.backends.microvm.qemu``, whose constants and
:class:`~rollbox.backends.microvm.qemu.MachineSpec` it uses): only fixed jail paths and
inherited descriptors, so equal specs give equal argvs; fd 3 the agent's port, fd 4 QMP,
fd 5 the serial console, fd 6 a network policy's tap. What differs: PCI devices (virtio-*-pci),
QEMU's default firmware (SeaBIOS, booting ``-kernel``/``-initrd`` through linuxboot, so the
kernel gets ``screen_info`` and draws on the VGA device), ``-device VGA -display none``,
``-vnc none`` (a viewer is a socketpair handed over with QMP ``add_client``: nothing listens),
``qemu-xhci`` with ``usb-tablet`` and q35's PS/2 keyboard, and the console on tty1 (``/dev/console``:
what the keyboard types is echoed on the screen). A disk image guest (``spec.root_disk``) has
no layers and no rw disk but the root disk chain of ``rootdisk.py`` (serial ``root``). The
guest contract: docs/backends/vm.md.

Owns the argv; does not start processes (``microvm/jail.py``) or know sandboxes.
"""
from __future__ import annotations

from rollbox.backends.microvm import qemu
from rollbox.backends.vm import display
from rollbox.backends.microvm.qemu import MachineSpec
from rollbox.backends.vm import rootdisk

# console=tty1 last: /dev/console (the agent's stdio, init's) is the VGA screen's tty.
VM_CMDLINE = ("console=ttyS0", "console=tty1", "quiet", "panic=-1", "reboot=t")


def argv(spec: MachineSpec, binary: str = "/usr/bin/qemu-system-x86_64") -> list[str]:
    if spec.ram:
        raise ValueError("a full VM has anonymous RAM only (no template RAM file)")
    return [
        binary, "-M", f"q35,mem-merge={'on' if spec.mem_merge else 'off'}",
        *qemu.accel_args(spec), "-smp", str(spec.cpus), "-m", str(spec.memory_mib),
        "-nodefaults", "-no-user-config", "-no-reboot", "-sandbox", qemu.SANDBOX_ARG,
        "-kernel", qemu.KERNEL, "-initrd", qemu.INITRD,
        "-append", qemu.kernel_cmdline(spec, VM_CMDLINE),
        "-device", f"VGA,id={display.DISPLAY_ID}", "-display", "none", "-vnc", "none",
        # the keyboard is q35's PS/2 one (i8042, 256-byte queue): USB HID's queue holds 16
        # events and QEMU drops the rest, so fast typing lost keys and key-ups (autorepeat)
        # the tablet bound to the VGA console: input events sent there reach it even while
        # QEMU holds the PS/2 mouse active (a restored VM: display.DISPLAY_ID)
        "-device", "qemu-xhci,id=usb",
        "-device", f"usb-tablet,bus=usb.0,display={display.DISPLAY_ID}",
        *qemu.channel_args("pci"), *qemu.device_args(spec, "pci"),
        *(rootdisk.blockdev_args() if spec.root_disk else ()),
    ]
