"""A snapshot's upper as a tar stream from the sandbox (rollbox.images.snapshot_tar): the stream
is hostile, so it must never make the host write through a link it planted, leave the staging
dir, expand sparse members or pass the caps; and the opaque markers tar can not carry are
inferred from the merged view without changing what the sandbox saw."""
from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.images.overlay import OPAQUE_XATTR
from rollbox.images.snapshot_tar import UpperTree, capture_tar, opaque_dirs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mknod)")


def ti(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644,
       uid: int = 0, dev: tuple[int, int] = (0, 0)) -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.linkname, t.mode, t.uid, t.gid = kind, link, mode, uid, uid
    t.devmajor, t.devminor = dev
    return t


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(ti(".", tarfile.DIRTYPE, mode=0o755))
        for t, data in members:
            if data is not None:
                t.size = len(data)
            tf.addfile(t, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def gnu_sparse_tar(tmp: Path, fmt: str) -> bytes:
    """A tar GNU tar made of a 1 GiB sparse file (10 KiB of stream), top dir first."""
    d = tmp / f"sparse-src-{fmt}"
    d.mkdir()
    with open(d / "f", "wb") as f:
        f.truncate(1 << 30)
        f.write(b"x")
    return subprocess.run(["tar", "-S", f"--format={fmt}", "-cf", "-", "-C", str(d), "."],
                          check=True, capture_output=True).stdout


def capture(src: io.BytesIO, dest: Path, **kw: object) -> tuple:
    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("max_entries", 100)
    return capture_tar(src, str(dest), scrub=kw.pop("scrub", []),  # type: ignore[arg-type]
                       exclude=[], **kw)  # type: ignore[arg-type]


def test_overlay_format_ids_and_skips(tmp_path: Path) -> None:
    dest = tmp_path / "s"
    stats, tree = capture(tar_of(
        (ti("work", tarfile.DIRTYPE, mode=0o750, uid=1000), None),
        (ti("work/a", mode=0o4755, uid=1000), b"data"),
        (ti("work/h", tarfile.LNKTYPE, "work/a"), None),
        (ti("work/l", tarfile.SYMTYPE, "/etc/shadow"), None),
        (ti("work/gone", tarfile.CHRTYPE), None),  # a whiteout
        (ti("work/null", tarfile.CHRTYPE, dev=(1, 3)), None),  # a device: skipped
        (ti("work/fifo", tarfile.FIFOTYPE), None),
        (ti("work/big-id", uid=70000), b""),
        (ti("tmp", tarfile.DIRTYPE), None), (ti("tmp/x"), b"scratch"),
    ), dest, scrub=["/tmp/*"])
    w = dest / "work"
    assert (w / "a").read_bytes() == b"data" and stat.S_IMODE((w / "a").stat().st_mode) == 0o4755
    assert (w / "a").stat().st_uid == 1000 and (w / "big-id").stat().st_uid == 65534
    assert os.path.samefile(w / "a", w / "h")
    assert os.readlink(w / "l") == "/etc/shadow"
    assert stat.S_ISCHR((w / "gone").lstat().st_mode) and (w / "gone").lstat().st_rdev == 0
    assert not (w / "null").exists() and stats.skipped == ["/work/null"]
    assert stat.S_ISFIFO((w / "fifo").lstat().st_mode)
    assert os.listdir(dest / "tmp") == [] and stats.scrubbed == 1
    assert (stats.whiteouts, stats.bytes) == (1, 4)
    assert tree.dirs["work"] >= {"a", "gone", "null"} and tree.dirs["tmp"] == {"x"}


@pytest.mark.parametrize("members,match", [
    # a link the stream planted, then a member through it: never written through
    ([(ti("l", tarfile.SYMTYPE, "/etc"), None), (ti("l/passwd"), b"owned")], "not below"),
    ([(ti("l", tarfile.SYMTYPE, "../../.."), None), (ti("l/x"), b"x")], "not below"),
    ([(ti("f"), b"x"), (ti("f/x"), b"x")], "not below"),
    ([(ti("missing/x"), b"x")], "not below"),
    ([(ti("../x"), b"x")], "'..'"),
    ([(ti("/etc/x"), b"x")], "absolute"),
    ([(ti("a"), b"1"), (ti("a"), b"2")], "duplicate"),
    ([(ti("d", tarfile.DIRTYPE), None), (ti("h", tarfile.LNKTYPE, "d"), None)], "hard link"),
    ([(ti("h", tarfile.LNKTYPE, "/etc/shadow"), None)], "absolute"),
    ([(ti("h", tarfile.LNKTYPE, "nope"), None)], "hard link"),
])
def test_hostile_members(tmp_path: Path, members: list, match: str) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    with pytest.raises(errors.InfraError, match=match):
        capture(tar_of(*members), tmp_path / "s")
    assert os.listdir(canary) == []
    assert b"owned" not in Path("/etc/passwd").read_bytes()


def test_caps(tmp_path: Path) -> None:
    with pytest.raises(errors.PayloadTooLarge):
        capture(tar_of((ti("a"), b"x" * 600), (ti("b"), b"x" * 600)), tmp_path / "1",
                max_bytes=1000)
    with pytest.raises(errors.PayloadTooLarge):
        capture(tar_of(*[(ti(f"f{i}"), b"") for i in range(6)]), tmp_path / "2", max_entries=5)
    deep = [(ti("/".join(["d"] * (i + 1)), tarfile.DIRTYPE), None) for i in range(300)]
    with pytest.raises(errors.BadRequest, match="deeper"):
        capture(tar_of(*deep), tmp_path / "3", max_entries=1000)
    # a header claiming 1 TiB is refused before a byte of it is read
    big = ti("big")
    big.size = 1 << 40
    raw = tar_of().getvalue()[:512] + big.tobuf(tarfile.GNU_FORMAT) + b"\0" * 4096
    with pytest.raises(errors.PayloadTooLarge):
        capture(io.BytesIO(raw), tmp_path / "4")
    for fmt in ("gnu", "pax"):  # GNU tar's sparse forms: a few bytes naming a 1 GiB file
        with pytest.raises(errors.InfraError, match="sparse"):
            capture(io.BytesIO(gnu_sparse_tar(tmp_path, fmt)), tmp_path / f"5{fmt}",
                    max_bytes=2 << 30)
    with pytest.raises(errors.InfraError, match="malformed|bad"):
        capture(io.BytesIO(b"\x01" * 4096), tmp_path / "6")
    pax = io.BytesIO()
    with tarfile.open(fileobj=pax, mode="w", format=tarfile.PAX_FORMAT) as tf:
        t = ti("p")
        t.pax_headers = {"comment": "c" * (2 << 20)}
        tf.addfile(t, io.BytesIO(b""))
    pax.seek(0)
    with pytest.raises(errors.InfraError, match="pax header too large"):
        capture(pax, tmp_path / "7")
    top = io.BytesIO()
    with tarfile.open(fileobj=top, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(ti("."), io.BytesIO(b""))  # the top of the upper as a file
    top.seek(0)
    with pytest.raises(errors.InfraError, match="top"):
        capture(top, tmp_path / "8")


def test_opaque_inference() -> None:
    tree = UpperTree(dirs={"": {"a", "b", "n"}, "a": {"x", "y"}, "a/y": {"k"}, "b": {"z"},
                           "n": {"m"}, "n/m": set()},
                     captured={"", "a", "a/y", "b", "n", "n/m"})
    merged: dict[str, set[str] | None] = {
        "": {"a", "b", "n", "bin", "etc"},  # lower entries show at the root: not opaque
        "a": {"x", "y"},                     # nothing of a lower layer below a...
        "a/y": {"k"},
        "b": {"z", "lower-file"},            # ...b shows a lower entry: merged
        "n": {"m"}, "n/m": None,             # n/m unknown: n can not be marked
    }
    assert opaque_dirs(tree, merged) == {"a"}  # the top-most only; a/y is covered by it
    merged["n/m"] = set()
    assert opaque_dirs(tree, merged) == {"a", "n"}
    # a/y left out of the snapshot (scrubbed): what is below it is unknown, so a is not marked
    del tree.dirs["a/y"]
    tree.captured.discard("a/y")
    tree.scrubbed.add("a/y")
    assert opaque_dirs(tree, merged) == {"n"}


def test_opaque_xattr_name() -> None:
    assert OPAQUE_XATTR == "trusted.overlay.opaque"
