"""The native runtime (``ROLLBOX_RUNTIME=native``): rollbox's own launcher
(native/launcher/launcher.c, ``build/rollbox-launcher``) starts a sandbox's init from one
process spawn, doing what runc does for the same OCI config, in runc's order.

Owns the translation of the OCI config bundle.py writes (the one runc gets) into the
launcher's input, and the spawn. The input is a flat list of records, each an op name and its
fields, every field NUL-terminated (a path can hold any byte but NUL, so nothing is quoted or
escaped), the seccomp program as a length then raw bytes; it is handed over in a sealed memfd
on fd 9 (no size limit of a pipe, nothing to deadlock on, nothing on disk). A binary format
read by a ~40-line reader keeps a JSON parser out of a root process, and leaves every decision
here: the launcher only carries out records. Anything in the config this module does not know
is refused (InfraError) instead of being dropped, so a config change that the native runtime
does not carry out fails loudly.

Where a superblock per sandbox can be left out with the sandbox's view unchanged, it is
(each one makes every memory cgroup of the host bigger: masks.py): the masked directories
are read-only binds of the node's empty mask dir (``bundle.MASK_ANNOTATION``) instead of a
tmpfs each, and a tmpfs directly below another with the same size limit (/dev/shm below
/dev) is a directory of it bound onto itself with its own flags (``_as_subdir``). runc mounts
a tmpfs for each (it refuses mounts into /proc but its own masks).

What runc adds on its own to a config is added here the same way: the default device nodes
(bound from the host's /dev, as runc does in a user namespace) and their device-cgroup rules,
the /dev symlinks, HOME when the env has none, oom_score_adj written by the privileged parent.
Not supported (refused): a pure cgroup v2 host (the device filter is a cgroup BPF program
there; runc attaches one, the launcher does not yet), a terminal, a user other than 0.

Must not touch: sandbox lifecycle (sandbox.py), the config itself (bundle.py).
"""
from __future__ import annotations

import fcntl
import functools
import os
import posixpath
import re
import resource
from pathlib import Path
from typing import Any

from rollbox.backends.container import bundle
from rollbox.backends.container.runtime import spawn_init_runner, wait_pid
from rollbox.errors import InfraError
from rollbox.isolation import cgroups, seccomp
from rollbox.isolation.syscalls import (
    MS_BIND, MS_DIRSYNC, MS_NOATIME, MS_NODEV, MS_NODIRATIME, MS_NOEXEC, MS_NOSUID, MS_PRIVATE,
    MS_RDONLY, MS_REC, MS_RELATIME, MS_SHARED, MS_SLAVE, MS_STRICTATIME, MS_SYNCHRONOUS,
)

# Above the fds the agent takes (3-5; 6 is its optional platform-tool fd).
SPEC_FD = 9


# OCI mount options that are mount flags (runc's table); every other option is fs data.
MOUNT_FLAGS = {
    "ro": MS_RDONLY, "rw": 0, "nosuid": MS_NOSUID, "suid": 0, "nodev": MS_NODEV, "dev": 0,
    "noexec": MS_NOEXEC, "exec": 0, "sync": MS_SYNCHRONOUS, "async": 0,
    "dirsync": MS_DIRSYNC, "noatime": MS_NOATIME, "atime": 0, "nodiratime": MS_NODIRATIME,
    "diratime": 0, "relatime": MS_RELATIME, "norelatime": 0, "strictatime": MS_STRICTATIME,
    "bind": MS_BIND, "rbind": MS_BIND | MS_REC,
}
PROPAGATION = {"private": MS_PRIVATE, "rprivate": MS_REC | MS_PRIVATE, "slave": MS_SLAVE,
               "rslave": MS_REC | MS_SLAVE, "shared": MS_SHARED, "rshared": MS_REC | MS_SHARED}

CAP_NUMBERS = {name: i for i, name in enumerate([
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK",
    "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE"])}

# runc's default devices (libcontainer/specconv AllowedDevices): the nodes it puts in /dev,
# bound from the host's, and the device-cgroup rules it adds after the config's own.
DEVICE_NODES = ["null", "zero", "full", "random", "urandom", "tty"]
DEVICE_RULES = ["c *:* m", "b *:* m", "c 1:3 rwm", "c 1:8 rwm", "c 1:7 rwm", "c 5:0 rwm",
                "c 1:5 rwm", "c 1:9 rwm", "c 5:2 rwm", "c 136:* rwm", "c 10:200 rwm"]
