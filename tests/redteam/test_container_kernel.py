"""Red team C14-C23 (+A3): kernel surface and privilege, attacked from inside real sandboxes.

Syscalls are made with python's ctypes (python:3.11 has no compiler); the 32-bit ABI probe is a
small static C helper built on the host and uploaded with the file API. Each hardened outcome
has an unhardened twin where the attack can succeed without endangering the host (the twin
keeps the user namespace: its root is still an unprivileged host uid)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs_python
from tests.redteam.conftest import (
    BB, PY, Boxes, container_only, microvm_default, needs_root, static_helper,
)

pytestmark = [needs_root, needs_python]

EPERM, ENOSYS = 1, 38

# Prints {probe: 0 on success or errno} for every probe; never leaves anything running.
PROBE = r'''
import ctypes, errno, json, os, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if r >= 0 else ctypes.get_errno()
out = {}
buf = ctypes.create_string_buffer(4096)
p = ctypes.addressof(buf)
out["mount_tmpfs"] = sc(165, ctypes.addressof(ctypes.create_string_buffer(b"x")),
                        ctypes.addressof(ctypes.create_string_buffer(b"/mnt")),
                        ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0, 0)
out["umount_proc"] = sc(166, ctypes.addressof(ctypes.create_string_buffer(b"/proc")), 2)  # disruptive
out["pivot_root"] = sc(155, ctypes.addressof(ctypes.create_string_buffer(b"/tmp")),            ctypes.addressof(ctypes.create_string_buffer(b"/tmp")))  # disruptive
out["setns"] = sc(308, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)
out["bpf"] = sc(321, 0, p, 48)
out["io_uring_setup"] = sc(425, 4, p)
out["kexec_load"] = sc(246, 0, 0, 0, 0)
out["init_module"] = sc(175, p, 16, p)
out["finit_module"] = sc(313, 0, p, 0)
out["keyctl"] = sc(250, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
out["add_key"] = sc(248, ctypes.addressof(ctypes.create_string_buffer(b"user")),
                    ctypes.addressof(ctypes.create_string_buffer(b"rbx")), p, 4, -3)
attr = bytearray(128); struct.pack_into("<IIQ", attr, 0, 1, 128, 0)  # software cpu-clock
ab = ctypes.create_string_buffer(bytes(attr))
out["perf_event_open"] = sc(298, ctypes.addressof(ab), 0, -1, -1, 0)
out["userfaultfd"] = sc(323, 1)  # UFFD_USER_MODE_ONLY
out["clock_settime"] = sc(227, 0, ctypes.addressof(ctypes.create_string_buffer(16)))
out["settimeofday"] = sc(164, ctypes.addressof(ctypes.create_string_buffer(16)), 0)
out["ptrace_pid1"] = sc(101, 16, 1, 0, 0)  # PTRACE_ATTACH to the agent  # disruptive
out["process_vm_readv_pid1"] = sc(310, 1, p, 1, p, 1, 0)
out["open_by_handle_at"] = sc(304, -100, p, 0)
out["swapon"] = sc(167, ctypes.addressof(ctypes.create_string_buffer(b"/tmp/x")), 0)  # disruptive
REBOOT_LINE = 1
out["syslog"] = sc(103, 3, p, 100)
out["fsopen"] = sc(430, ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0)
out["open_tree"] = sc(428, -100, ctypes.addressof(ctypes.create_string_buffer(b"/")), 1)
out["pidfd_getfd"] = sc(438, 0, 3, 0)
out["clone_newuser"] = -1
try:
    os.mkdir("/tmp/dev")
except FileExistsError:
    pass
try:
    os.mknod("/tmp/dev/mem", 0o600 | 0o020000, os.makedev(1, 1)); out["mknod_mem"] = 0
except OSError as e:
    out["mknod_mem"] = e.errno
for name, fam, typ, proto in [("packet", 17, socket.SOCK_RAW, 0x0300),
                              ("raw_ip", 2, socket.SOCK_RAW, 1)]:
    try:
        socket.socket(fam, typ, proto).close(); out["sock_" + name] = 0
    except OSError as e:
        out["sock_" + name] = e.errno
# Last: a successful unshare moves this process into new namespaces.
out["unshare_net"] = sc(272, 0x40000000)
out["unshare_mnt"] = sc(272, 0x00020000)
out["unshare_user"] = sc(272, 0x10000000)
print(json.dumps(out))
'''

# reboot(POWER_OFF) in a pid namespace kills that namespace only; the unhardened twin skips it
# (it would end the twin sandbox, not the host).
REBOOT = 'out["reboot"] = sc(169, 0xfee1dead, 0x28121969, 0x4321FEDC, 0)\n'
HARDENED_PROBE = PROBE.replace("REBOOT_LINE = 1\n", REBOOT)
# The twin also skips what would only wreck its own sandbox (pivot_root moves the agent's root,
# umount of /proc, swapon, and a ptrace attach that would leave the agent stopped).
TWIN_PROBE = "\n".join(x for x in PROBE.splitlines() if not x.endswith("# disruptive"))

# Everything here must be refused by the hardened profile (EPERM, or the documented errno).
MUST_FAIL = [
    "unshare_user", "unshare_mnt", "unshare_net", "mount_tmpfs", "umount_proc", "pivot_root",
    "setns", "bpf", "io_uring_setup", "kexec_load", "init_module", "finit_module", "keyctl",
    "add_key", "perf_event_open", "userfaultfd", "clock_settime", "settimeofday",
    "ptrace_pid1", "process_vm_readv_pid1", "open_by_handle_at", "swapon", "reboot",
    "syslog", "fsopen", "open_tree", "pidfd_getfd", "mknod_mem", "sock_packet", "sock_raw_ip",
]


@container_only("container seccomp + user namespace; in a VM these syscalls reach only the guest's own kernel (in-guest root is expected)")
async def test_c14_c23_dangerous_syscalls_refused(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    r = await boxes.py(sid, HARDENED_PROBE)
    assert r.exit_code == 0, r
    res = json.loads(r.stdout)
    allowed = {k: v for k, v in res.items() if k in MUST_FAIL and v == 0}
    assert not allowed, f"hardened sandbox allowed: {allowed}"
    # The seccomp layer itself answers (EPERM), not a lucky missing feature.
    seccomp_denied = ["unshare_user", "mount_tmpfs", "bpf", "io_uring_setup", "keyctl",
                      "perf_event_open", "userfaultfd", "clock_settime", "fsopen", "open_tree"]
    assert {k: res[k] for k in seccomp_denied} == {k: EPERM for k in seccomp_denied}, res


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_c14_c18_unhardened_twin(boxes: Boxes) -> None:
    sid = await boxes.make(PY, hardened=False)
    r = await boxes.py(sid, TWIN_PROBE)
    res = json.loads(r.stdout)
    # Without seccomp and with every capability (inside the user namespace), these work.
    for k in ("unshare_user", "unshare_mnt", "keyctl", "io_uring_setup"):
        assert res[k] == 0, (k, res)
    # Host-level privileges stay out of reach even unhardened: the user namespace holds.
    # The agent is non-dumpable, but every capability in its user namespace passes the ptrace
    # access check: its memory is reachable (EFAULT: the address, not the permission).
    assert res["process_vm_readv_pid1"] != EPERM, res
    for k in ("kexec_load", "init_module", "clock_settime", "bpf", "mknod_mem"):
        assert res[k] != 0, (k, res)


# Every number comes from the kernel's definitions (tests/helpers/ioctl_numbers.c), never from
# the filter under test: a wrong number in the filter leaves the real ioctl open and fails here.
EXTENT_PROBE = r'''
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
src = os.open("/tmp/src", os.O_RDWR | os.O_CREAT, 0o644); os.write(src, b"x" * 8192)
dst = os.open("/tmp/dst", os.O_RDWR | os.O_CREAT, 0o644)
rng = ctypes.create_string_buffer(8192)
tmp = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)  # btrfs subvolume ioctls act on a directory
out = {}
for name, nr in json.loads(sys.argv[1]).items():
    for high in (0, 1 << 32, 0xFFFFFFFF00000000):
        a = src if name == "FICLONE" else ctypes.addressof(rng)
        fd = tmp if name.startswith("BTRFS_IOC_S") else dst
        r = libc.syscall(ctypes.c_long(16), ctypes.c_long(fd), ctypes.c_ulong(nr | high),
                         ctypes.c_long(a))
        out[f"{name}/{high:x}"] = 0 if r >= 0 else ctypes.get_errno()
print(json.dumps(out))
'''


async def extent_probe(boxes: Boxes, sid: str) -> dict[str, int]:
    from tests.helpers.ioctl_numbers import kernel_ioctl_numbers

    r = await boxes.run(sid, ["python3", "-c", EXTENT_PROBE, json.dumps(kernel_ioctl_numbers())])
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


@container_only("container seccomp on overlayfs over the host's btrfs pool; a VM's ioctls reach only its own ext4 disk")
async def test_a3_extent_ioctls_refused_even_with_high_bits(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    res = await extent_probe(boxes, sid)
    assert "XFS_IOC_EXCHANGE_RANGE/0" in res and "XFS_IOC_COMMIT_RANGE/0" in res, res
    assert set(res.values()) == {EPERM}, res  # seccomp, on the low 32 bits of the number


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_a3_unhardened_twin_reaches_the_filesystem(boxes: Boxes) -> None:
    sid = await boxes.make(PY, hardened=False)
    res = await extent_probe(boxes, sid)
    # Without the filter each call reaches the filesystem, which answers with its own errno
    # (overlayfs: ENOTTY for the XFS ioctls, EOPNOTSUPP/EXDEV/EINVAL for clone and dedupe), so
    # the EPERM above is seccomp's.
    for name in ("FICLONE", "XFS_IOC_EXCHANGE_RANGE", "XFS_IOC_START_COMMIT",
                 "XFS_IOC_COMMIT_RANGE", "XFS_IOC_SWAPEXT", "BTRFS_IOC_SUBVOL_CREATE",
                 "BTRFS_IOC_SNAP_CREATE_V2"):
        assert res[f"{name}/0"] != EPERM and res[f"{name}/100000000"] != EPERM, res


@pytest.fixture(scope="module")
def abi32_helper() -> bytes:
    return static_helper("abi32")


@container_only("container seccomp bad-arch action; the 32-bit ABI of a VM reaches only the guest kernel")
async def test_c23_32bit_abi_refused(boxes: Boxes, abi32_helper: bytes) -> None:
    sid = await boxes.make(BB)
    await boxes.edge.file_write(sid, "/tmp/abi32", abi32_helper, 0o755)
    r = await boxes.run(sid, ["/tmp/abi32", "native"])
    assert r.exit_code == 0 and int(r.stdout) > 1, r  # the helper itself works
    r = await boxes.run(sid, ["/tmp/abi32", "int80"])
    assert r.signal == 31 or (r.exit_code == 0 and int(r.stdout) < 0), r  # SIGSYS: bad arch
    r = await boxes.run(sid, ["/tmp/abi32", "x32"])
    assert r.signal == 31 or (r.exit_code == 0 and int(r.stdout) < 0), r


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_c23_unhardened_twin_int80_works(boxes: Boxes, abi32_helper: bytes) -> None:
    sid = await boxes.make(BB, hardened=False)
    await boxes.edge.file_write(sid, "/tmp/abi32", abi32_helper, 0o755)
    r = await boxes.run(sid, ["/tmp/abi32", "int80"])
    if r.exit_code == 0 and int(r.stdout) < 0:
        pytest.skip("kernel without IA-32 emulation: nothing to refuse")
    assert r.exit_code == 0 and int(r.stdout) > 1, r


@container_only("guest root may leave the command chroot for its own VM's initramfs (the guest is its own); leaving the VM is F41")
async def test_c14_chroot_escape_stays_in_sandbox(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    code = ("import os\nos.makedirs('/tmp/j/k', exist_ok=True)\nopen('/marker', 'w').close()\n"
            "fd = os.open('/', os.O_RDONLY)\n"
            "os.chroot('/tmp/j')\nos.fchdir(fd)\n"
            "for _ in range(64): os.chdir('..')\nos.chroot('.')\n"
            "print(os.path.exists('/marker'), os.path.exists('/work/main'))\n")
    r = await boxes.py(sid, code)
    assert r.stdout == "True False\n", r  # still the sandbox's root, not the host's


@container_only("container cgroup namespace over the host's cgroups; a VM's cgroupfs is the guest kernel's own")
async def test_c15_cgroupfs_unreachable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "cat /proc/self/cgroup; ls /sys/fs 2>&1; mkdir -p /tmp/cg; "
                        "mount -t cgroup2 none /tmp/cg; echo m=$?; echo 0 > /sys/fs/cgroup/"
                        "cgroup.procs; echo w=$?")
    paths = [line.split(":", 2)[2] for line in r.stdout.splitlines() if line[:1].isdigit()]
    # cgroup namespace: the sandbox's own cgroup is its root; no host cgroup path shows.
    assert paths and all(p in ("/", "/x1") for p in paths), r.stdout
    assert "m=0" not in r.stdout and "w=0" not in r.stdout, r


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_c15_unhardened_twin_can_mount_cgroupfs(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hardened=False)
    r = await boxes.run(sid, "mkdir -p /tmp/cg; mount -t cgroup2 none /tmp/cg; echo m=$?; "
                        "ls /tmp/cg | head -3")
    assert "m=0" in r.stdout, r


@microvm_default
async def test_c16_c17_platform_processes_untouchable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "kill -9 1; kill -TERM 1; kill -9 -1; echo sent; "
                        "ls /proc | grep -c '^[0-9]'; cat /proc/[0-9]*/cmdline | "
                        "tr '\\0' ' ' | grep -c -E 'py[t]est|qem[u]-system|rollbox[.]cli' || true")
    assert "sent" in r.stdout
    procs, platform = (int(x) for x in r.stdout.split()[-2:])
    assert platform == 0, r  # no process of the edge, the host or QEMU is visible
    if boxes.kind == "container":
        # The edge and every host process live outside the sandbox's pid namespace: only the
        # agent (1) and this command's own processes are visible. (A VM's own kernel has
        # its threads: the host's processes are in another kernel.)
        assert procs <= 4, r
    r = await boxes.run(sid, ["echo", "agent survived"])
    assert r.stdout == "agent survived\n"


@container_only("a VM's devices are its own emulated ones, guest root may use them; what they reach on the host is F41")
async def test_c20_devices(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "ls /dev; cat /dev/mem; echo mem=$?; ls /dev | grep -c -E "
                        "'^(sd|vd|nvme|loop|dm-|kmsg|mem|port)' || true")
    assert "mem=0" not in r.stdout and r.stdout.strip().endswith("0"), r


@container_only("nosuid/no_new_privs against host root in a container; in a VM root of the guest is expected")
async def test_c21_setuid_gives_nothing(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    r = await boxes.run(sid, "cp $(command -v python3) /tmp/suid-py && chmod 4755 /tmp/suid-py"
                        " && ls -l /tmp/suid-py")
    assert "rws" in r.stdout, r
    r = await boxes.run(sid, ["/tmp/suid-py", "-c", "import os; print(os.geteuid())"],
                        user="1000")
    assert r.stdout.strip() == "1000", r  # nosuid root mount + no_new_privs


@container_only("container seccomp; a VM has no terminal of a platform process to inject into")
async def test_c22_tiocsti_refused(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    code = ("import os, fcntl, pty\nm, s = pty.openpty()\n"
            "try:\n    fcntl.ioctl(s, 0x5412, b'x'); print('injected')\n"
            "except OSError as e:\n    print(e.errno)\n")
    r = await boxes.py(sid, code)
    assert r.stdout.strip() == str(EPERM), r
