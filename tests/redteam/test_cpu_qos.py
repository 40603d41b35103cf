"""Red team: a batch sandbox (qos "batch", the idle CPU class: rollbox.isolation.qos) tries to
leave its class: back to SCHED_OTHER, to SCHED_FIFO/RR, nice -20, raising RLIMIT_NICE, writing
its own cgroup files, moving itself to another cgroup, a cgroup namespace of its own.

Each layer is checked on its own, from the host: the cpu cgroup's ``cpu.idle`` and weight (a
test that fails when cpu.idle is not set, whatever the tasks' policy), every host task of the
sandbox at SCHED_IDLE, the hard RLIMIT_NICE/RLIMIT_RTPRIO of 0, and every task still in the
sandbox's cpu cgroup. A latency sandbox is the control: what batch is refused, latency may do
where it is not a raise (SCHED_OTHER), so the attack script can tell the classes apart.

On a microVM the guest's root owns the guest: the attacks run there and may succeed in the
guest; what the host gives QEMU (its cgroup, its threads' policy, its rlimits) must not move."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollbox.backends.base import ResolvedSpec
from rollbox.errors import BadRequest
from rollbox.isolation import qos
from rollbox.models import ExecSpec, Resources
from tests.conftest import needs_python
from tests.redteam.conftest import BB, PY, Boxes, container_only, needs_root

pytestmark = [needs_root, needs_python]

ATTACK = r"""
import errno, json, os, resource
out = {}
def t(name, f):
    try:
        f()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
    except ValueError:  # setrlimit's EPERM
        out[name] = "EPERM"
t("other", lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)))
t("batch", lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)))
t("fifo", lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)))
t("rr", lambda: os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(99)))
t("nice", lambda: os.setpriority(os.PRIO_PROCESS, 0, -20))
t("nice_pgrp", lambda: os.setpriority(os.PRIO_PGRP, 0, -20))
t("rlimit_nice", lambda: resource.setrlimit(resource.RLIMIT_NICE, (40, 40)))
t("rlimit_rtprio", lambda: resource.setrlimit(resource.RLIMIT_RTPRIO, (99, 99)))
t("init_other", lambda: os.sched_setscheduler(1, os.SCHED_OTHER, os.sched_param(0)))
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWCGROUP = 0x02000000
out["unshare_cgroup"] = ("ok" if libc.unshare(CLONE_NEWCGROUP) == 0
                         else errno.errorcode.get(ctypes.get_errno(), "?"))
os.makedirs("/tmp/cg", exist_ok=True)
for name, fs, opts in (("mount_v2", b"cgroup2", None), ("mount_v1_cpu", b"cgroup", b"cpu")):
    if libc.mount(b"none", b"/tmp/cg", fs, 0, opts) == 0:
        out[name] = "ok"
        for f in ("cpu.idle", "cpu.weight", "cpu.shares"):
            try:
                with open("/tmp/cg/" + f, "w") as fh:
                    fh.write("0" if f == "cpu.idle" else "10000")
                out[name + ":" + f] = "ok"
            except OSError as e:
                out[name + ":" + f] = errno.errorcode.get(e.errno, str(e.errno))
        try:  # to the mount's root: the top of its cgroup namespace
            with open("/tmp/cg/cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))
            out[name + ":procs"] = "ok"
        except OSError as e:
            out[name + ":procs"] = errno.errorcode.get(e.errno, str(e.errno))
        libc.umount2(b"/tmp/cg", 2)
    else:
        out[name] = errno.errorcode.get(ctypes.get_errno(), "?")
for path in ("/sys/fs/cgroup/cpu/cpu.idle", "/sys/fs/cgroup/cpu.idle",
             "/sys/fs/cgroup/cgroup.procs", "/proc/self/cgroup"):
    try:
        with open(path, "w") as fh:
            fh.write("0")
        out["write:" + path] = "ok"
    except OSError as e:
        out["write:" + path] = errno.errorcode.get(e.errno, str(e.errno))
out["policy"] = os.sched_getscheduler(0)
out["cgroup"] = open("/proc/self/cgroup").read()
print(json.dumps(out))
"""


def cpu_cgroup(boxes: Boxes, sid: str) -> Path:
    """The host's cpu cgroup dir of the sandbox (a VM's: its QEMU's, maybe a spare's name)."""
    box = boxes.edge.live[sid].box
    name = sid if boxes.kind == "container" else box.jail.cgroup_name
    return qos.cpu_dir(boxes.edge.settings.cgroup_parent, name)[0]


def host_tasks(boxes: Boxes, sid: str) -> list[int]:
    """Every host thread of the sandbox: its processes in the cpu cgroup (tasks lists threads),
    a container's by its uid too (so one that left the cgroup is still found)."""
    tids = {int(t) for t in (cpu_cgroup(boxes, sid) / "tasks").read_text().split()} \
        if (cpu_cgroup(boxes, sid) / "tasks").exists() else set()
    box = boxes.edge.live[sid].box
    if boxes.kind == "container":
        uids = range(box.host_uid, box.host_uid + 65536)
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.stat(f"/proc/{d}").st_uid in uids:
                        tids.update(int(t) for t in os.listdir(f"/proc/{d}/task"))
                except FileNotFoundError:
                    continue
    else:
        tids.update(int(t) for t in os.listdir(f"/proc/{box.pid}/task"))
    return sorted(tids)


