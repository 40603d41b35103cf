"""Cgroup layout of sandboxes on cgroup v1 (hybrid) and v2 hosts.

runc creates ``<parent>/<sandbox>`` in every hierarchy (limits: cpu, memory, pids). The v2
hierarchy (``/sys/fs/cgroup/unified`` on hybrid hosts, ``/sys/fs/cgroup`` on v2 hosts) also
tracks membership: every exec session gets ``<parent>/<sandbox>/x<n>`` there, so a timeout kills
everything the command started through ``cgroup.kill``, whatever it forked, setsid'd or
double-forked. The sandbox cgroup is delegated to the sandbox's root uid (only ``cgroup.procs``
and the session dirs), which is what lets its agent move a child into a session cgroup through a
directory fd the edge hands it; the sandbox never sees the cgroup filesystem itself.
Freezing the sandbox's v2 directory (``cgroup.freeze``) stops the agent and every command at
once: pause/resume and consistent snapshots.

Placing a process (a ``cgroup.procs`` write) takes the kernel's threadgroup lock for writing;
by default that lock waits for an RCU grace period whenever migrations are not continuous
(measured here: 9.4 ms p50 for one placement at load ~20, 0.27 ms with the option below), and
the native launcher places every sandbox's init in ~10 hierarchies. :func:`favor_dynmods` turns
on the kernel's ``favordynmods`` cgroup2 mount option (per-threadgroup locking for placements,
forks and exits a little dearer); a host-wide kernel mode, one-way until reboot on 6.18.
"""
from __future__ import annotations

import asyncio

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

from rollbox.errors import InfraError

ROOT = Path("/sys/fs/cgroup")


_V2_ROOT: Path | None = None


def v2_root() -> Path:
    """The cgroup2 mount used for membership and cgroup.kill."""
    global _V2_ROOT
    if _V2_ROOT is None:
        _V2_ROOT = _find_v2_root()
    return _V2_ROOT


def _find_v2_root() -> Path:
    unified = ROOT / "unified"
    if (unified / "cgroup.procs").exists():
        return unified
    if (ROOT / "cgroup.controllers").exists():
        return ROOT
    raise RuntimeError("no cgroup v2 hierarchy: rollbox needs cgroup2 (kernel >= 5.14)")


_PURE_V2: bool | None = None


def is_pure_v2() -> bool:
    """Whether the host has cgroup v2 alone (no v1 controllers); fixed for its uptime (read
    once: every create asks several times)."""
    global _PURE_V2
    if _PURE_V2 is None:
        _PURE_V2 = (ROOT / "cgroup.controllers").exists()
    return _PURE_V2


_HIERARCHIES: list[Path] | None = None


def hierarchies() -> list[Path]:
    """Every mounted hierarchy root (v1 controllers + v2); fixed for the host's uptime."""
    global _HIERARCHIES
    if _HIERARCHIES is None:
        if is_pure_v2():
            _HIERARCHIES = [ROOT]
        else:
            _HIERARCHIES = [e for e in sorted(ROOT.iterdir())
                            if e.is_dir() and (e / "cgroup.procs").exists()]
    return list(_HIERARCHIES)


FAVOR_DYNMODS = "favordynmods"


