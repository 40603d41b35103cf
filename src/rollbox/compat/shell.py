"""The shell form of a peer client's command: ``["/bin/bash", "-l", "-c", script]`` as E2B's
``commands.run`` sends it, ``["/bin/sh", "-c", script]`` for SWE-ReX's ``shell=True``.

Run as argv, that would exec the sandbox's own shell, which its root may have replaced with one
that forges the output of every later command. So the doors turn it into a command string,
which the edge runs under the platform shell (bash, exec'd by descriptor, never a file of the
sandbox). Login-shell flags are dropped: a login shell sources ``/etc/profile`` and
``~/.profile`` of the sandbox before the command, code the sandbox can rewrite just as well.

Owns the recognition only; what a string runs under belongs to the edge.
"""
from __future__ import annotations

import posixpath

SHELLS = frozenset({"sh", "bash"})
LOGIN_FLAGS = frozenset({"-l", "--login"})


def script_of(argv: list[str]) -> str | None:
    """The script of ``[sh|bash (any path), (-l|--login)*, -c, script]``; None when ``argv`` is
    not a shell's ``-c`` form. A ``-c`` form with anything else (positional arguments after
    the script, other options) raises ValueError: it can not run under the platform shell as
    a plain command string, and running it as argv would run the sandbox's shell."""
    if not argv or posixpath.basename(argv[0]) not in SHELLS or "-c" not in argv[1:]:
        return None
    i = argv.index("-c", 1)
    if any(a not in LOGIN_FLAGS for a in argv[1:i]) or len(argv) != i + 2:
        raise ValueError(f"unsupported shell invocation {argv[:i + 1]!r} (only "
                         f"`{argv[0]} [-l] -c SCRIPT` runs, under the platform shell)")
    return argv[i + 1]
