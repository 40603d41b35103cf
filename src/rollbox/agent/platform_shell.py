"""The platform shell: the bash that interprets command strings in sandboxes
(``sb.exec("...")``, E2B ``commands.run``, SWE-ReX sessions and ``shell=True`` commands, the
platform's own ``run_shell``).

A sandbox's ``/bin/sh`` and the first ``bash`` in its PATH are its root's to replace, and a
replaced shell sees and can forge the output of every later string command. So string commands
run Debian's ``bash-static`` instead: a copy in a root-owned, content-addressed host directory
(like the agent binary), handed to the agent as an inherited fd; the agent execs it by
descriptor (``execveat(fd, "", ..., AT_EMPTY_PATH)``), so no path of the sandbox is looked up.
It is static, so it needs nothing of the image (a busybox image works too); the command it runs
still finds the sandbox's own tools in PATH.

Static glibc still reads two things of the sandbox's tree that name code to load: NSS (bash
calls ``getpwuid`` at every start; ``/etc/nsswitch.conf`` names modules that are dlopen'ed from
the sandbox's ``/lib``) and gconv (charset conversions named by
``/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache``). The installed copy has those paths
rewritten, byte for byte, to names under ``/proc`` that nothing in a sandbox can create: glibc
then takes its built-in defaults (``files``, i.e. ``/etc/passwd`` read as data) and its built-in
conversions only. A build of bash-static where a path is not found exactly once is refused.

Owns that copy only: the agent (``native/agent/agent.c``) execs it, so it lives with the agent,
below the container backend that installs it next to the agent binary and the microVM guest
build that puts it in the initramfs (``/platform/bash``); the edge and the compat doors decide
which commands use it (``protocol.ExecRequest.platform_shell``).
"""
from __future__ import annotations

from pathlib import Path

from rollbox.errors import InfraError

# (path in glibc, same-length replacement that can not exist in a sandbox: procfs' root
# refuses new entries, and mounting over /proc is refused by seccomp).
REWRITES: tuple[tuple[bytes, bytes], ...] = (
    (b"/etc/nsswitch.conf\0", b"/proc/.rollbox-nss\0"),
    (b"/usr/lib/x86_64-linux-gnu/gconv\0", b"/proc/.rollbox-no-gconv-modules\0"),
    (b"/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache\0",
     b"/proc/.rollbox-no-gconv-modules/gconv-modules.cache\0"),
)
NAME = "bash"  # file name of the installed copy


def prepared(src: Path) -> bytes:
    """The bytes of ``src`` (bash-static) with the lookups of the sandbox's tree rewritten."""
    try:
        data = src.read_bytes()
    except OSError as exc:
        raise InfraError(f"platform shell missing at {src} ({exc.strerror}; run `make deps`, "
                         f"which installs bash-static)") from None
    if not data.startswith(b"\x7fELF"):
        raise InfraError(f"platform shell {src} is not an ELF binary")
    for old, new in REWRITES:
        assert len(old) == len(new), (old, new)
        if data.count(old) != 1:
            raise InfraError(f"platform shell {src}: expected {old[:-1].decode()!r} exactly "
                             f"once, found it {data.count(old)} times (unknown bash-static "
                             f"build)")
        data = data.replace(old, new)
    return data
