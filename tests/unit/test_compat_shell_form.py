"""The compat doors' recognition of a shell's `-c` form (run under the platform shell)."""
from __future__ import annotations

import pytest

from rollbox.compat.shell import script_of


def test_shell_forms() -> None:
    assert script_of(["/bin/bash", "-l", "-c", "echo hi"]) == "echo hi"  # E2B commands.run
    assert script_of(["sh", "-c", "x"]) == "x"
    assert script_of(["/usr/bin/bash", "--login", "-l", "-c", ""]) == ""
    assert script_of(["/bin/ls", "-c", "x"]) is None  # not a shell
    assert script_of(["bash", "script.sh"]) is None  # a script file: argv, the user's bash
    assert script_of([]) is None


@pytest.mark.parametrize("argv", [["bash", "-c", "echo $0", "name"], ["bash", "-e", "-c", "x"],
                                  ["/bin/sh", "-c"], ["bash", "-x", "-l", "-c", "x"]])
def test_other_shell_invocations_refused(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="unsupported shell invocation"):
        script_of(argv)
