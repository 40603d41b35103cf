"""CPU service classes of sandboxes (``SandboxSpec.qos``) on the node: the one place that
decides which cgroup files of a sandbox get which values and which scheduling policy its tasks
run at, for every path that starts one (runc's, the native launcher's, QEMU's jail).

- ``batch`` (best-effort; a project's default) runs in the **idle class**: its cpu cgroup gets a
  low weight (``cpu.shares`` 2 on v1, ``cpu.weight`` 1 on v2: what is left where the kernel has
  no ``cpu.idle``), then ``cpu.idle=1`` (5.15+, v1 cpu controller or v2's: the group only runs on
  CPU time no normal group wants, and a waking normal task preempts it; the kernel then holds
  it at its minimum weight, 3, and refuses another one), and every task of it runs SCHED_IDLE,
  inherited by whatever it starts. Two layers: the cgroup's idle flag and each task's policy;
  where neither ``cpu.idle`` exists SCHED_IDLE is what is left.
- ``latency`` (graders, fncall workers) keeps the normal class (``cpu.shares`` 1024 /
  ``cpu.weight`` 100, SCHED_OTHER) and gets **core scheduling** where the kernel has it
  (``CONFIG_SCHED_CORE``) and the host has SMT: a cookie of its own on the sandbox's init
  (``PR_SCHED_CORE_CREATE`` for its thread group), inherited by its children, so no task of
  another sandbox runs on a sibling hyperthread at the same time. :func:`core_sched_status`
  says whether this host has it (and why not: ``EINVAL`` without ``CONFIG_SCHED_CORE``,
  ``ENODEV`` without SMT).

A sandbox can not leave its class: the cgroup files are the host root's and the sandbox never
sees the cgroup filesystem (cgroup namespace, no mount); with :data:`RLIMITS` (``RLIMIT_NICE``
and ``RLIMIT_RTPRIO`` 0, hard) and no ``CAP_SYS_NICE`` in the host's user namespace the kernel
refuses it SCHED_OTHER, FIFO or RR once at SCHED_IDLE, and any nice value below 0.

Owns the decision (:func:`cpu_class`, :func:`cgroup_writes`) and applying it (:func:`apply_cgroup`,
:func:`apply_tasks`, :func:`core_sched_create`). Must not know backends, the API or placement.
"""
from __future__ import annotations

import contextvars
import ctypes
import errno
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import cgroups, syscalls
from rollbox.models import Qos

log = logging.getLogger(__name__)

QOS_CLASSES: tuple[str, ...] = get_args(Qos)


@dataclass(frozen=True)
class CpuClass:
    """What a qos class means for the CPU scheduler."""

    name: str
    idle: bool    # cgroup cpu.idle=1 and SCHED_IDLE for every task
    shares: int   # v1 cpu.shares (kernel range 2..262144; 1024 is a normal task's)
    weight: int   # v2 cpu.weight (1..10000; 100 is normal)


CLASSES: dict[str, CpuClass] = {
    "latency": CpuClass("latency", idle=False, shares=1024, weight=100),
    "batch": CpuClass("batch", idle=True, shares=2, weight=1),
}

# Set-up work done at best effort (a warm pool's refill, rollbox.edge.pool): while True in a
# task's context, the processes the container runtimes spawn for it (runc, the native
# launcher) start at SCHED_IDLE, so they run only on CPU time nothing else wants. The sandbox's
# init gets its own class right after (apply_sandbox), whatever it inherited.
BEST_EFFORT_SETUP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rollbox_best_effort_setup", default=False)


def setup_spawned(pid: int) -> None:
    """A runtime process just spawned (runc, the native launcher): to SCHED_IDLE under
    :data:`BEST_EFFORT_SETUP` (its main thread; what it starts from then on inherits it),
    else left at the caller's policy. One that is gone already is skipped."""
    if not BEST_EFFORT_SETUP.get():
        return
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except ProcessLookupError:
        pass


# Hard limits every sandbox process starts with (OCI rlimits; the jailer sets the same): no
# nice value below 0 and no real-time priority, so SCHED_IDLE can not be left.
RLIMITS: tuple[tuple[str, int], ...] = (("RLIMIT_NICE", 0), ("RLIMIT_RTPRIO", 0))