def v2_super_options(mountinfo: str, v2: Path) -> list[str] | None:
    """The superblock options of the cgroup2 mount at ``v2`` in a mountinfo text (None: not
    mounted there)."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if len(lf) >= 5 and len(rf) >= 3 and rf[0] == "cgroup2" and lf[4] == str(v2):
            return rf[2].split(",")
    return None


def favor_dynmods() -> str:
    """Turn on ``favordynmods`` on the v2 hierarchy's mount (see the module docstring), the
    mount's other options kept (``mount -o remount`` merges them). Returns "on" (it was),
    "set" or why it is not (kernel without the option, no mount binary): a slower placement,
    never a failure."""
    import subprocess

    v2 = v2_root()
    with open("/proc/self/mountinfo") as f:
        opts = v2_super_options(f.read(), v2)
    if opts is None:
        return f"no cgroup2 mount at {v2}"
    if FAVOR_DYNMODS in opts:
        return "on"
    try:
        out = subprocess.run(["mount", "-o", f"remount,{FAVOR_DYNMODS}", str(v2)],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not set: {exc}"
    if out.returncode != 0:
        return f"not set: {out.stderr.strip()[-200:]}"
    with open("/proc/self/mountinfo") as f:
        opts = v2_super_options(f.read(), v2) or []
    return "set" if FAVOR_DYNMODS in opts else "not set: the kernel kept it off"


def sandbox_dirs(parent: str, sandbox_id: str) -> list[Path]:
    return [h / parent / sandbox_id for h in hierarchies()]


def v2_dir(parent: str, sandbox_id: str) -> Path:
    return v2_root() / parent / sandbox_id


def delegate(path: Path, uid: int) -> None:
    """Let uid (the sandbox root) move processes within this subtree, nothing more."""
    os.chown(path, uid, uid)
    os.chown(path / "cgroup.procs", uid, uid)


def make_session(parent_dir: Path, name: str, uid: int) -> int:
    """Create a session cgroup, writable by uid; return an O_PATH fd of its directory."""
    path = parent_dir / name
    path.mkdir()
    for f in ("cgroup.procs", "cgroup.kill"):
        os.chown(path / f, uid, uid)
    os.chown(path, uid, uid)
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def procs(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def kill(path: Path) -> None:
    """Kill every process in the v2 cgroup subtree (cgroup.kill, 5.14+)."""
    try:
        (path / "cgroup.kill").write_text("1")
    except FileNotFoundError:
        pass


def populated(path: Path) -> bool:
    """Whether any live process is in the v2 cgroup subtree (False once it is gone)."""
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except FileNotFoundError:
        return False


async def wait_empty(path: Path, timeout: float = 5.0) -> bool:
    """Wait until the subtree has no live process; False on timeout. Polls with a growing
    pause (killed processes are gone within a few ms), never blocking the event loop."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while populated(path):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def remove_tree(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (cgroups can't be rm -r'd). Most sandbox
    cgroups have no children, so rmdir comes first and the directory (dozens of control files
    in a v1 hierarchy) is only listed when that rmdir says busy."""
    listed = False
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        if not listed:
            listed = True
            try:
                with os.scandir(path) as it:
                    children = [e.path for e in it if e.is_dir(follow_symlinks=False)]
            except FileNotFoundError:
                return
            for child in children:
                remove_tree(Path(child))
            if children:
                continue  # busy with children: retry at once
        time.sleep(0.01)  # busy with exiting processes
    os.rmdir(path)


def remove_parent_if_empty(parent: str) -> None:
    """rmdir the rollbox parent cgroup in every hierarchy where it has no sandbox left."""
    for h in hierarchies():
        try:
            (h / parent).rmdir()
        except OSError:
            pass  # absent, or still holds a sandbox


def leftover(parent: str) -> list[Path]:
    """Sandbox cgroups that still exist under the rollbox parent in any hierarchy."""
    found: list[Path] = []
    for h in hierarchies():
        p = h / parent
        if p.exists():
            found.extend(c for c in p.iterdir() if c.is_dir())
    return found


# ---- freezing (pause/resume, consistent snapshots) -----------------------------------------
# Longest a sandbox may take to stop its processes (FREEZING -> FROZEN) before freezing fails.
FREEZE_TIMEOUT_S = 10.0


def _use_v2_freezer(v2_cgroup: Path, v1_freezer: Path | None) -> bool:
    if (v2_cgroup / "cgroup.freeze").exists():
        return True
    if v1_freezer is not None and (v1_freezer / "freezer.state").exists():
        return False
    raise InfraError(f"no freezer for {v2_cgroup.name}: neither cgroup.freeze nor a v1 "
                     "freezer cgroup")


def is_frozen(v2_cgroup: Path, v1_freezer: Path | None = None) -> bool:
    """Whether every process of the subtree is stopped (v2 ``frozen 1``, v1 ``FROZEN``)."""
    try:
        if (v2_cgroup / "cgroup.freeze").exists() or v1_freezer is None:
            return "frozen 1" in (v2_cgroup / "cgroup.events").read_text()
        return (v1_freezer / "freezer.state").read_text().strip() == "FROZEN"
    except FileNotFoundError:
        return False


def thaw(v2_cgroup: Path, v1_freezer: Path | None = None) -> None:
    """Let a frozen subtree run again; a cgroup that is gone is not an error."""
    try:
        if (v2_cgroup / "cgroup.freeze").exists():
            (v2_cgroup / "cgroup.freeze").write_text("0")
        elif v1_freezer is not None:
            (v1_freezer / "freezer.state").write_text("THAWED")
    except FileNotFoundError:
        pass


def freeze(v2_cgroup: Path, v1_freezer: Path | None = None,
           timeout: float = FREEZE_TIMEOUT_S) -> float:
    """Stop every process of a sandbox's subtree and wait until they all are; returns the
    seconds it took. On failure the subtree is thawed again and InfraError raised.

    The v2 ``cgroup.freeze`` is preferred: fatal signals still kill frozen tasks there, so
    ``cgroup.kill`` (teardown) works on a frozen sandbox. The v1 freezer is the fallback."""
    t0 = time.monotonic()
    use_v2 = _use_v2_freezer(v2_cgroup, v1_freezer)
    try:
        if use_v2:
            (v2_cgroup / "cgroup.freeze").write_text("1")
        else:
            (v1_freezer / "freezer.state").write_text("FROZEN")  # type: ignore[operator]
        while not is_frozen(v2_cgroup, None if use_v2 else v1_freezer):
            if not (v2_cgroup if use_v2 else v1_freezer).exists():  # type: ignore[union-attr]
                raise FileNotFoundError(v2_cgroup)
            if time.monotonic() - t0 > timeout:
                raise InfraError(f"sandbox {v2_cgroup.name} did not freeze in {timeout:.0f} s")
            time.sleep(0.002)
    except FileNotFoundError as exc:
        thaw(v2_cgroup, v1_freezer)
        raise InfraError(f"sandbox {v2_cgroup.name} has no cgroup: {exc}") from exc
    except BaseException:
        thaw(v2_cgroup, v1_freezer)
        raise
    return time.monotonic() - t0


@contextlib.contextmanager
def frozen(v2_cgroup: Path, v1_freezer: Path | None = None,
           timeout: float = FREEZE_TIMEOUT_S) -> Iterator[float]:
    """Freeze every process of a sandbox for the body; thaw after, also on failure.
    Yields the time taken to freeze."""
    took = freeze(v2_cgroup, v1_freezer, timeout)
    try:
        yield took
    finally:
        thaw(v2_cgroup, v1_freezer)


def set_children_frozen(v2_cgroup: Path, value: bool) -> None:
    """Set ``cgroup.freeze`` of every direct child (the exec sessions). With the children's own
    flag set, the parent can be thawed while they stay frozen: the agent runs, commands don't."""
    try:
        with os.scandir(v2_cgroup) as it:
            children = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for child in children:
        try:
            (child / "cgroup.freeze").write_text("1" if value else "0")
        except FileNotFoundError:
            pass


