"""ioctl numbers as the kernel's headers define them: compiles and runs ioctl_numbers.c on the
host (gcc, linux-libc-dev, xfslibs-dev: the Makefile's apt packages)."""
from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("ioctl_numbers.c")
# Other names of the same numbers (btrfs's clone/dedupe ioctls were hoisted into the VFS).
ALIASES = {"BTRFS_IOC_CLONE": "FICLONE", "BTRFS_IOC_CLONE_RANGE": "FICLONERANGE",
           "BTRFS_IOC_FILE_EXTENT_SAME": "FIDEDUPERANGE"}


@functools.cache
def kernel_ioctl_numbers() -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "ioctl_numbers"
        subprocess.run(["gcc", "-O0", "-Wall", "-Werror", "-o", str(exe), str(SOURCE)],
                       check=True, capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: int(value, 16) for name, value in (line.split() for line in out.splitlines())}
