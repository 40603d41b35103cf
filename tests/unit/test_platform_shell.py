"""The platform shell's installed copy: the sandbox-tree lookups of static glibc rewritten."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox.agent import platform_shell
from rollbox.errors import InfraError

BASH_STATIC = Path("/bin/bash-static")


@pytest.mark.skipif(not BASH_STATIC.exists(), reason="bash-static not installed (make deps)")
def test_prepared_rewrites_each_lookup_in_place() -> None:
    raw = BASH_STATIC.read_bytes()
    data = platform_shell.prepared(BASH_STATIC)
    assert len(data) == len(raw)
    for old, new in platform_shell.REWRITES:
        assert old in raw and old not in data and new in data
    assert sum(a != b for a, b in zip(raw, data)) <= sum(len(o) for o, _ in
                                                         platform_shell.REWRITES)


def test_prepared_refuses_an_unknown_build(tmp_path: Path) -> None:
    fake = tmp_path / "bash"
    fake.write_bytes(b"\x7fELF" + b"\0" * 64 + b"/etc/nsswitch.conf\0")
    with pytest.raises(InfraError, match="exactly once"):
        platform_shell.prepared(fake)
    fake.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(InfraError, match="not an ELF"):
        platform_shell.prepared(fake)
    with pytest.raises(InfraError, match="missing"):
        platform_shell.prepared(tmp_path / "absent")
