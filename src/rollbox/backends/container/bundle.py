"""OCI runtime config for one sandbox (what runc is asked to build, in libcontainer's order:
namespaces, mounts, cgroups, capabilities, no_new_privs, rlimits, seccomp last).

``hardened=False`` builds a deliberately weak sandbox for the red-team tests only (their "the
attack works without hardening" twins): no seccomp, every capability, no masked or read-only
/proc paths, no no_new_privs, no Landlock. It keeps the user namespace (sandbox root is still an
unprivileged host uid), the cgroup limits and the capped disk, so it never endangers the host.
It is not reachable from the HTTP API.
"""
from __future__ import annotations

import functools
import posixpath
import resource
import shutil
from collections.abc import Sequence
from typing import Any

from rollbox.backends.container.cpuview import CPU_SYS_FILES, CpuView
from rollbox.backends.container.masks import NodeMask
from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import qos, seccomp
from rollbox.isolation.userns import RANGE
from rollbox.models import Resources

AGENT_NAME = "rollbox-agent"
# The agent is never in the sandbox's tree: runc execs it from this inherited fd (an O_RDONLY
# fd of the host's root-owned copy; --preserve-fds 3 keeps fds 3, 4 and 5), and the agent closes
# it first thing. So no path inside the sandbox leads to the platform's binary. Fd 5 is the
# platform shell (agent/platform_shell.py), which the agent keeps (close-on-exec) to exec it by fd.
AGENT_EXE_FD = 4

# Docker's default set minus MKNOD, NET_RAW (raw sockets) and AUDIT_WRITE.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_SETFCAP",
]

MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/proc/kpagecgroup", "/proc/kpagecount", "/proc/kpageflags", "/proc/kpageidle",
    "/proc/sysrq-trigger", "/proc/vmallocinfo", "/proc/slabinfo", "/proc/pagetypeinfo",
    "/proc/buddyinfo", "/proc/zoneinfo", "/proc/mtrr", "/proc/interrupts", "/proc/kallsyms",
    "/proc/modules", "/proc/iomem", "/proc/ioports",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]

# The node's empty read-only mask dir (masks.py), for a runtime that binds it over the masked
# directories instead of a tmpfs of each one's own (the native launcher; runc mounts a tmpfs
# per masked directory itself and ignores the annotation).
MASK_ANNOTATION = "org.rollbox.mask-dir"
SYS_OPTIONS = ["bind", "ro", "nosuid", "noexec", "nodev"]

# The kernel's boot id, which a container would share with the host (and with every other
# sandbox, across its own restarts): each boot of a sandbox gets its own, a file the platform
# writes beside its tree (never in it) at each start, bound read-only over this path. runc
# refuses mount destinations inside /proc (all but a few lxcfs-style files), so the bind is
# made by a createContainer hook: the host's own mount(8), run by runc in the container's new
# mount namespace after its mounts and before pivot_root (no code of the sandbox has run yet,
# and the sandbox's seccomp filter forbids mount/umount, so it can not take the bind away).
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Every capability the kernel knows (for the unhardened test twin only).
ALL_CAPABILITIES = CAPABILITIES + [
    "CAP_DAC_READ_SEARCH", "CAP_LINUX_IMMUTABLE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN",
    "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
]

# Agent environment (read once by the agent, never passed on to commands): colon-separated
# absolute paths its commands get no Landlock access to; unset = Landlock off.
LANDLOCK_ENV = "ROLLBOX_LANDLOCK_DENY"


def _cpu_view_mounts(view: CpuView) -> list[dict[str, Any]]:
    ro = ["bind", "ro", "nosuid", "noexec", "nodev"]
    return [{"destination": "/proc/cpuinfo", "type": "bind", "source": str(view.cpuinfo),
             "options": ro}] + [
        {"destination": f"/sys/devices/system/cpu/{name}", "type": "bind",
         "source": str(view.cpulist), "options": ro} for name in CPU_SYS_FILES]


BOOT_ID_OPTIONS = ["bind", "ro", "nosuid", "noexec", "nodev"]


@functools.cache
def host_mount() -> str:
    """The host's mount(8) (root-owned, from the system's own dirs), which the boot id hook
    runs; InfraError without one."""
    path = shutil.which("mount", path="/usr/bin:/bin")
    if path is None:
        raise InfraError("mount(8) missing on the host (util-linux)")
    return path


def _boot_id_hook(rootfs: str, source: str, mount_bin: str) -> dict[str, Any]:
    """The createContainer hook that binds ``source`` read-only over the boot id."""
    return {"path": mount_bin,
            "args": ["mount", "--bind", "-o", ",".join(BOOT_ID_OPTIONS[1:]), source,
                     rootfs.rstrip("/") + BOOT_ID_PATH]}


def boot_id_source(config: dict[str, Any]) -> str | None:
    """The boot id file an OCI config of :func:`oci_config` binds (None: none), for a runtime
    that makes the bind itself (the native launcher, which runs no hooks). InfraError for any
    other hook: a runtime without hooks must not drop one silently."""
    hooks = config.get("hooks")
    if not hooks:
        return None
    made = hooks.get("createContainer") or []
    if set(hooks) != {"createContainer"} or len(made) != 1:
        raise InfraError(f"OCI hooks {sorted(hooks)} are not supported here")
    args = made[0].get("args") or []
    if made[0] != _boot_id_hook(config["root"]["path"], args[-2] if len(args) > 1 else "",
                                host_mount()):
        raise InfraError("an OCI hook other than the boot id's is not supported here")
    return str(args[-2])


