"""rollbox.isolation.qos: the CPU classes' decision (which cgroup files, which values, in which
order), applying it to a real cpu cgroup and to real processes, the sandboxes' rlimits in the
OCI config, and core scheduling's detection (this kernel has CONFIG_SCHED_CORE off and no
SMT: the detection is checked against the kernel's own config and sysfs)."""
from __future__ import annotations

import errno
import gzip
import os
import subprocess
from pathlib import Path

import pytest

from rollbox.backends.container import bundle
from rollbox.backends.container.masks import NodeMask
from rollbox.errors import BadRequest
from rollbox.isolation import cgroups, qos
from rollbox.models import Resources

BATCH, LATENCY = qos.CLASSES["batch"], qos.CLASSES["latency"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, policies)")


def test_classes_and_bad_name() -> None:
    assert qos.cpu_class("batch").idle and not qos.cpu_class("latency").idle
    assert BATCH.shares < LATENCY.shares and BATCH.weight < LATENCY.weight
    assert LATENCY.shares >= 1024 and LATENCY.weight >= 100  # normal weight or more
    assert set(qos.QOS_CLASSES) == set(qos.CLASSES)
    with pytest.raises(BadRequest, match="unknown qos class 'urgent'"):
        qos.cpu_class("urgent")


def test_cgroup_writes_order() -> None:
    # an idle group refuses a weight (EINVAL): weight first, then idle; none when idle already
    assert qos.cgroup_writes(BATCH, v2=False) == [("cpu.shares", "2"), ("cpu.idle", "1")]
    assert qos.cgroup_writes(BATCH, v2=True) == [("cpu.weight", "1"), ("cpu.idle", "1")]
    assert qos.cgroup_writes(BATCH, v2=False, idle_now=True) == [("cpu.idle", "1")]
    # leaving idle resets the weight: clear first, then the class's weight
    assert qos.cgroup_writes(LATENCY, v2=False, idle_now=True) == [
        ("cpu.idle", "0"), ("cpu.shares", "1024")]
    assert qos.cgroup_writes(LATENCY, v2=True) == [("cpu.idle", "0"), ("cpu.weight", "100")]
    # a kernel without cpu.idle: the weight is all the cgroup can say
    assert qos.cgroup_writes(BATCH, v2=False, has_idle=False) == [("cpu.shares", "2")]


def test_sandbox_rlimits_in_oci_config(tmp_path: Path) -> None:
    """The hard RLIMIT_NICE/RLIMIT_RTPRIO 0 come from the config itself, not from what runc
    inherits (the red-team test sees them on a live sandbox, where the edge's are 0 anyway)."""
    cfg = bundle.oci_config(sandbox_id="s", rootfs=str(tmp_path), host_uid=100000,
                            netns_path=None, cgroups_path="/p/s", resources=Resources(),
                            hostname="s", mask=NodeMask(tmp_path / "mask"))
    lim = {r["type"]: (r["soft"], r["hard"]) for r in cfg["process"]["rlimits"]}
    assert lim["RLIMIT_NICE"] == (0, 0) and lim["RLIMIT_RTPRIO"] == (0, 0)


@needs_root
def test_apply_cgroup_on_a_real_cpu_cgroup() -> None:
    path, v2 = qos.cpu_dir(f"rollbox-qostest-{os.getpid()}", "sb")
    path.mkdir(parents=True)
    try:
        if not (path / "cpu.idle").exists():
            pytest.skip("this kernel has no cpu.idle")
        weight = path / ("cpu.weight" if v2 else "cpu.shares")
        assert qos.apply_cgroup(path, BATCH, v2=v2)
        assert (path / "cpu.idle").read_text().strip() == "1"
        assert int(weight.read_text()) <= 3  # the kernel's minimum for an idle group
        assert qos.apply_cgroup(path, BATCH, v2=v2)  # again on an idle group: no EINVAL
        assert qos.apply_cgroup(path, LATENCY, v2=v2)  # a spare claimed by a latency sandbox
        assert (path / "cpu.idle").read_text().strip() == "0"
        assert int(weight.read_text()) == (LATENCY.weight if v2 else LATENCY.shares)
    finally:
        cgroups.remove_tree(path)
        path.parent.rmdir()


