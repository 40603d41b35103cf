"""OOM-killer scores of the platform's own processes (server, in-sandbox agent, lazy-loading
daemon, PyPI mirror): they are never the kernel's choice while a sandbox command is there.

Protection writes the legacy ``/proc/<pid>/oom_adj`` = -17 (= ``oom_score_adj`` -1000). That
file, unlike ``oom_score_adj``, leaves the process's ``oom_score_adj_min`` as it was, so the
agent's children (the sandbox's commands, reset to 0 by the agent after fork) can not lower
themselves below 0 again. Lowering needs CAP_SYS_RESOURCE in the host's user namespace; where
the platform runs without it (some container hosts) every score stays at its inherited 0 and
the sandboxes' parent memory cgroup is what keeps an overload inside the sandboxes.
Owns nothing else.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

OOM_DISABLE = -17  # legacy oom_adj value for oom_score_adj -1000
PROTECTED_SCORE = -1000


def score(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def protect(pid: int | str = "self") -> int:
    """Make ``pid`` the OOM killer's last choice, as far as this host lets the platform;
    returns its ``oom_score_adj`` afterwards (-1000, or unchanged without CAP_SYS_RESOURCE)."""
    try:
        with open(f"/proc/{pid}/oom_adj", "w") as f:
            f.write(str(OOM_DISABLE))
    except PermissionError:
        log.debug("oom_score_adj of %s stays as it is (no CAP_SYS_RESOURCE)", pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0
    try:
        return score(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def can_protect() -> bool:
    """Whether this process may lower OOM scores (CAP_SYS_RESOURCE, bit 24, effective)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    return False
