"""The user.* extended attributes of a microVM snapshot arrive as the agent's records
(``rollbox-xattrs``) and are set on the staging tree with a container snapshot's caps: only
user.* (not user.overlay.*), values up to MAX_XATTR_BYTES, only on regular files and
directories the capture made, never through a link or out of the tree; bad records are a
typed error, too many a PayloadTooLarge."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from rollbox.errors import InfraError, PayloadTooLarge
from rollbox.images.snapshot import MAX_XATTR_BYTES
from rollbox.images.snapshot_tar import apply_xattrs


def rec(path: str, name: str, value: bytes) -> bytes:
    p, n = path.encode(), name.encode()
    return b"XA" + struct.pack("<HHI", len(p), len(n), len(value)) + p + n + value


def xattrs(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in os.listxattr(path, follow_symlinks=False) if n.startswith("user.")}


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    root = tmp_path / "staging"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"v")
    (root / "link").symlink_to(outside)  # a symlink the sandbox made (captured as such)
    (root / "flink").symlink_to(outside / "victim")
    os.mkfifo(root / "fifo")
    return root


def test_user_xattrs_are_set_where_the_capture_made_files(staging: Path) -> None:
    records = (rec("", "user.top", b"1") + rec("d", "user.dir", b"2")
               + rec("d/f", "user.mime_type", b"text/plain")
               + rec("d/f", "user.big", b"b" * 1000))
    assert apply_xattrs(records, str(staging), 100) == 4
    assert xattrs(staging) == {"user.top": b"1"}
    assert xattrs(staging / "d") == {"user.dir": b"2"}
    assert xattrs(staging / "d" / "f") == {"user.mime_type": b"text/plain",
                                            "user.big": b"b" * 1000}


def test_what_a_container_snapshot_drops_is_dropped(staging: Path) -> None:
    records = (rec("d/f", "trusted.overlay.opaque", b"y") + rec("d/f", "security.capability",
                                                                 b"\0" * 20)
               + rec("d/f", "user.overlay.redirect", b"/x")
               + rec("d/f", "user.toobig", b"b" * (MAX_XATTR_BYTES + 1))
               + rec("d/missing", "user.a", b"1")  # scrubbed or excluded: not made
               + rec("fifo", "user.a", b"1"))
    assert apply_xattrs(records, str(staging), 100) == 0
    assert xattrs(staging / "d" / "f") == {}


def test_no_record_reaches_out_of_the_tree(staging: Path) -> None:
    victim = staging.parent / "outside" / "victim"
    records = b"".join(rec(p, "user.pwned", b"1") for p in (
        "link/victim", "flink", "../outside/victim", "d/../../outside/victim", "/etc/passwd",
        "d//f", "./d/f", str(victim)))
    assert apply_xattrs(records, str(staging), 100) == 0
    assert xattrs(victim) == {} and xattrs(staging / "d" / "f") == {}


@pytest.mark.parametrize("bad", [b"XA\0", b"XB" + struct.pack("<HHI", 0, 6, 1) + b"user.a1",
                                 b"XA" + struct.pack("<HHI", 1, 6, 100) + b"duser.a"])
def test_a_malformed_stream_is_refused(staging: Path, bad: bytes) -> None:
    with pytest.raises(InfraError, match="bad snapshot stream"):
        apply_xattrs(rec("d", "user.ok", b"1") + bad, str(staging), 100)


def test_too_many_records_are_refused(staging: Path) -> None:
    with pytest.raises(PayloadTooLarge):
        apply_xattrs(rec("d", "user.a", b"1") * 11, str(staging), 10)
