"""The host-side capture of a hostile upper directory, and the freezer.

The "upper" here is a directory the test builds on the host with what an agent could leave in
its writable layer; capture_upper must copy it without following any link, reading any FIFO or
device, or leaving the staging directory, and enforce its caps with typed errors."""
from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.images import snapshot as snap
from rollbox.images.overlay import make_whiteout, set_opaque
from rollbox.models import ExecSpec, SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (xattrs, mknod)")]
SHIFT = 1_500_000_000 // 65536 * 65536  # a sandbox's host uid base


def hostile_upper(root: Path) -> Path:
    up = root / "upper"
    (up / "work/sub").mkdir(parents=True)
    (up / "work/data.txt").write_text("data")
    os.link(up / "work/data.txt", up / "work/hard.txt")
    os.symlink("/etc/shadow", up / "work/shadow")
    os.symlink("../../../../..", up / "work/up")
    os.symlink("/etc", up / "work/etc_dir")  # a symlink to a host directory
    os.mkfifo(up / "work/fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(up / "work/sock"))
    s.close()
    os.mknod(up / "work/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    make_whiteout(up / "work/deleted")
    (up / "opaque").mkdir()
    set_opaque(up / "opaque")
    with open(up / "work/sparse", "wb") as f:
        f.truncate(64 << 20)
    os.setxattr(up / "work/data.txt", "user.note", b"kept")
    os.setxattr(up / "work/data.txt", "trusted.overlay.origin", b"dropped")
    for p in [up, *up.rglob("*")]:
        os.chown(p, SHIFT, SHIFT, follow_symlinks=False)
    os.chmod(up / "work/data.txt", 0o4755)  # after chown, which clears setuid
    os.chown(up / "work/sub", SHIFT + 1000, 5, follow_symlinks=False)  # 5: not the sandbox's
    return up


def test_capture_never_follows_and_keeps_overlay_format(tmp_path: Path) -> None:
    up = hostile_upper(tmp_path)
    dest = tmp_path / "staging"
    t0 = time.monotonic()
    stats = snap.capture_upper(up, dest, id_shift=SHIFT, scrub=snap.DEFAULT_SCRUB, exclude=[])
    assert time.monotonic() - t0 < 5  # the FIFO was not opened for reading
    w = dest / "work"
    assert os.readlink(w / "shadow") == "/etc/shadow"
    assert os.readlink(w / "up") == "../../../../.."
    assert os.readlink(w / "etc_dir") == "/etc" and not (dest / "work/etc_dir").is_mount()
    assert stat.S_ISFIFO(os.lstat(w / "fifo").st_mode)
    assert not os.path.lexists(w / "sock") and not os.path.lexists(w / "null")
    assert os.lstat(w / "hard.txt").st_ino == os.lstat(w / "data.txt").st_ino
    wst = os.lstat(w / "deleted")
    assert stat.S_ISCHR(wst.st_mode) and wst.st_rdev == 0
    assert os.getxattr(dest / "opaque", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(w / "data.txt", "user.note") == b"kept"
    assert "trusted.overlay.origin" not in os.listxattr(w / "data.txt")
    dst = os.lstat(w / "data.txt")
    assert (dst.st_uid, dst.st_gid) == (0, 0) and stat.S_IMODE(dst.st_mode) == 0o4755
    sub = os.lstat(w / "sub")
    assert (sub.st_uid, sub.st_gid) == (1000, 65534)  # ids outside the sandbox: nobody
    assert os.lstat(w / "sparse").st_size == 64 << 20
    assert stats.whiteouts == 1 and stats.opaque_dirs == 1
    assert stats.skipped == ["/work/null", "/work/sock"]
    # Host files the links name are untouched and were never copied in.
    assert not any(p.is_file() and p.stat().st_size > (64 << 20) for p in dest.rglob("*")
                   if not p.is_symlink())


def test_capture_caps(tmp_path: Path) -> None:
    up = hostile_upper(tmp_path)
    with pytest.raises(errors.PayloadTooLarge):  # the sparse file counts at 64 MiB
        snap.capture_upper(up, tmp_path / "s1", id_shift=SHIFT, scrub=[], exclude=[],
                           max_bytes=32 << 20)
    with pytest.raises(errors.PayloadTooLarge):
        snap.capture_upper(up, tmp_path / "s2", id_shift=SHIFT, scrub=[], exclude=[],
                           max_entries=5)
    deep = tmp_path / "deep"
    d = deep
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    for _ in range(snap.MAX_DEPTH + 2):  # built by fd: the path outgrows PATH_MAX
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    with pytest.raises(errors.BadRequest):
        snap.capture_upper(deep, tmp_path / "s3", id_shift=0, scrub=[], exclude=[])
    red = tmp_path / "red"
    (red / "moved").mkdir(parents=True)
    os.setxattr(red / "moved", "trusted.overlay.redirect", b"/elsewhere")
    with pytest.raises(errors.InfraError):
        snap.capture_upper(red, tmp_path / "s4", id_shift=0, scrub=[], exclude=[])
    with pytest.raises(errors.BadRequest):
        snap.validate_patterns(["ok", "bad\0"])


def test_scrub_rules_and_exclude(tmp_path: Path) -> None:
    up = tmp_path / "upper"
    for rel in ("tmp/x", "var/tmp/y", "root/.cache/pip/w", "var/lib/apt/lists/l",
                "app/__pycache__/m.pyc", "app/.pytest_cache/v", "var/log/dpkg.log",
                "app/keep.py", "app/secret/k", "home/u/.npm/_cacache/c"):
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_text("x")
    make_whiteout(up / "tmp/base-file")  # a deletion survives even under a scrubbed path
    stats = snap.capture_upper(up, tmp_path / "s", id_shift=0, scrub=snap.DEFAULT_SCRUB,
                               exclude=["/app/secret"])
    left = sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*")
                  if not p.is_dir())
    assert left == ["app/keep.py", "tmp/base-file"]
    assert stats.scrubbed == 9
    assert len(snap.SCRUB_RULES) == len(set(snap.DEFAULT_SCRUB))


async def test_frozen_thaws_on_error(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image="busybox:test"), "p")
    box = edge.live[sb.id].box
    with snap.frozen(box.v2_cgroup):
        assert snap.is_frozen(box.v2_cgroup)
    assert not snap.is_frozen(box.v2_cgroup)
    with pytest.raises(RuntimeError), snap.frozen(box.v2_cgroup):
        raise RuntimeError("capture failed")
    assert not snap.is_frozen(box.v2_cgroup)
    # A frozen sandbox can still be deleted (fatal signals reach frozen tasks on cgroup v2).
    eid = await edge.exec_start(sb.id, ExecSpec(cmd="sleep 60", timeout_s=90))
    assert eid
    with snap.frozen(box.v2_cgroup):
        await edge.delete(sb.id)
    assert edge.leftovers(sb.id) == []