def cpu_class(qos: str) -> CpuClass:
    """The class of ``qos``; BadRequest for a name that is none."""
    try:
        return CLASSES[qos]
    except KeyError:
        raise BadRequest(f"unknown qos class {qos!r}: one of {', '.join(QOS_CLASSES)}",
                         qos=str(qos)[:64]) from None


def node_class(qos: str, enforce: bool) -> CpuClass:
    """The class a sandbox of ``qos`` gets on a node: its own, or the normal (latency) one
    where the node does not enforce the classes (``Settings.cpu_qos`` off). BadRequest for
    a name that is none, either way."""
    cls = cpu_class(qos)
    return cls if enforce else CLASSES["latency"]


def cgroup_writes(cls: CpuClass, *, v2: bool, idle_now: bool = False,
                  has_idle: bool = True) -> list[tuple[str, str]]:
    """The files of a sandbox's cpu cgroup and their values, in the order they must be written
    (a new cgroup: ``idle_now`` False). The kernel refuses a weight for an idle group (EINVAL),
    so an idle class writes its weight before ``cpu.idle=1`` (not at all when the group is idle
    already), and a normal class clears ``cpu.idle`` first (which resets the weight) and then
    writes its weight. ``has_idle``: whether the cgroup has a ``cpu.idle`` file (5.15+)."""
    weight = ("cpu.weight", str(cls.weight)) if v2 else ("cpu.shares", str(cls.shares))
    if not has_idle:
        return [weight]
    if cls.idle:
        return [("cpu.idle", "1")] if idle_now else [weight, ("cpu.idle", "1")]
    return [("cpu.idle", "0"), weight]


def cpu_dir(parent: str, name: str) -> tuple[Path, bool]:
    """The cgroup dir of ``<parent>/<name>`` that holds its CPU weight and idle flag, and whether
    it is a v2 one: the v1 cpu controller's (``cpu`` or co-mounted ``cpu,cpuacct``) on hybrid
    hosts, the v2 dir where the cpu controller is v2's."""
    if not cgroups.is_pure_v2():
        for h in cgroups.hierarchies():
            if h.name == "cpu" or h.name.startswith("cpu,"):
                return h / parent / name, False
    return cgroups.v2_dir(parent, name), True


def apply_cgroup(path: Path, cls: CpuClass, *, v2: bool) -> bool:
    """Write ``cls`` to the cpu cgroup ``path`` (:func:`cgroup_writes`); returns whether the
    cgroup's idle flag is as the class wants (False: this kernel has no ``cpu.idle``, then
    SCHED_IDLE per task is the class's only layer). OSError as the kernel gives it."""
    idle_file = path / "cpu.idle"
    has_idle = idle_file.exists()
    idle_now = has_idle and idle_file.read_text().strip() == "1"
    for name, value in cgroup_writes(cls, v2=v2, idle_now=idle_now, has_idle=has_idle):
        try:
            (path / name).write_text(value)
        except FileNotFoundError:
            if name != "cpu.weight":  # v2 without the cpu controller enabled: no weight file
                raise
            log.debug("no cpu.weight in %s", path)
    return has_idle


def apply_tasks(pids: Iterable[int], cls: CpuClass) -> int:
    """Every thread of every process in ``pids`` to the class's policy (SCHED_IDLE for an idle
    class, else SCHED_OTHER at priority 0); threads and children started later inherit it.
    Returns how many threads were changed. Processes gone meanwhile are skipped."""
    want = os.SCHED_IDLE if cls.idle else os.SCHED_OTHER
    total = 0
    for pid in pids:
        for _ in range(3):  # a thread started meanwhile by one not yet changed: once more
            changed = 0
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                break
            for tid in tids:
                try:
                    if os.sched_getscheduler(int(tid)) != want:
                        os.sched_setscheduler(int(tid), want, os.sched_param(0))
                        changed += 1
                except (ProcessLookupError, PermissionError):
                    continue  # gone meanwhile
            total += changed
            if not changed:
                break
    return total


# ---- core scheduling ----------------------------------------------------------------------
PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PR_SCHED_CORE_CREATE = 1
PIDTYPE_PID = 0
PIDTYPE_TGID = 1
SMT_ACTIVE = Path("/sys/devices/system/cpu/smt/active")


@dataclass(frozen=True)
class CoreSched:
    """Whether this host can give a latency sandbox cores of its own (and why not)."""

    available: bool
    reason: str = ""


