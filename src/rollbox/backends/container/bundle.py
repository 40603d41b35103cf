"""OCI runtime config for one sandbox (what runc is asked to build, in libcontainer's order:
namespaces, mounts, cgroups, capabilities, no_new_privs, rlimits, seccomp last)."""
from __future__ import annotations

import resource
from typing import Any

from rollbox.isolation import seccomp
from rollbox.isolation.userns import RANGE
from rollbox.models import Resources

AGENT_DIR = "/.rollbox"
AGENT_NAME = "rollbox-agent"

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


def oci_config(
    *,
    sandbox_id: str,
    rootfs: str,
    host_uid: int,
    agent_dir: str,
    netns_path: str | None,
    cgroups_path: str,
    resources: Resources,
    hostname: str,
) -> dict[str, Any]:
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
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [f"{AGENT_DIR}/{AGENT_NAME}"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                {"type": "RLIMIT_FSIZE", "hard": disk_bytes, "soft": disk_bytes},
            ],
            "noNewPrivileges": True,
            "oomScoreAdj": 500,
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
            # No host /sys: an empty read-only tmpfs (sysfs would need a netns owned by the
            # sandbox's user namespace, and runc's fallback is a bind of the host's /sys).
            {"destination": "/sys", "type": "tmpfs", "source": "sysfs-empty",
             "options": ["nosuid", "noexec", "nodev", "ro", "size=4k"]},
            {"destination": AGENT_DIR, "type": "bind", "source": agent_dir,
             "options": ["bind", "ro", "nosuid", "nodev"]},
        ],
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": host_uid, "size": RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": host_uid, "size": RANGE}],
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": {
                "memory": {"limit": mem, "swap": mem},
                "cpu": {"quota": int(resources.cpus * period), "period": period},
                "pids": {"limit": resources.pids},
                "devices": [{"allow": False, "access": "rwm"}],
            },
            "rootfsPropagation": "private",
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp.profile(),
        },
    }