DEV_SYMLINKS = [("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
                ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr"),
                ("pts/ptmx", "/dev/ptmx")]

PURE_V2 = ("the native runtime needs a hybrid cgroup host (v1 controllers): on pure cgroup v2 "
           "the device filter is a BPF program it does not attach yet; set ROLLBOX_RUNTIME=runc")

_ERROR = re.compile(r"rollbox-launcher: (?P<step>[^:\n]+): (?P<msg>.*) \(errno (?P<errno>\d+)\)$",
                    re.M)


class _Records:
    def __init__(self) -> None:
        self.out = bytearray()

    def add(self, op: str, *fields: str | int) -> None:
        # os.fsencode's encoding (utf-8, surrogateescape), one join per record
        b = "\0".join([op, *map(str, fields)]).encode("utf-8", "surrogateescape")
        if b.count(b"\0") != len(fields):
            raise InfraError(f"launcher spec: NUL in a {op} field")
        self.out += b + b"\0"


@functools.lru_cache(maxsize=64)
def _block(op: str, items: tuple[tuple[str, ...], ...]) -> bytes:
    """The records ``op`` of each of ``items`` (a tuple of fields each), made once: the
    lists every sandbox of a node shares (device nodes and rules, masked and read-only
    paths) cost no encoding per create."""
    rec = _Records()
    for fields in items:
        rec.add(op, *fields)
    return bytes(rec.out)


def _mount_flags(options: list[str]) -> tuple[int, str]:
    flags, data = 0, []
    for opt in options:
        if opt in MOUNT_FLAGS:
            flags |= MOUNT_FLAGS[opt]
        elif opt in PROPAGATION:
            raise InfraError(f"launcher: mount propagation option {opt!r} not supported")
        else:
            data.append(opt)
    return flags, ",".join(data)


def _caps(names: list[str]) -> int:
    mask = 0
    for name in names:
        if name not in CAP_NUMBERS:
            raise InfraError(f"launcher: unknown capability {name!r}")
        mask |= 1 << CAP_NUMBERS[name]
    return mask


_MEMSW: dict[str, bool] = {}


def _has_memsw(parent: str) -> bool:
    """Whether the memory hierarchy's ``parent`` dir (the sandboxes' cgroup parent) has swap
    accounting (``memory.memsw.*``: a boot-time kernel option). A yes is kept; a no is asked
    again (the parent is made by the first launcher that needs it)."""
    if not _MEMSW.get(parent):
        _MEMSW[parent] = os.path.exists(f"{parent}/memory.memsw.limit_in_bytes")
    return _MEMSW[parent]


def _cgroup_records(rec: _Records, cgroups_path: str, res: dict[str, Any]) -> None:
    """The sandbox's cgroup in every hierarchy and the limits runc writes on a hybrid
    (v1 controllers + v2 membership) host."""
    if cgroups.is_pure_v2():
        raise InfraError(PURE_V2)
    rel = cgroups_path.strip("/")
    # strings, not Paths: this runs on the loop at every create (as the rest of spec_bytes)
    dirs = {h.name: f"{h}/{rel}" for h in cgroups.hierarchies()}
    for d in dirs.values():
        rec.add("cgroup", d)

    def put(controller: str, file: str, value: object) -> None:
        d = dirs.get(controller)
        if d is None:
            raise InfraError(f"launcher: no {controller} cgroup hierarchy for {file}")
        rec.add("cgset", f"{d}/{file}", str(value))

    known = {"memory", "cpu", "pids", "devices", "unified"}
    unknown = set(res) - known
    if unknown:
        raise InfraError(f"launcher: cgroup resources {sorted(unknown)} not supported")
    mem = res.get("memory") or {}
    if set(mem) - {"limit", "swap"}:
        raise InfraError(f"launcher: memory resources {sorted(mem)} not supported")
    if "limit" in mem:
        put("memory", "memory.limit_in_bytes", mem["limit"])
    if "swap" in mem and _has_memsw(os.path.dirname(dirs["memory"])):
        put("memory", "memory.memsw.limit_in_bytes", mem["swap"])
    cpu = res.get("cpu") or {}
    if set(cpu) - {"quota", "period", "cpus", "mems", "shares", "idle"}:
        raise InfraError(f"launcher: cpu resources {sorted(cpu)} not supported")
    cpu_h = "cpu" if "cpu" in dirs else "cpu,cpuacct"
    if "shares" in cpu:
        put(cpu_h, "cpu.shares", cpu["shares"])
    if "period" in cpu:
        put(cpu_h, "cpu.cfs_period_us", cpu["period"])
    if "quota" in cpu:
        put(cpu_h, "cpu.cfs_quota_us", cpu["quota"])
    if "idle" in cpu:
        put(cpu_h, "cpu.idle", cpu["idle"])
    if "cpus" in cpu:
        put("cpuset", "cpuset.cpus", cpu["cpus"])
    if "mems" in cpu:
        put("cpuset", "cpuset.mems", cpu["mems"])
    pids = res.get("pids") or {}
    if "limit" in pids:
        put("pids", "pids.max", pids["limit"] if pids["limit"] > 0 else "max")
    rules = res.get("devices")
    if rules is not None:
        for rule in rules:
            line = (f"{rule.get('type', 'a')} {rule.get('major', '*')}:"
                    f"{rule.get('minor', '*')} {rule.get('access', 'rwm')}")
            if rule.get("type", "a") == "a":
                line = "a"
            put("devices", "devices.allow" if rule["allow"] else "devices.deny", line)
        if "devices" not in dirs:
            raise InfraError("launcher: no devices cgroup hierarchy for devices.allow")
        allow = f"{dirs['devices']}/devices.allow"
        rec.out += _block("cgset", tuple((allow, line) for line in DEVICE_RULES))
    for file, value in (res.get("unified") or {}).items():
        put("unified", file, value)


def _tmpfs_opts(m: dict[str, Any]) -> tuple[int, dict[str, str]] | None:
    """A tmpfs mount's flags and its fs options (None: not a tmpfs, or an option without a
    value)."""
    if m.get("type") != "tmpfs":
        return None
    flags, data = _mount_flags(m.get("options", []))
    opts = [o.partition("=") for o in data.split(",") if o]
    if any(not sep for _, sep, _ in opts):
        return None
    return flags, {k: v for k, _, v in opts}


def _as_subdir(m: dict[str, Any], earlier: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(flags, mode) when the tmpfs mount ``m`` can be a directory of the tmpfs mounted
    last at its parent (the /dev tmpfs for /dev/shm), bound onto itself with ``m``'s flags,
    instead of a superblock of its own (every superblock makes every memory cgroup of the
    host bigger: masks.py). Only with the same size limit and no option but size and mode,
    so what the sandbox can put there is what a tmpfs of its own would take: the same limit,
    charged to the same memory cgroup (that of the writer, as any tmpfs page). The one
    difference: /dev and the directory share the one limit (/dev holds nothing of its own
    but empty device mount points and symlinks)."""
    mine = _tmpfs_opts(m)
    parent_dest = posixpath.dirname(m["destination"].rstrip("/"))
    parent = next((p for p in reversed(earlier) if p["destination"] == parent_dest), None)
    theirs = _tmpfs_opts(parent) if parent is not None else None
    if mine is None or theirs is None or set(mine[1]) - {"size", "mode"} \
            or "size" not in mine[1] or mine[1]["size"] != theirs[1].get("size"):
        return None
    if any(p["destination"].startswith(m["destination"].rstrip("/") + "/") for p in earlier):
        return None  # something already mounted below it
    return mine[0], int(mine[1].get("mode", "1777"), 8)


def spec_bytes(config: dict[str, Any], pid_file: Path) -> bytes:
    """The launcher's input for an OCI config (see the module docstring)."""
    rec = _Records()
    proc = config["process"]
    linux = config["linux"]
    if proc.get("terminal") or proc.get("user", {}).get("uid", 0) != 0 or \
            proc.get("user", {}).get("gid", 0) != 0 or proc.get("user", {}).get("additionalGids"):
        raise InfraError("launcher: only a root init without a terminal is supported")
    rec.add("root", config["root"]["path"])
    if config["root"].get("readonly"):
        raise InfraError("launcher: a read-only root is not supported")
    rec.add("pidfile", str(pid_file))
    if "hostname" in config:
        rec.add("hostname", config["hostname"])
    for ns in linux["namespaces"]:
        if ns["type"] == "network":
            if not ns.get("path"):
                raise InfraError("launcher: a network namespace needs a path")
            rec.add("netns", ns["path"])
        elif ns["type"] not in ("pid", "ipc", "uts", "mount", "user", "cgroup"):
            raise InfraError(f"launcher: namespace {ns['type']!r} not supported")
        elif ns.get("path"):
            raise InfraError(f"launcher: joining a {ns['type']} namespace is not supported")
    for key, name in (("uidMappings", "uid_map"), ("gidMappings", "gid_map")):
        rec.add(name, "".join(f"{m['containerID']} {m['hostID']} {m['size']}\n"
                              for m in linux[key]))
    rec.add("propagation", PROPAGATION[linux.get("rootfsPropagation", "rslave")])
    if "oomScoreAdj" in proc:
        rec.add("oom_score_adj", proc["oomScoreAdj"])
    _cgroup_records(rec, linux["cgroupsPath"], linux.get("resources") or {})
    annotations = dict(config.get("annotations") or {})
    mask_dir = annotations.pop(bundle.MASK_ANNOTATION, None)
    if annotations:
        raise InfraError(f"launcher: annotations {sorted(annotations)} not supported")
    if mask_dir is not None:
        rec.add("mask_dir", mask_dir)
    for i, m in enumerate(config["mounts"]):
        subdir = _as_subdir(m, config["mounts"][:i])
        if subdir is not None:
            rec.add("subdir", m["destination"], *subdir)
            continue
        flags, data = _mount_flags(m.get("options", []))
        if m.get("type") == "bind" and not flags & MS_BIND:
            flags |= MS_BIND
        rec.add("mount", m["destination"], m.get("type") or "", m.get("source") or "", flags,
                data)
    boot_id = bundle.boot_id_source(config)  # runc's hook: the launcher binds it itself
    if boot_id is not None:
        flags, data = _mount_flags(bundle.BOOT_ID_OPTIONS)
        rec.add("mount", bundle.BOOT_ID_PATH, "bind", boot_id, flags | MS_BIND, data)
    rec.out += _block("device", tuple((f"/dev/{name}",) * 2 for name in DEVICE_NODES))
    rec.out += _block("symlink", tuple(DEV_SYMLINKS))
    rec.out += _block("readonly", tuple((path,) for path in linux.get("readonlyPaths", [])))
    rec.out += _block("masked", tuple((path,) for path in linux.get("maskedPaths", [])))
    for rl in proc.get("rlimits", []):
        rec.add("rlimit", getattr(resource, rl["type"]), rl["soft"], rl["hard"])
    if proc.get("noNewPrivileges"):
        rec.add("no_new_privs")
    caps = proc.get("capabilities") or {}
    rec.add("caps", *(_caps(caps.get(k, [])) for k in
                      ("bounding", "effective", "permitted", "inheritable", "ambient")))
    rec.add("cwd", proc.get("cwd", "/"))
    for arg in proc["args"]:
        rec.add("arg", arg)
    env = list(proc.get("env", []))
    if not any(e.startswith("HOME=") for e in env):
        env.append("HOME=/root")  # runc's default for uid 0 without one
    for e in env:
        rec.add("env", e)
    if "seccomp" in linux:
        program = seccomp.compile_bpf(linux["seccomp"])
        rec.add("seccomp", len(program))
        rec.out += program
    return bytes(rec.out)


def launcher_error(code: int, log_text: str) -> InfraError:
    """The typed error of a failed launch: the step and errno the launcher named."""
    found = list(_ERROR.finditer(log_text))
    if not found:
        return InfraError(f"native launcher failed ({code}): {log_text.strip()[-500:]}",
                          step="unknown")
    first = found[0]
    left = [line.split("cleanup: ", 1)[1] for line in log_text.splitlines()
            if line.startswith("rollbox-launcher: cleanup: ")]
    return InfraError(f"native launcher failed at {first.group('step')}: {first.group('msg')}",
                      step=first.group("step"), errno=int(first.group("errno")),
                      **({"left": left} if left else {}))


class NativeRuntime:
    """Starts sandboxes with ``build/rollbox-launcher``; keeps no state of its own (the pid
    file and the cgroups are the sandbox's, as with runc)."""

    name = "native"
    root: Path | None = None

    def __init__(self, binary: Path) -> None:
        if not binary.is_file():
            raise InfraError(f"native launcher missing at {binary} (run `make native`)")
        if cgroups.is_pure_v2():
            raise InfraError(PURE_V2)
        self.binary = str(binary)

    async def run_detached(self, container_id: str, bundle: Path, config: dict[str, Any],
                           listen_fd: int, agent_fd: int, shell_fd: int, pid_file: Path,
                           log_file: Path) -> int:
        spec = spec_bytes(config, pid_file)
        memfd = os.memfd_create("rollbox-launch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(memfd, spec)
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
            pid = spawn_init_runner(self.binary, [self.binary], {}, log_file,
                                    [listen_fd, agent_fd, shell_fd], ((memfd, SPEC_FD),))
        finally:
            os.close(memfd)
        code = await wait_pid(pid)
        if code != 0:
            text = log_file.read_text(errors="replace")[-4000:] if log_file.exists() else ""
            raise launcher_error(code, text)
        return int(pid_file.read_text())

    def state_dir(self, container_id: str) -> Path | None:
        return None

    def forget(self, container_id: str) -> None:
        """Nothing: the launcher keeps no state."""

    def known(self) -> list[str]:
        return []
