"""The ``rollbox.sudo`` image label (images.store.sudo_uids) and the sudo client's command
line (images.sudo_client.parse): what the agent-mediated sudo is asked for."""
from __future__ import annotations

import pytest

from rollbox.errors import BadRequest
from rollbox.images import sudo_client
from rollbox.images.store import sudo_uids


def test_label_parsing() -> None:
    assert sudo_uids({}) == []
    assert sudo_uids({"labels": {"other": "1"}}) == []
    assert sudo_uids({"labels": {"rollbox.sudo": "1000"}}) == [1000]
    assert sudo_uids({"labels": {"rollbox.sudo": "1000,1001"}}) == [1000, 1001]
    for bad in ("", "user", "1000,", "-1", str(2**32 - 1), ",".join(["1"] * 17)):
        with pytest.raises(BadRequest):
            sudo_uids({"labels": {"rollbox.sudo": bad}})


@pytest.mark.parametrize("argv, want", [
    (["whoami"], {"command": ["whoami"]}),
    (["-u", "user", "id"], {"user": "user", "command": ["id"]}),
    (["-uuser", "id"], {"user": "user", "command": ["id"]}),
    (["--user=user", "id"], {"user": "user", "command": ["id"]}),
    (["-iu", "user"], {"user": "user", "login": True, "command": []}),
    (["-nE", "--", "-weird"], {"preserve": True, "command": ["-weird"]}),
    (["FOO=1", "BAR=a=b", "env"], {"assigns": {"FOO": "1", "BAR": "a=b"}, "command": ["env"]}),
    (["--preserve-env=A,B", "env"], {"keep": {"A", "B"}, "command": ["env"]}),
    (["sh", "-c", "echo -u"], {"command": ["sh", "-c", "echo -u"]}),
])
def test_client_command_line(argv: list[str], want: dict) -> None:
    got = sudo_client.parse(argv)
    for key, value in want.items():
        assert got[key] == value, key


def test_client_refuses_unknown_options() -> None:
    with pytest.raises(SystemExit):
        sudo_client.parse(["-Z", "id"])
    with pytest.raises(SystemExit):
        sudo_client.parse(["-u"])


def test_client_escapes_and_assignments() -> None:
    assert sudo_client.escape("a b'c$x_-1") == "a\\ b\\'c$x_-1"
    assert sudo_client.is_assignment("FOO=1") and sudo_client.is_assignment("_x9=")
    for arg in ("=1", "1X=2", "A-B=1", "echo", "é=1"):
        assert not sudo_client.is_assignment(arg), arg
