"""What a sandbox sees of the host's CPUs: ceil(cpus) of them (issue 11, item 9).

The CFS quota is the limit; this makes the counts programs size their thread pools by agree
with it. Each sandbox gets a cpuset of ceil(cpus) host CPUs (runc's ``linux.resources.cpu.cpus``:
``nproc``, ``os.sched_getaffinity``), spread round-robin over the CPUs the edge may use so
sandboxes do not pile onto CPU 0, and read-only generated files for ``/proc/cpuinfo`` (only
those CPUs' blocks) and ``/sys/devices/system/cpu/{online,possible,present}`` (glibc's
``sysconf(_SC_NPROCESSORS_ONLN/CONF)``, hence ``os.cpu_count()``). The files are made by the
platform in the sandbox's own directory (``<sandbox dir>/cpu``, beside, not in, its tree) per
sandbox, bound read-only into it; ``/sys`` itself is that directory's ``sys`` tree (the sandbox
never sees the host's sysfs).

Must not touch: cgroups (runc sets the cpuset), the sandbox's tree.
"""
from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CPU_SYS_FILES = ("online", "possible", "present")


def cpu_list(cpus: list[int]) -> str:
    """Kernel list format: [0, 1, 2, 5] -> "0-2,5"."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(cpus)), lambda p: p[1] - p[0]):
        ids = [c for _, c in run]
        out.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(out)


def cpuinfo_for(host_cpuinfo: str, cpus: list[int]) -> str:
    """The host's /proc/cpuinfo with only the blocks of ``cpus``; per-package counts
    (siblings, cpu cores) say how many the sandbox has."""
    keep = set(cpus)
    blocks = []
    for block in host_cpuinfo.strip("\n").split("\n\n"):
        m = re.search(r"^processor\s*:\s*(\d+)\s*$", block, re.M)
        if m is None or int(m.group(1)) not in keep:
            continue
        block = re.sub(r"^(siblings\s*:\s*)\d+$", rf"\g<1>{len(cpus)}", block, flags=re.M)
        block = re.sub(r"^(cpu cores\s*:\s*)\d+$", rf"\g<1>{len(cpus)}", block, flags=re.M)
        blocks.append(block)
    return "\n\n".join(blocks) + "\n\n"


@dataclass(frozen=True)
class CpuView:
    cpus: list[int]  # host CPU ids of the sandbox's cpuset
    root: Path  # <sandbox dir>/cpu: cpuinfo and sys/devices/system/cpu/*

    @property
    def cpuset(self) -> str:
        return cpu_list(self.cpus)

    @property
    def cpuinfo(self) -> Path:
        return self.root / "cpuinfo"

    @property
    def sys(self) -> Path:
        return self.root / "sys"


class CpuViews:
    """Picks each new sandbox's CPUs and writes its view's files."""

    def __init__(self) -> None:
        self.host_cpus = sorted(os.sched_getaffinity(0))
        self.host_cpuinfo = Path("/proc/cpuinfo").read_text()
        self._next = itertools.count()

    def pick(self, cpus: float) -> list[int]:
        n = min(len(self.host_cpus), max(1, math.ceil(cpus - 1e-9)))
        start = next(self._next) % len(self.host_cpus)
        return sorted(self.host_cpus[(start + i) % len(self.host_cpus)] for i in range(n))

    def write(self, sandbox_dir: Path, cpus: list[int]) -> CpuView:
        """The view's files under the sandbox's own (platform-owned) dir, removed with it."""
        view = CpuView(cpus=cpus, root=sandbox_dir / "cpu")
        cpu_dir = view.sys / "devices/system/cpu"
        cpu_dir.mkdir(parents=True, mode=0o755)
        for d in (view.root, view.sys, view.sys / "devices", cpu_dir.parent, cpu_dir):
            os.chmod(d, 0o755)  # runc binds them as the sandbox's uid: search rights needed
        files = {view.cpuinfo: cpuinfo_for(self.host_cpuinfo, cpus)}
        files.update({cpu_dir / name: view.cpuset + "\n" for name in CPU_SYS_FILES})
        for path, text in files.items():
            path.write_text(text)
            os.chmod(path, 0o444)
        return view
