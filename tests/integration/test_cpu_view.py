"""Item 9: a sandbox sees ceil(cpus) CPUs — nproc (affinity), os.cpu_count() (glibc reads
/sys/devices/system/cpu/online), /proc/cpuinfo and /sys/devices/system/cpu/{online,possible,
present} agree — while the CFS quota stays the limit; sandboxes are spread over the host's CPUs
and cannot change their view."""
from __future__ import annotations

import json
import math
import os

import pytest

from rollbox.backends.container.cpuview import cpu_list, cpuinfo_for
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.conftest import needs_python

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]

PROBE = r'''
import json, os, subprocess
out = {"nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout),
       "cpu_count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
       "cpuinfo": open("/proc/cpuinfo").read().count("processor\t:"),
       "sysconf_conf": os.sysconf("SC_NPROCESSORS_CONF")}
for f in ("online", "possible", "present"):
    out[f] = open(f"/sys/devices/system/cpu/{f}").read().strip()
for target in ("/sys/devices/system/cpu/online", "/proc/cpuinfo"):
    try:
        open(target, "w").write("0-63\n")
        out["write_" + target] = "ok"
    except OSError as exc:
        out["write_" + target] = exc.errno
try:
    os.mkdir("/sys/x")
    out["mkdir_sys"] = 0
except OSError as exc:
    out["mkdir_sys"] = exc.errno
print(json.dumps(out))
'''
HOST_CPUS = sorted(os.sched_getaffinity(0))


async def _probe(edge, cpus: float) -> dict:  # noqa: ANN001
    info = await edge.create(SandboxSpec(image="python:3.11", resources=Resources(cpus=cpus)),
                             "p")
    eid = await edge.exec_start(info.id, ExecSpec(cmd=["python3", "-c", PROBE], timeout_s=30))
    res = await edge.exec_wait(info.id, eid)
    assert res.exit_code == 0, res
    await edge.delete(info.id)
    return json.loads(res.stdout)


@needs_python
@pytest.mark.parametrize("cpus", [1, 1.5])
async def test_sandbox_sees_ceil_cpus(edge, cpus: float) -> None:  # noqa: ANN001
    n = min(len(HOST_CPUS), math.ceil(cpus))
    r = await _probe(edge, cpus)
    assert (r["nproc"], r["cpu_count"], r["cpuinfo"], r["sysconf_conf"]) == (n, n, n, n), r
    assert len(r["affinity"]) == n and set(r["affinity"]) <= set(HOST_CPUS)
    assert r["online"] == r["possible"] == r["present"] == cpu_list(r["affinity"])
    # read-only: EROFS (30) from the bind, or EACCES (13) as the files are host root's 0444
    assert r["write_/sys/devices/system/cpu/online"] in (13, 30), r
    assert r["write_/proc/cpuinfo"] in (13, 30), r
    assert r["mkdir_sys"] == 30, r  # the /sys tmpfs itself is read-only after the binds


@needs_python
async def test_single_cpu_sandboxes_spread_over_cpus(edge) -> None:  # noqa: ANN001
    if len(HOST_CPUS) < 2:
        pytest.skip("one host CPU: nothing to spread over")
    seen = {tuple((await _probe(edge, 1))["affinity"]) for _ in range(2)}
    assert len(seen) == 2, seen  # round-robin, not all on CPU 0


def test_cpuinfo_keeps_only_the_sandboxs_cpus() -> None:
    host = ("processor\t: 0\nsiblings\t: 4\ncpu cores\t: 4\n\n"
            "processor\t: 1\nsiblings\t: 4\ncpu cores\t: 4\n\n"
            "processor\t: 2\nsiblings\t: 4\ncpu cores\t: 4\n\n")
    out = cpuinfo_for(host, [1, 2])
    assert out.count("processor") == 2 and "processor\t: 0" not in out
    assert "siblings\t: 2" in out and "cpu cores\t: 2" in out and "4" not in out
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and cpu_list([1]) == "1"