async def attack(boxes: Boxes, sid: str) -> dict:
    await boxes.edge.file_write(sid, "/tmp/attack.py", ATTACK.encode(), 0o644)
    # a long-running child too: what the sandbox starts later must be in the class as well
    await boxes.edge.exec_start(sid, ExecSpec(cmd=["sleep", "60"]))
    r = await boxes.run(sid, ["python3", "/tmp/attack.py"], timeout_s=60)
    assert r.exit_code == 0, (r, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


async def test_batch_cgroup_is_idle(boxes: Boxes) -> None:
    """Layer 1, the cgroup: cpu.idle=1 at the lowest weight for batch, normal for latency;
    still so after the sandbox tried to write its cgroup files."""
    batch = await boxes.make(PY, qos="batch")
    lat = await boxes.make(PY, qos="latency")
    out = await attack(boxes, batch)
    if boxes.kind == "container":
        assert all(v != "ok" for k, v in out.items() if k.startswith(("mount", "write:"))), out
    v2 = qos.cpu_dir("", "")[1]
    weight = "cpu.weight" if v2 else "cpu.shares"
    b, n = cpu_cgroup(boxes, batch), cpu_cgroup(boxes, lat)
    assert (b / "cpu.idle").read_text().strip() == "1", b
    assert int((b / weight).read_text()) <= 3, (b / weight).read_text()
    assert (n / "cpu.idle").read_text().strip() == "0", n
    assert int((n / weight).read_text()) >= (100 if v2 else 1024)


async def test_batch_tasks_stay_sched_idle(boxes: Boxes) -> None:
    """Layer 2, each task's policy: every host task of a batch sandbox is SCHED_IDLE, and the
    sandbox can not set itself back to SCHED_OTHER, BATCH, FIFO or RR, nor nice -20 (a latency
    sandbox, the control, is SCHED_OTHER and may stay so)."""
    batch = await boxes.make(PY, qos="batch")
    lat = await boxes.make(PY, qos="latency")
    out_b, out_l = await attack(boxes, batch), await attack(boxes, lat)
    if boxes.kind == "container":
        for k in ("other", "batch", "fifo", "rr", "init_other"):
            assert out_b[k] == "EPERM", (k, out_b)
        for k in ("nice", "nice_pgrp"):  # setpriority says EACCES for a lower nice value
            assert out_b[k] == "EACCES", (k, out_b)
        assert out_b["policy"] == os.SCHED_IDLE, out_b
        # the control: the same calls that batch is refused are allowed to latency
        assert out_l["other"] == "ok" and out_l["batch"] == "ok", out_l
        for k in ("fifo", "rr"):  # no raise above normal for latency either
            assert out_l[k] == "EPERM", (k, out_l)
        assert out_l["nice"] == "EACCES", out_l
    tasks = host_tasks(boxes, batch)
    if boxes.kind == "container":  # the agent and the sleep it started after create
        comms = {Path(f"/proc/{t}/comm").read_text().strip() for t in tasks}
        assert "sleep" in comms and len(tasks) >= 2, comms
    policies = {}
    for t in tasks:
        try:
            policies[t] = os.sched_getscheduler(t)
        except ProcessLookupError:
            continue
    assert policies and set(policies.values()) == {os.SCHED_IDLE}, policies
    lat_policies = {os.sched_getscheduler(t) for t in host_tasks(boxes, lat)}
    assert lat_policies == {os.SCHED_OTHER}, lat_policies


async def test_batch_rlimits_hold(boxes: Boxes) -> None:
    """Layer 3, the hard limits that make the kernel refuse the way back: RLIMIT_NICE and
    RLIMIT_RTPRIO 0 for every host task of the sandbox (a container's processes, a VM's
    QEMU), and raising them is refused."""
    # (the config's own setting, whatever the edge inherited, is checked by
    # tests/unit/test_qos.py: this machine can not raise the edge's hard limits to show it)
    sid = await boxes.make(PY, qos="batch")
    out = await attack(boxes, sid)
    if boxes.kind == "container":
        assert out["rlimit_nice"] == "EPERM" and out["rlimit_rtprio"] == "EPERM", out
        for k in ("other", "fifo"):
            assert out[k] == "EPERM", (k, out)
    for t in host_tasks(boxes, sid):
        try:
            limits = Path(f"/proc/{t}/limits").read_text()
        except FileNotFoundError:
            continue
        for name in ("Max nice priority", "Max realtime priority"):
            line = next(x for x in limits.splitlines() if x.startswith(name))
            assert line.split()[-2:] == ["0", "0"], (t, line)


async def test_batch_stays_in_its_cgroup(boxes: Boxes) -> None:
    """Layer 4, membership: after the attempts to move itself (cgroup.procs of a mounted
    cgroupfs, a cgroup namespace of its own, writes to /sys/fs/cgroup), every host task of the
    sandbox is still in its cpu cgroup (the one with cpu.idle=1)."""
    sid = await boxes.make(PY, qos="batch")
    out = await attack(boxes, sid)
    if boxes.kind == "container":
        assert out["unshare_cgroup"] == "EPERM" and out["mount_v2"] == "EPERM", out
        assert out["mount_v1_cpu"] == "EPERM", out
        # its own view of its cgroups starts at its namespace's root: nothing of the host's
        assert boxes.edge.settings.cgroup_parent not in out["cgroup"], out["cgroup"]
        assert sid not in out["cgroup"], out["cgroup"]
    want = cpu_cgroup(boxes, sid)
    tasks = set(host_tasks(boxes, sid))
    assert tasks
    assert tasks <= {int(t) for t in (want / "tasks").read_text().split()}, (
        tasks, (want / "tasks").read_text())


@container_only("the unhardened twin is a container without seccomp, masks or capabilities "
                "dropped; a guest's root has all of that in the guest anyway")
async def test_batch_unhardened_twin_still_idle(boxes: Boxes) -> None:
    """Without seccomp and with every capability of its user namespace, the sandbox makes a
    cgroup namespace of its own and mounts its view of the cgroup hierarchies: the class holds
    all the same (the cpu controller's files are the host root's, leaving SCHED_IDLE needs
    the host's CAP_SYS_NICE or an RLIMIT_NICE it can not raise)."""
    sid = await boxes.make(PY, qos="batch", hardened=False)
    out = await attack(boxes, sid)
    for k in ("other", "fifo", "rlimit_nice"):
        assert out[k] == "EPERM", (k, out)
    assert out["nice"] == "EACCES", out
    # it can mount its cgroup namespace's view of either hierarchy (this kernel lets a user
    # namespace's root mount both), but the cpu files there are the host root's
    assert out["mount_v2"] == "ok" or out["mount_v1_cpu"] == "ok", out  # the twin works
    refused = {k: v for k, v in out.items() if k.startswith("mount_") and ":cpu." in k}
    assert refused and all(v != "ok" for v in refused.values()), out
    if out["mount_v1_cpu"] == "ok":
        assert out["mount_v1_cpu:procs"] != "ok", out  # the cpu cgroup's procs: the host's
    b = cpu_cgroup(boxes, sid)
    assert (b / "cpu.idle").read_text().strip() == "1"
    assert {os.sched_getscheduler(t) for t in host_tasks(boxes, sid)} == {os.SCHED_IDLE}


async def test_bad_qos_class_refused(boxes: Boxes) -> None:
    """An unknown class is a typed bad request at the backend too (below the API's validation),
    before anything is made."""
    sid = f"{boxes.edge.settings.node_id}-qosbad"
    backend = boxes.edge.backends[boxes.kind]
    spec = ResolvedSpec(image=BB, layers=(), resources=Resources(), env={},
                        qos="urgent")  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="qos"):
        await backend.create(sid, spec)
    assert not backend.leftovers(sid)