def normalize_hidden(paths: Sequence[str]) -> list[str]:
    """Absolute, normalized, ':'-free hidden paths (not '/', not under /proc, /sys, /dev)."""
    out: list[str] = []
    for raw in paths:
        p = posixpath.normpath("/" + raw.lstrip("/")) if raw else ""
        if (not raw.startswith("/") or p == "/" or ":" in p or "\0" in p
                or p.split("/")[1] in ("proc", "sys", "dev")):
            raise BadRequest(f"bad hidden path: {raw!r}")
        if p not in out:
            out.append(p)
    return out


def oci_config(
    *,
    sandbox_id: str,
    rootfs: str,
    host_uid: int,
    netns_path: str | None,
    cgroups_path: str,
    resources: Resources,
    hostname: str,
    hardened: bool = True,
    hidden_paths: Sequence[str] = (),
    cpu_view: CpuView | None = None,
    boot_id: str | None = None,
    mask: NodeMask,
) -> dict[str, Any]:
    """hidden_paths: paths of the sandbox tree its commands must not see (e.g. a task's
    tests): masked by mounts (an empty read-only tmpfs / /dev/null over them) and, as a second
    layer, left out of the commands' Landlock rules. The host-side file API still sees them.
    cpu_view: the sandbox's cpuset and its generated /proc/cpuinfo and /sys (cpuview.py).
    boot_id: the host file with this boot's id, bound read-only over
    /proc/sys/kernel/random/boot_id (BOOT_ID_PATH); None: the kernel's own shows.
    mask: the node's read-only mask filesystem: /sys is a read-only bind of its ``sys`` (the
    CPU view's mount points; its ``empty`` dir without a CPU view), and the native launcher
    binds its ``empty`` over the masked directories (MASK_ANNOTATION)."""
    hidden = normalize_hidden(hidden_paths)
    disk_bytes = resources.disk_mib << 20
    # A user namespace can't raise a hard limit above what runc itself inherited.
    nofile = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    mem = resources.memory_mib << 20
    period = 100_000
    namespaces: list[dict[str, str]] = [
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
        {"type": "user"}, {"type": "cgroup"},
    ]
    if netns_path != "host":  # "host": no network namespace entry, i.e. the host's stack
        namespaces.append({"type": "network", "path": netns_path} if netns_path
                          else {"type": "network"})
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    if hardened and hidden:
        env.append(f"{LANDLOCK_ENV}={':'.join(hidden)}")
    caps = CAPABILITIES if hardened else ALL_CAPABILITIES
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [f"/proc/self/fd/{AGENT_EXE_FD}"],
            "env": env,
            "cwd": "/",
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                {"type": "RLIMIT_FSIZE", "hard": disk_bytes, "soft": disk_bytes},
                # no nice below 0, no real-time priority: a batch sandbox can not leave the
                # idle class (isolation.qos)
                *({"type": name, "hard": value, "soft": value} for name, value in qos.RLIMITS),
            ],
            "noNewPrivileges": hardened,
            # 0 written by runc (privileged where it can) fixes the floor the sandbox's
            # processes can lower themselves to; the edge then protects the agent alone.
            "oomScoreAdj": 0,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            # No host /sys (sysfs would need a netns owned by the sandbox's user namespace,
            # and runc's fallback is a bind of the host's /sys): a read-only bind of the
            # node's mask (masks.py: no superblock per sandbox) holding only the mount points
            # of the platform's generated CPU files (bound read-only below), or empty.
            {"destination": "/sys", "type": "bind",
             "source": str(mask.sys if cpu_view else mask.empty), "options": SYS_OPTIONS},
        ] + (_cpu_view_mounts(cpu_view) if cpu_view else []),
        "annotations": {MASK_ANNOTATION: str(mask.empty)},
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": host_uid, "size": RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": host_uid, "size": RANGE}],
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": {
                "memory": {"limit": mem, "swap": mem},
                "cpu": {"quota": int(resources.cpus * period), "period": period,
                        **({"cpus": cpu_view.cpuset} if cpu_view else {})},
                "pids": {"limit": resources.pids},
                "devices": [{"allow": False, "access": "rwm"}],
            },
            "rootfsPropagation": "private",
            "maskedPaths": MASKED_PATHS + hidden if hardened else [],
            "readonlyPaths": READONLY_PATHS if hardened else [],
        },
    }
    if boot_id is not None:
        config["hooks"] = {"createContainer": [_boot_id_hook(rootfs, boot_id, host_mount())]}
    if hardened:
        config["linux"]["seccomp"] = seccomp.profile()
    else:  # ambient too, so commands run as root keep every capability across exec
        config["process"]["capabilities"]["inheritable"] = list(caps)
        config["process"]["capabilities"]["ambient"] = list(caps)
    return config