def core_sched_status(prctl: Callable[..., int] = syscalls.prctl) -> CoreSched:
    """Asks the kernel for this process's core-scheduling cookie: EINVAL means the kernel has no
    core scheduling (``CONFIG_SCHED_CORE`` off, or older than 5.14), ENODEV that the host has no
    SMT (no sibling hyperthread to keep another sandbox off)."""
    cookie = ctypes.c_uint64()
    try:
        prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.addressof(cookie))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return CoreSched(False, "the kernel has no core scheduling (CONFIG_SCHED_CORE)")
        if exc.errno == errno.ENODEV:
            return CoreSched(False, "the host has no SMT (no sibling hyperthreads)")
        return CoreSched(False, f"PR_SCHED_CORE_GET failed: {os.strerror(exc.errno or 0)}")
    return CoreSched(True)


_CORE_SCHED: CoreSched | None = None


def core_sched() -> CoreSched:
    """:func:`core_sched_status` of this host, asked once (fixed for its uptime; said in the
    log when first asked)."""
    global _CORE_SCHED
    if _CORE_SCHED is None:
        _CORE_SCHED = core_sched_status()
        if _CORE_SCHED.available:
            log.info("core scheduling: each latency sandbox gets a core cookie of its own")
        else:
            log.info("core scheduling unavailable for latency sandboxes: %s",
                     _CORE_SCHED.reason)
    return _CORE_SCHED


_CPU_IDLE: bool | None = None


def has_cpu_idle() -> bool:
    """Whether the cpu controller has ``cpu.idle`` (asked once: a kernel fact; a create's
    capacity check reads it, and the walk of the cgroup mounts cost ~0.1 ms each time)."""
    global _CPU_IDLE
    if _CPU_IDLE is None:
        root, _ = cpu_dir("", "")
        _CPU_IDLE = (root / "cpu.idle").exists()
    return _CPU_IDLE


def node_facts(enforce: bool) -> dict[str, object]:
    """What this node's CPU classes are (a backend's capacity facts): ``cpu_qos`` (whether it
    enforces them, ``Settings.cpu_qos``), ``cpu_idle`` (the cpu controller has ``cpu.idle``;
    else batch is SCHED_IDLE per task only), ``core_sched`` and, when it is unavailable,
    ``core_sched_reason``."""
    cs = core_sched()
    facts: dict[str, object] = {"cpu_qos": enforce, "cpu_idle": has_cpu_idle(),
                                "core_sched": cs.available}
    if not cs.available:
        facts["core_sched_reason"] = cs.reason
    return facts


def core_sched_create(pid: int, prctl: Callable[..., int] = syscalls.prctl) -> None:
    """A new core-scheduling cookie for the thread group of ``pid`` (a sandbox's init; its
    children inherit it). OSError as the kernel gives it (EINVAL/ENODEV: see
    :func:`core_sched_status`)."""
    prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PIDTYPE_TGID, 0)


def apply_start(pid: int, cls: CpuClass, status: CoreSched | None = None) -> bool:
    """The per-task part of ``cls`` for a sandbox's init ``pid`` (what it starts inherits it):
    its policy, and for a normal (latency) class a core-scheduling cookie where the host has it
    (``status``: :func:`core_sched`'s). Returns whether a cookie was made."""
    apply_tasks([pid], cls)
    if cls.idle:
        return False
    status = status or core_sched()
    if not status.available:
        return False
    core_sched_create(pid)
    return True


def apply_sandbox(parent: str, name: str, pid: int, cls: CpuClass) -> None:
    """All of ``cls`` for the sandbox whose cgroups are ``<parent>/<name>`` and whose init is
    ``pid`` (runc's and the launcher's path: after the cgroups exist, before any of the
    sandbox's own code runs): the cpu cgroup's files, then the init's policy and cookie.
    InfraError when the kernel refuses any of it."""
    path, v2 = cpu_dir(parent, name)
    try:
        if not apply_cgroup(path, cls, v2=v2) and cls.idle:
            log.debug("no cpu.idle in %s: SCHED_IDLE only", path)
        apply_start(pid, cls)
    except OSError as exc:
        raise InfraError(f"CPU class {cls.name} of {name} not set: {exc}") from exc
