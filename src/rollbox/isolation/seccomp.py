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


# ---- the profile as a BPF program (the native runtime loads it itself) --------------------
# libseccomp's own numbers (seccomp.h): the same library runc builds its filter with, so both
# runtimes load the same program for the same profile.
_ACTIONS = {"SCMP_ACT_KILL": 0x00000000, "SCMP_ACT_KILL_THREAD": 0x00000000,
            "SCMP_ACT_KILL_PROCESS": 0x80000000, "SCMP_ACT_TRAP": 0x00030000,
            "SCMP_ACT_LOG": 0x7FFC0000, "SCMP_ACT_ALLOW": 0x7FFF0000}
_ERRNO_ACTION = 0x00050000
_ARCHES = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_X86": 0x40000003,
           "SCMP_ARCH_X32": 0x4000003E}
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
        "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
_NR_SCMP_ERROR = -1
_compiled: dict[str, bytes] = {}
# The profiles compiled so far (deep copies) and their programs: the lookup every create does
# is a dict comparison (C speed), not a sorted JSON dump of ~60 rules (~0.2 ms).
_recent: list[tuple[dict[str, Any], bytes]] = []


def _action(name: str, errno_ret: int | None) -> int:
    if name == "SCMP_ACT_ERRNO":
        return _ERRNO_ACTION | ((1 if errno_ret is None else errno_ret) & 0xFFFF)
    if name not in _ACTIONS:
        raise ValueError(f"seccomp action {name!r} not supported")
    return _ACTIONS[name]


def compile_bpf(prof: dict[str, Any]) -> bytes:
    """The BPF program (struct sock_filter array) of an OCI seccomp profile, built by
    libseccomp (``libseccomp.so.2``, runc's own dependency) as runc builds it: the profile's
    default action, its architectures (the native one replaced by them), one rule per
    syscall name and argument set; names this kernel's ABI does not have are skipped, as runc
    skips them. Cached per profile (it is the same for every sandbox)."""
    import copy
    import ctypes
    import json
    import os

    for known, program in _recent:
        if known == prof:
            return program
    key = json.dumps(prof, sort_keys=True)
    if key in _compiled:
        return _compiled[key]

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]

    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_remove.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(ArgCmp)]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]

    def check(ret: int, what: str) -> None:
        if ret < 0:
            raise OSError(-ret, f"libseccomp {what}: {os.strerror(-ret)}")

    ctx = lib.seccomp_init(_action(prof["defaultAction"], prof.get("defaultErrnoRet")))
    if not ctx:
        raise OSError(ctypes.get_errno(), "seccomp_init failed")
    try:
        check(lib.seccomp_attr_set(ctx, 3, 0), "no_new_privs off")  # the runtime sets it
        native = lib.seccomp_arch_native()
        arches = [_ARCHES[a] for a in prof.get("architectures", [])]
        for arch in arches:
            if arch != native:
                check(lib.seccomp_arch_add(ctx, arch), "arch")
        if arches and native not in arches:
            check(lib.seccomp_arch_remove(ctx, native), "arch")
        for rule in prof.get("syscalls", []):
            action = _action(rule["action"], rule.get("errnoRet"))
            conds = rule.get("args") or []
            arr = (ArgCmp * max(1, len(conds)))(*[
                ArgCmp(c["index"], _OPS[c["op"]], c["value"], c.get("valueTwo", 0))
                for c in conds])
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr == _NR_SCMP_ERROR:
                    continue  # not a syscall of this ABI (e.g. stime on x86_64)
                check(lib.seccomp_rule_add_array(ctx, action, nr, len(conds), arr), name)
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
        try:
            check(lib.seccomp_export_bpf(ctx, fd), "export")
            program = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    _compiled[key] = program
    if len(_recent) < 8:  # a few profiles per node (hardened, per-build variants)
        _recent.append((copy.deepcopy(prof), program))
    return program
