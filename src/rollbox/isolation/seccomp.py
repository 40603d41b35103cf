"""Default seccomp profile (OCI form) for sandbox processes.

Default allow with an explicit deny list: the kernel surfaces agents have no business with
(bpf, io_uring, kexec, modules, keyring, perf, userfaultfd, clock setting, new namespaces,
mounts, ptrace) return EPERM. Only the native x86_64 ABI is accepted: i386 and x32 calls hit
libseccomp's bad-arch action (kill), so filters can not be dodged through another ABI. ioctl
numbers are compared on their low 32 bits only, as the kernel does; they are checked against
the kernel's own definitions by tests/unit/test_seccomp_ioctls.py (hand-written numbers drift).
"""
from __future__ import annotations

from typing import Any

DENY = [
    "bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "clock_settime",
    "clock_adjtime", "settimeofday", "adjtimex", "stime", "mount", "umount2", "pivot_root",
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff", "reboot", "acct",
    "quotactl", "lookup_dcookie", "fanotify_init", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "syslog", "vhangup", "iopl", "ioperm",
    "nfsservctl", "personality", "uselib", "ustat", "sysfs", "_sysctl", "get_kernel_syms",
    "query_module", "vm86", "vm86old", "pidfd_getfd",
]

# clone flags that create namespaces (CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET)
CLONE_NS_MASK = 0x7E020000
# ioctls that share, swap or exchange another file's blocks or inject terminal input (low 32
# bits). FICLONE/FICLONERANGE/FIDEDUPERANGE are also btrfs's BTRFS_IOC_CLONE/_CLONE_RANGE/
# _FILE_EXTENT_SAME (same numbers).
DENY_IOCTLS = {
    "FICLONE": 0x40049409,
    "FICLONERANGE": 0x4020940D,
    "FIDEDUPERANGE": 0xC0189436,
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "XFS_IOC_EXCHANGE_RANGE": 0x40285881,  # _IOW('X', 129, struct xfs_exchange_range), 40 bytes
    "XFS_IOC_START_COMMIT": 0x80585882,  # _IOR('X', 130, struct xfs_commit_range), 88 bytes
    "XFS_IOC_COMMIT_RANGE": 0x40585883,  # _IOW('X', 131, struct xfs_commit_range)
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
    # btrfs subvolumes and snapshots: a new subvolume is outside the sandbox's qgroup limit
    # (the disk tier's cap). overlayfs does not pass them on today (ENOTTY); this keeps it so.
    "BTRFS_IOC_SUBVOL_CREATE": 0x5000940E,
    "BTRFS_IOC_SUBVOL_CREATE_V2": 0x50009418,
    "BTRFS_IOC_SNAP_CREATE": 0x50009401,
    "BTRFS_IOC_SNAP_CREATE_V2": 0x50009417,
    "BTRFS_IOC_SNAP_DESTROY": 0x5000940F,
    "BTRFS_IOC_SNAP_DESTROY_V2": 0x5000943F,
}


def profile() -> dict[str, Any]:
    syscalls: list[dict[str, Any]] = [
        {"names": DENY, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
        # clone3 passes flags in a struct seccomp can't read: make libc fall back to clone.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
    ]
    # clone: deny when any namespace bit is set; OCI MASKED_EQ is (arg & value) == valueTwo.
    for bit in range(32):
        flag = 1 << bit
        if CLONE_NS_MASK & flag:
            syscalls.append({
                "names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            })
    for number in DENY_IOCTLS.values():
        syscalls.append({
            "names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
            "args": [{"index": 1, "value": 0xFFFFFFFF, "valueTwo": number,
                      "op": "SCMP_CMP_MASKED_EQ"}],
        })
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": syscalls,
    }
