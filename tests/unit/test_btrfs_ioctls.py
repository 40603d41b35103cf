"""The btrfs and loop ioctl numbers, flags and structure layouts rollbox.isolation.btrfs uses
are the kernel's: a C program built against <linux/btrfs.h> and <linux/loop.h> prints them."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rollbox.isolation import btrfs

NAMES = [
    "BTRFS_IOC_SYNC", "BTRFS_IOC_SUBVOL_CREATE", "BTRFS_IOC_SNAP_DESTROY", "BTRFS_IOC_INO_LOOKUP",
    "BTRFS_IOC_SNAP_CREATE_V2", "BTRFS_IOC_SUBVOL_CREATE_V2", "BTRFS_IOC_FS_INFO",
    "BTRFS_IOC_QUOTA_CTL", "BTRFS_IOC_QGROUP_CREATE",
    "BTRFS_IOC_SNAP_DESTROY_V2", "BTRFS_SUBVOL_QGROUP_INHERIT", "BTRFS_QGROUP_INHERIT_SET_LIMITS",
    "BTRFS_QGROUP_LIMIT_MAX_RFER", "BTRFS_QUOTA_CTL_ENABLE", "BTRFS_SUPER_MAGIC",
    "BTRFS_FIRST_FREE_OBJECTID", "LOOP_CTL_GET_FREE", "LOOP_CONFIGURE", "LO_FLAGS_AUTOCLEAR",
    "LO_FLAGS_DIRECT_IO",
]
# (C expression, what the module assumes)
LAYOUT = {
    "sizeof(struct btrfs_ioctl_vol_args)": btrfs.VOL_ARGS_SIZE,
    "sizeof(struct btrfs_ioctl_vol_args_v2)": btrfs.VOL_ARGS_V2_SIZE,
    "BTRFS_SUBVOL_NAME_MAX": btrfs.VOL_ARGS_V2_NAME_MAX,
    "offsetof(struct btrfs_ioctl_vol_args_v2, name)": 56,
    "offsetof(struct btrfs_ioctl_vol_args_v2, size)": 24,
    "offsetof(struct btrfs_ioctl_vol_args_v2, qgroup_inherit)": 32,
    "offsetof(struct btrfs_ioctl_vol_args, name)": 8,
    "sizeof(struct btrfs_qgroup_inherit)": 72,
    "sizeof(struct btrfs_qgroup_limit)": 40,
    "offsetof(struct btrfs_qgroup_inherit, lim)": 32,
    "sizeof(struct btrfs_ioctl_qgroup_create_args)": btrfs.QGROUP_CREATE_SIZE,
    "sizeof(struct btrfs_ioctl_quota_ctl_args)": btrfs.QUOTA_CTL_SIZE,
    "sizeof(struct btrfs_ioctl_ino_lookup_args)": btrfs.INO_LOOKUP_SIZE,
    "sizeof(struct btrfs_ioctl_fs_info_args)": btrfs.FS_INFO_SIZE,
    "offsetof(struct btrfs_ioctl_fs_info_args, fsid)": 16,
    "sizeof(struct loop_info64)": btrfs.LOOP_INFO64_SIZE,
    "sizeof(struct loop_config)": btrfs.LOOP_CONFIG_SIZE,
    "offsetof(struct loop_config, info) + offsetof(struct loop_info64, lo_flags)": 8 + 52,
}


@pytest.fixture(scope="module")
def kernel_values(tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    if shutil.which("gcc") is None or not Path("/usr/include/linux/btrfs.h").exists():
        pytest.fail("gcc and the kernel headers (linux-libc-dev) are needed: make deps")
    exprs = [*NAMES, *LAYOUT]
    src = ("#include <stdio.h>\n#include <stddef.h>\n#include <linux/btrfs.h>\n"
           "#include <linux/btrfs_tree.h>\n#include <linux/magic.h>\n#include <linux/loop.h>\n"
           "int main(void) {\n"
           + "".join(f'printf("%llu\\n", (unsigned long long)({e}));\n' for e in exprs)
           + "return 0; }\n")
    d = tmp_path_factory.mktemp("btrfs-h")
    (d / "p.c").write_text(src)
    subprocess.run(["gcc", "-o", str(d / "p"), str(d / "p.c")], check=True)
    out = subprocess.run([str(d / "p")], check=True, capture_output=True, text=True).stdout
    return [int(v) for v in out.split()]


def test_ioctl_numbers_and_flags(kernel_values: list[int]) -> None:
    ours = {n: getattr(btrfs, n) for n in NAMES if n != "BTRFS_FIRST_FREE_OBJECTID"}
    ours["BTRFS_FIRST_FREE_OBJECTID"] = btrfs.SUBVOL_ROOT_INO
    kernel = dict(zip(NAMES, kernel_values))
    assert {n: hex(v) for n, v in ours.items()} == {n: hex(v) for n, v in kernel.items()}


def test_structure_layouts(kernel_values: list[int]) -> None:
    kernel = dict(zip(LAYOUT, kernel_values[len(NAMES):]))
    assert kernel == LAYOUT


def test_subvolume_names_are_checked() -> None:
    for bad in ("", ".", "..", "a/b", "a\0b", "x" * 256):
        with pytest.raises(ValueError):
            btrfs._name(bad, btrfs.VOL_ARGS_V2_NAME_MAX)
    assert btrfs._name("n0-0123abcd", 255) == b"n0-0123abcd"
