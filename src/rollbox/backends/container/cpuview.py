"""What a sandbox sees of the host's CPUs: ceil(cpus) of them (issue 11, item 9).

The CFS quota is the limit; this makes the counts programs size their thread pools by agree
with it. Each sandbox gets a cpuset of ceil(cpus) host CPUs (runc's ``linux.resources.cpu.cpus``:
``nproc``, ``os.sched_getaffinity``), spread round-robin over the CPUs the edge may use so
sandboxes do not pile onto CPU 0, and read-only generated files for ``/proc/cpuinfo`` (only
those CPUs' blocks) and ``/sys/devices/system/cpu/{online,possible,present}`` (glibc's
``sysconf(_SC_NPROCESSORS_ONLN/CONF)``, hence ``os.cpu_count()``). The two files (``cpuinfo``,
``cpulist``) are made by the platform in the sandbox's own directory (beside, not in, its tree)
and bound read-only into it; ``/sys`` is a read-only bind of the node's mask (masks.py) that
holds only their mount points (the sandbox never sees the host's sysfs).

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
    root: Path  # the sandbox's own dir: cpuinfo and cpulist files beside its tree

    @property
    def cpuset(self) -> str:
        return cpu_list(self.cpus)

    @property
    def cpuinfo(self) -> Path:
        return self.root / "cpuinfo"

    @property
    def cpulist(self) -> Path:
        """Bound at /sys/devices/system/cpu/{online,possible,present}."""
        return self.root / "cpulist"


class CpuViews:
    """Picks each new sandbox's CPUs and writes its view's files."""

    def __init__(self) -> None:
        self.host_cpus = sorted(os.sched_getaffinity(0))
        self.host_cpuinfo = Path("/proc/cpuinfo").read_text()
        self._next = itertools.count()
        self._texts: dict[tuple[int, ...], tuple[bytes, bytes]] = {}  # cpuinfo, cpu list

    def pick(self, cpus: float) -> list[int]:
        n = min(len(self.host_cpus), max(1, math.ceil(cpus - 1e-9)))
        start = next(self._next) % len(self.host_cpus)
        return sorted(self.host_cpus[(start + i) % len(self.host_cpus)] for i in range(n))

    def write(self, sandbox_dir: Path, cpus: list[int]) -> CpuView:
        """The view's two files in the sandbox's own (platform-owned) dir, removed with it.
        Plain os calls on precomputed bytes: this runs in every create."""
        key = tuple(cpus)
        texts = self._texts.get(key)
        if texts is None:
            texts = self._texts[key] = (cpuinfo_for(self.host_cpuinfo, cpus).encode(),
                                        (cpu_list(cpus) + "\n").encode())
        view = CpuView(cpus=cpus, root=sandbox_dir)
        for path, data in ((view.cpuinfo, texts[0]), (view.cpulist, texts[1])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)
            try:
                os.write(fd, data)
                os.fchmod(fd, 0o444)  # whatever the umask: read inside the sandbox
            finally:
                os.close(fd)
        return view