# ---- memory: the parent limit of all sandboxes, usage, OOM kills ------------------------------
def _memory_v1(parent: str) -> Path | None:
    """The v1 memory cgroup of ``parent`` on hybrid hosts, None on v2 hosts."""
    return ROOT / "memory" / parent if (ROOT / "memory" / "cgroup.procs").exists() else None


def set_memory_limit(parent: str, limit_bytes: int) -> Path:
    """Create the parent cgroup of all sandboxes in the memory hierarchy with this limit, so
    an overload OOM-kills inside a sandbox and never a platform process; returns its dir.
    v1: ``memory.limit_in_bytes`` (+ ``memsw`` where swap accounting is on); v2:
    ``memory.max`` (the memory controller enabled for its children)."""
    v1 = _memory_v1(parent)
    try:
        if v1 is not None:
            v1.mkdir(parents=True, exist_ok=True)
            memsw = v1 / "memory.memsw.limit_in_bytes"
            # memsw must stay >= the limit: raise it first, lower it last.
            if memsw.exists() and int(memsw.read_text()) < limit_bytes:
                memsw.write_text(str(limit_bytes))
            (v1 / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
            return v1
        v2 = v2_root() / parent
        v2.mkdir(parents=True, exist_ok=True)
        (v2_root() / "cgroup.subtree_control").write_text("+memory")
        (v2 / "memory.max").write_text(str(limit_bytes))
        (v2 / "cgroup.subtree_control").write_text("+memory")
        return v2
    except OSError as exc:
        raise InfraError(f"can not limit the sandboxes' memory cgroup {parent}: {exc}") from exc


def memory_limit(parent: str) -> int | None:
    """The parent's memory limit in bytes (None: no memory cgroup or unlimited)."""
    v1 = _memory_v1(parent)
    try:
        raw = ((v1 / "memory.limit_in_bytes") if v1 is not None
               else v2_root() / parent / "memory.max").read_text().strip()
    except FileNotFoundError:
        return None
    return None if raw == "max" or int(raw) >= 1 << 62 else int(raw)


def memory_usage(parent: str) -> int | None:
    """Bytes charged to the sandboxes' parent cgroup (None if it does not exist yet)."""
    v1 = _memory_v1(parent)
    path = ((v1 / "memory.usage_in_bytes") if v1 is not None
            else v2_root() / parent / "memory.current")
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def oom_kills(parent: str, sandbox_id: str) -> int:
    """How many processes of the sandbox the kernel's OOM killer has killed (its own limit or
    the parent's): v1 ``memory.oom_control`` ``oom_kill``, v2 ``memory.events``. 0 once the
    cgroup is gone: read it before teardown."""
    v1 = _memory_v1(parent)
    path = (v1 / sandbox_id / "memory.oom_control") if v1 is not None \
        else v2_root() / parent / sandbox_id / "memory.events"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def memory_bytes(parent: str, sandbox_id: str) -> int | None:
    """Memory charged to the sandbox's cgroup (v1 usage_in_bytes, v2 memory.current); None
    once it is gone."""
    for path in (ROOT / "memory" / parent / sandbox_id / "memory.usage_in_bytes",
                 v2_dir(parent, sandbox_id) / "memory.current"):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def cpu_throttled_us(parent: str, sandbox_id: str) -> int | None:
    """How long the sandbox's cgroup was held back by its CPU quota, in microseconds (v1
    ``cpu.stat`` throttled_time, v2 throttled_usec): the host's own evidence of throttling (a
    VM's guest does not see its QEMU throttled). None if unknown."""
    for path, key, ns in ((ROOT / "cpu" / parent / sandbox_id / "cpu.stat", "throttled_time", 1),
                          (ROOT / "cpu,cpuacct" / parent / sandbox_id / "cpu.stat",
                           "throttled_time", 1),
                          (v2_dir(parent, sandbox_id) / "cpu.stat", "throttled_usec", 0)):
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value) // 1000 if ns else int(value)
        except (OSError, ValueError):
            continue
    return None


def cpu_usage_us(parent: str, sandbox_id: str) -> int | None:
    """CPU time used by the sandbox's cgroup in microseconds (v1 cpuacct, v2 cpu.stat)."""
    for path in (ROOT / "cpuacct" / parent / sandbox_id / "cpuacct.usage",
                 ROOT / "cpu,cpuacct" / parent / sandbox_id / "cpuacct.usage"):
        try:
            return int(path.read_text()) // 1000
        except (OSError, ValueError):
            continue
    try:
        for line in (v2_dir(parent, sandbox_id) / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
