"""SandboxFS basic operations on a temp dir playing the sandbox's merged root (needs root:
files are chowned to shifted host ids)."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.errors import DiskFull
from rollbox.hostfs import SandboxFS
from rollbox.isolation import syscalls
from tests.unit.conftest import SHIFT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")



def test_write_read_round_trip_and_ownership(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.write("/work/pkg/a.py", b"print(1)\n", mode=0o640, uid=1000, gid=100)
    assert fs.read("/work/pkg/a.py") == b"print(1)\n"
    host = root / "work/pkg/a.py"
    s = host.stat()
    assert (s.st_uid, s.st_gid) == (SHIFT + 1000, SHIFT + 100)
    assert stat.S_IMODE(s.st_mode) == 0o640
    # Created parents belong to sandbox root (shifted 0), not to host root.
    for d in (root / "work", root / "work/pkg"):
        assert (d.stat().st_uid, d.stat().st_gid) == (SHIFT, SHIFT)
    info = fs.stat("/work/pkg/a.py")
    assert (info.type, info.size, info.uid, info.gid, info.mode) == ("file", 9, 1000, 100, 0o640)
    assert info.path == "/work/pkg/a.py" and info.name == "a.py"
    # No temp files left behind.
    assert sorted(os.listdir(root / "work/pkg")) == ["a.py"]


def test_write_replaces_atomically_and_strips_setuid(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.write("/f", b"one")
    ino = (root / "f").stat().st_ino
    fs.write("/f", b"two", mode=0o4755)
    assert fs.read("/f") == b"two"
    assert (root / "f").stat().st_ino != ino  # a new inode renamed over the old one
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o755


def test_write_refuses_directory_and_bad_input(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.mkdir("/d")
    with pytest.raises(errors.BadRequest, match="is a directory"):
        fs.write("/d", b"x")
    assert (root / "d").is_dir() and os.listdir(root / "d") == []
    assert os.listdir(root) == ["d"]  # temp file cleaned up
    for bad in ("relative/path", "", "/a\0b", "/" + "a" * 5000):
        with pytest.raises(errors.BadRequest):
            fs.write(bad, b"x")
    with pytest.raises(errors.BadRequest):
        fs.write("/", b"x")
    with pytest.raises(errors.BadRequest):
        fs.write("/x", b"x", uid=70000)
    with pytest.raises(errors.BadRequest):
        fs.write("/x", "text")  # type: ignore[arg-type]
    with pytest.raises(errors.NotFound):
        fs.write("/missing/x", b"x", parents=False)
    fs.write("/file", b"x")
    with pytest.raises(errors.BadRequest, match="not a directory"):
        fs.write("/file/x", b"x")


def test_caps(box: tuple[SandboxFS, Path]) -> None:
    _, root = box
    small = SandboxFS(root, SHIFT, max_read=10, max_write=10, max_entries=3)
    try:
        with pytest.raises(errors.PayloadTooLarge):
            small.write("/big", b"x" * 11)
        small.write("/ok", b"x" * 10)
        assert small.read("/ok") == b"x" * 10
        with pytest.raises(errors.PayloadTooLarge):
            small.read("/ok", max_bytes=5)
        (root / "big").write_bytes(b"y" * 11)
        with pytest.raises(errors.PayloadTooLarge):
            small.read("/big")
        for i in range(3):
            (root / f"e{i}").write_bytes(b"")
        with pytest.raises(errors.PayloadTooLarge):
            small.list("/")  # ok, big, e0, e1, e2 > 3
    finally:
        small.close()


def test_read_missing_and_non_regular(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    with pytest.raises(errors.NotFound):
        fs.read("/nope")
    (root / "dir").mkdir()
    with pytest.raises(errors.BadRequest, match="directory"):
        fs.read("/dir")


def test_read_follows_links_in_root(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.write("/usr/bin/python3.11", b"ELF")
    os.symlink("python3.11", root / "usr/bin/python3")
    os.symlink("/usr/bin", root / "bin")
    assert fs.read("/bin/python3") == b"ELF"
    st = fs.stat("/bin/python3")  # parents followed, last component not
    assert st.type == "symlink" and st.link_target == "python3.11"


def test_mkdir_list_exists_remove(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.mkdir("/a/b/c", parents=True, mode=0o700, uid=5, gid=6)
    fs.mkdir("/a/b/c", parents=True)  # like mkdir -p
    c = (root / "a/b/c").stat()
    assert (c.st_uid, c.st_gid, stat.S_IMODE(c.st_mode)) == (SHIFT + 5, SHIFT + 6, 0o700)
    with pytest.raises(errors.BadRequest, match="exists"):
        fs.mkdir("/a")
    with pytest.raises(errors.NotFound):
        fs.mkdir("/x/y")
    fs.write("/a/f", b"1")
    os.symlink("/a/b", root / "a/l")
    entries = fs.list("/a")
    assert [(e.name, e.type) for e in entries] == [("b", "dir"), ("f", "file"), ("l", "symlink")]
    assert entries[2].link_target == "/a/b" and entries[0].path == "/a/b"
    assert [e.name for e in fs.list("/a/l")] == ["c"]  # a link to a dir lists the dir
    with pytest.raises(errors.BadRequest, match="not a directory"):
        fs.list("/a/f")
    assert fs.exists("/a/f") and fs.exists("/a/l") and not fs.exists("/a/zz")
    assert not fs.exists("/a/f/zz")
    with pytest.raises(errors.BadRequest, match="not empty"):
        fs.remove("/a")
    fs.remove("/a/l")  # removes the link, not its target
    assert (root / "a/b/c").is_dir()
    fs.remove("/a", recursive=True)
    assert os.listdir(root) == []
    with pytest.raises(errors.NotFound):
        fs.remove("/a")
    with pytest.raises(errors.BadRequest, match="refusing"):
        fs.remove("/", recursive=True)


def test_remove_deep_tree(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    d = root / "deep"
    d.mkdir()
    cur = d
    for i in range(50):
        (cur / f"f{i}").write_bytes(b"x")
        os.symlink("/", cur / f"up{i}")
        cur = cur / f"d{i}"
        cur.mkdir()
    fs.remove("/deep", recursive=True)
    assert os.listdir(root) == []


def test_closed_fs_refuses(box: tuple[SandboxFS, Path]) -> None:
    fs, _ = box
    fs.close()
    with pytest.raises(errors.SandboxDead):
        fs.read("/x")


async def test_async_wrappers(box: tuple[SandboxFS, Path]) -> None:
    fs, _ = box
    await fs.awrite("/w/x", b"data", uid=3)
    assert await fs.aread("/w/x") == b"data"
    assert (await fs.astat("/w/x")).uid == 3
    assert [e.name for e in await fs.alist("/w")] == ["x"]
    await fs.amkdir("/w/d")
    assert await fs.aexists("/w/d")
    await fs.aremove("/w", recursive=True)
    assert not await fs.aexists("/w")


def test_disk_full_is_typed() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rbx-files-full-"))
    mounted = False
    try:
        syscalls.mount("tmpfs", tmp, "tmpfs", 0, "size=256k")
        mounted = True
        with SandboxFS(tmp, SHIFT) as fs:
            with pytest.raises(DiskFull) as ei:
                fs.write("/big", b"x" * (1 << 20))
            assert isinstance(ei.value, errors.BadRequest)
            assert ei.value.details["reason"] == "disk_full"
            assert os.listdir(tmp) == []  # the partial temp file is gone
    finally:
        if mounted:
            syscalls.umount(tmp, syscalls.MNT_DETACH)
        shutil.rmtree(tmp)


def test_bad_uid_shift() -> None:
    with pytest.raises(ValueError):
        SandboxFS(Path("/"), 12345)


def test_error_errno_detail(box: tuple[SandboxFS, Path]) -> None:
    fs, _ = box
    fs.write("/f", b"")
    with pytest.raises(errors.BadRequest) as ei:
        fs.stat("/f/x")
    assert ei.value.details["errno"] == errno.ENOTDIR


def test_xattrs_written_with_the_file_read_back_and_capped(box: tuple[SandboxFS, Path]) -> None:
    """user.* attributes are the new file's (set before it appears), read back by stat and
    list, gone when the file is replaced without them; bad names and sizes are typed, nothing
    written; a link's target's attributes are never read through the link."""
    fs, root = box
    fs.write("/d/a", b"1", xattrs={"user.e2b.k": "v", "user.x": "y"})
    assert os.getxattr(root / "d/a", "user.e2b.k") == b"v"
    assert fs.stat("/d/a").xattrs == {"user.e2b.k": "v", "user.x": "y"}
    assert fs.list("/d")[0].xattrs == {"user.e2b.k": "v", "user.x": "y"}
    fs.write("/d/a", b"2")  # replaced: none of the old attributes
    assert fs.stat("/d/a").xattrs is None
    os.setxattr(root / "d", "user.dir", b"1")  # directories too, set by the sandbox itself
    assert fs.stat("/d").xattrs == {"user.dir": "1"}
    os.setxattr(root / "d/a", "user.overlay.origin", b"z")  # the overlay's: never shown
    assert fs.stat("/d/a").xattrs is None
    fs.write("/d/t", b"t", xattrs={"user.secret": "s"})
    os.symlink("/d/t", root / "d/l")
    assert fs.stat("/d/l").xattrs is None
    for bad in ({"trusted.x": "v"}, {"user.overlay.x": "v"}, {"user.": "v"},
                {"user.a\0b": "v"}, {"user.big": "v" * 4097}, {"user." + "n" * 251: "v"},
                {f"user.{i}": "v" for i in range(65)},
                {f"user.{i}": "v" * 4000 for i in range(3)}, {"user.a": 1}):
        with pytest.raises(errors.BadRequest):
            fs.write("/d/bad", b"x", xattrs=bad)  # type: ignore[arg-type]
    assert sorted(os.listdir(root / "d")) == ["a", "l", "t"]
    for i in range(100):  # the sandbox's own many attributes: at most MAX_XATTRS read back
        os.setxattr(root / "d/t", f"user.m{i}", b"1")
    assert len(fs.stat("/d/t").xattrs or {}) == 64