@needs_root
def test_apply_tasks_and_the_way_back_refused() -> None:
    """SCHED_IDLE for every thread; an unprivileged process with RLIMIT_NICE 0 can not go back
    (the kernel's rule the sandboxes rely on), root (the edge) can."""
    code = ("import os, time, sys; sys.stdout.write('r\\n'); sys.stdout.flush(); "
            "time.sleep(30)")
    p = subprocess.Popen(["python3", "-c", code], stdout=subprocess.PIPE,
                         preexec_fn=lambda: (os.setresgid(65534, 65534, 65534),
                                             os.setresuid(65534, 65534, 65534)))
    try:
        assert p.stdout is not None and p.stdout.readline() == b"r\n"
        assert qos.apply_tasks([p.pid], BATCH) >= 1
        assert os.sched_getscheduler(p.pid) == os.SCHED_IDLE
        assert qos.apply_tasks([p.pid], BATCH) == 0  # nothing left to change
        probe = subprocess.run(
            ["python3", "-c", "import os, resource; "
             "resource.setrlimit(resource.RLIMIT_NICE, (0, 0)); "
             "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
             "os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))"],
            capture_output=True, text=True,
            preexec_fn=lambda: (os.setresgid(65534, 65534, 65534),
                                os.setresuid(65534, 65534, 65534)))
        assert probe.returncode != 0 and "Operation not permitted" in probe.stderr, probe
        assert qos.apply_tasks([p.pid], LATENCY) >= 1
        assert os.sched_getscheduler(p.pid) == os.SCHED_OTHER
    finally:
        p.kill()
        p.wait()
    assert qos.apply_tasks([p.pid], BATCH) == 0  # gone: skipped, not an error


def fake_prctl(err: int | None):  # noqa: ANN201
    calls: list[tuple[int, ...]] = []

    def prctl(*args: int) -> int:
        calls.append(args)
        if err is not None:
            raise OSError(err, os.strerror(err))
        return 0

    return prctl, calls


def test_core_sched_detection_mapping() -> None:
    prctl, calls = fake_prctl(errno.EINVAL)
    st = qos.core_sched_status(prctl)
    assert not st.available and "CONFIG_SCHED_CORE" in st.reason
    assert calls[0][:4] == (qos.PR_SCHED_CORE, qos.PR_SCHED_CORE_GET, 0, qos.PIDTYPE_PID)
    st = qos.core_sched_status(fake_prctl(errno.ENODEV)[0])
    assert not st.available and "SMT" in st.reason
    assert not qos.core_sched_status(fake_prctl(errno.EPERM)[0]).available
    assert qos.core_sched_status(fake_prctl(None)[0]) == qos.CoreSched(True)


def test_core_sched_cookie_for_latency_only() -> None:
    prctl, calls = fake_prctl(None)
    qos.core_sched_create(1234, prctl)
    assert calls == [(qos.PR_SCHED_CORE, qos.PR_SCHED_CORE_CREATE, 1234, qos.PIDTYPE_TGID, 0)]


def kernel_has_sched_core() -> bool | None:
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            config = f.read()
    except OSError:
        return None
    return "CONFIG_SCHED_CORE=y" in config


def test_core_sched_status_of_this_host() -> None:
    """The real prctl's answer agrees with the kernel's config and sysfs (here: no
    CONFIG_SCHED_CORE, no SMT, so unavailable; on a host with both, available)."""
    st = qos.core_sched_status()
    built = kernel_has_sched_core()
    if built is None:
        pytest.skip("no /proc/config.gz to check the answer against")
    smt = Path("/sys/devices/system/cpu/smt/active")
    has_smt = smt.exists() and smt.read_text().strip() == "1"
    assert st.available == (built and has_smt), st
    if not built:
        assert "CONFIG_SCHED_CORE" in st.reason
        with pytest.raises(OSError) as ei:  # making a cookie is refused the same way
            qos.core_sched_create(os.getpid())
        assert ei.value.errno == errno.EINVAL
    elif not has_smt:
        assert "SMT" in st.reason
    facts = qos.node_facts(True)
    assert facts["core_sched"] == st.available
    assert (facts.get("core_sched_reason") or "") == st.reason


def test_apply_start_makes_no_cookie_where_unavailable() -> None:
    """Latency on a host without core scheduling: the policy only, no error, no cookie."""
    me = os.getpid()
    assert qos.apply_start(me, LATENCY, qos.CoreSched(False, "none here")) is False
    assert os.sched_getscheduler(me) == os.SCHED_OTHER


def test_apply_cgroup_without_cpu_idle(tmp_path: Path) -> None:
    """A kernel without cpu.idle (before 5.15): the weight is written, and the caller is told
    the cgroup's idle flag is missing (SCHED_IDLE per task is then the class's only layer).
    A plain directory stands in for the cgroup: only the write order is under test here."""
    (tmp_path / "cpu.shares").write_text("1024")
    assert qos.apply_cgroup(tmp_path, BATCH, v2=False) is False
    assert (tmp_path / "cpu.shares").read_text() == "2"
    assert not (tmp_path / "cpu.idle").exists()


def test_node_class_where_the_node_does_not_enforce() -> None:
    assert qos.node_class("batch", True) is BATCH
    assert qos.node_class("batch", False) is LATENCY  # Settings.cpu_qos off
    assert qos.node_class("latency", False) is LATENCY
    with pytest.raises(BadRequest):  # a bad name is refused either way
        qos.node_class("urgent", False)
    assert qos.node_facts(False)["cpu_qos"] is False
