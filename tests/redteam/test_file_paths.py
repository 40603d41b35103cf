"""Red team E31/E32: hostile paths and special files through the sandbox file API.

The "sandbox" is a temp dir playing the merged root; next to it sit host canaries that no file
operation may read, change, link or create files beside. /etc/passwd of the host must stay
untouched too. The agent (here: the test, as root) plants absolute and relative symlinks, ``..``,
FIFOs, device nodes, sparse giants, symlink loops and races renames.

Safety of the test itself: attacks that write, create, link or delete aim only at canaries in
the test's temp dir (by absolute and by climbing relative links), never at real host files, so a
regressed implementation fails these tests without damaging the machine. The real /etc/passwd is
only a target of non-destructive attacks (read, stat, list, download).
"""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import os
import shutil
import socket
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.hostfs import SandboxFS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mknod)")

SHIFT = 1_000_000_000 // 65536 * 65536
CANARY = b"host canary: must never be read or changed\n"
PASSWD = Path("/etc/passwd")


def snapshot(top: Path, skip: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every path under ``top`` except the sandbox root: (mode, nlink, size, sha256)."""
    out: dict[str, tuple[int, int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == skip.parent:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if p == skip:
                continue
            s = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(s.st_mode) else ""
            out[str(p)] = (s.st_mode, s.st_nlink, s.st_size, digest)
    return out


@dataclass
class Box:
    fs: SandboxFS
    root: Path
    host: Path  # the host dir holding the root and the canaries

    @property
    def canary(self) -> Path:
        return self.host / "canary.txt"


@pytest.fixture
def box() -> Iterator[Box]:
    host = Path(tempfile.mkdtemp(prefix="rbx-redteam-files-"))
    root = host / "root"
    root.mkdir()
    (host / "canary.txt").write_bytes(CANARY)
    (host / "outside").mkdir()
    (host / "outside/keep.txt").write_bytes(CANARY)
    (root / "work").mkdir()
    passwd_before = (PASSWD.read_bytes(), PASSWD.stat().st_nlink, PASSWD.stat().st_ino)
    fs = SandboxFS(root, SHIFT)
    before = snapshot(host, root)
    try:
        yield Box(fs, root, host)
        # The invariant of every test here: nothing outside the root changed.
        assert snapshot(host, root) == before
        assert (PASSWD.read_bytes(), PASSWD.stat().st_nlink, PASSWD.stat().st_ino) == passwd_before
    finally:
        fs.close()
        shutil.rmtree(host)


def rel_to_host(box: Box, target: Path, start: str = "work") -> str:
    """A relative link from ``root/start`` that would reach ``target`` if followed on the host."""
    return os.path.relpath(target, box.root / start)


def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    return ti


async def once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def download(fs: SandboxFS, path: str) -> bytes:
    return b"".join([c async for c in fs.download_tar(path)])


def plant_escapes(box: Box) -> None:
    w = box.root / "work"
    os.symlink("/etc/passwd", w / "abs_passwd")
    os.symlink("../../../../../../../../etc/passwd", w / "rel_passwd")
    os.symlink(str(box.canary), w / "abs_canary")
    os.symlink(rel_to_host(box, box.canary), w / "rel_canary")
    os.symlink(str(box.host), w / "abs_hostdir")
    os.symlink(rel_to_host(box, box.host), w / "rel_hostdir")
    os.symlink("/proc/self/root/etc/passwd", w / "magic")


# ---- E31: symlinks and '..' in paths ------------------------------------------------------------

LEAF_LINKS = ["abs_passwd", "rel_passwd", "abs_canary", "rel_canary", "magic"]
CANARY_LINKS = ["abs_canary", "rel_canary"]  # the only targets of destructive attacks
DIR_LINKS = ["abs_hostdir", "rel_hostdir"]


@pytest.mark.parametrize("link", LEAF_LINKS)
def test_e31_read_through_link_never_reads_host(box: Box, link: str) -> None:
    plant_escapes(box)
    with pytest.raises((errors.NotFound, errors.BadRequest)):
        box.fs.read(f"/work/{link}")


def test_e31_links_resolve_to_the_sandbox_own_files(box: Box) -> None:
    plant_escapes(box)
    (box.root / "etc").mkdir()
    (box.root / "etc/passwd").write_bytes(b"sandbox passwd\n")
    assert box.fs.read("/work/abs_passwd") == b"sandbox passwd\n"
    assert box.fs.read("/work/rel_passwd") == b"sandbox passwd\n"
    assert box.fs.read("/../../../etc/passwd") == b"sandbox passwd\n"  # '..' clamps at root
    # the host dir reached by the relative link is the sandbox root itself
    assert {e.name for e in box.fs.list("/work/rel_hostdir")} == {"etc", "work"}
    with pytest.raises(errors.NotFound):
        box.fs.read("/work/rel_hostdir/canary.txt")


@pytest.mark.parametrize("link", CANARY_LINKS)
def test_e31_write_replaces_link_instead_of_following(box: Box, link: str) -> None:
    plant_escapes(box)
    box.fs.write(f"/work/{link}", b"pwned")
    p = box.root / "work" / link
    assert not p.is_symlink() and p.read_bytes() == b"pwned"


def test_e31_write_through_symlinked_parent_stays_in_root(box: Box) -> None:
    plant_escapes(box)
    # relative link climbing out: clamped at the root, so this is the sandbox's /canary.txt
    box.fs.write("/work/rel_hostdir/canary.txt", b"pwned")
    assert (box.root / "canary.txt").read_bytes() == b"pwned"
    box.fs.mkdir("/work/rel_hostdir/outside/made", parents=True)
    assert (box.root / "outside/made").is_dir()
    # absolute host path: resolved in-root, where it does not exist (and is not created)
    with pytest.raises(errors.NotFound):
        box.fs.write("/work/abs_hostdir/canary.txt", b"pwned")
    with pytest.raises(errors.NotFound):
        box.fs.write("/work/abs_hostdir/outside/new.txt", b"pwned", parents=True)
    with pytest.raises(errors.NotFound):
        box.fs.mkdir("/work/abs_hostdir/made", parents=True)
    with pytest.raises(errors.NotFound):
        box.fs.read("/work/abs_hostdir/canary.txt")


@pytest.mark.parametrize("link", LEAF_LINKS + DIR_LINKS)
def test_e31_stat_reports_the_link_itself(box: Box, link: str) -> None:
    plant_escapes(box)
    info = box.fs.stat(f"/work/{link}")
    assert info.type == "symlink" and info.size == len(info.link_target or "")
    assert info.link_target == os.readlink(box.root / "work" / link)


@pytest.mark.parametrize("link", CANARY_LINKS + DIR_LINKS)
def test_e31_remove_touches_only_the_link(box: Box, link: str) -> None:
    plant_escapes(box)
    box.fs.remove(f"/work/{link}", recursive=True)
    assert not os.path.lexists(box.root / "work" / link)


def test_e31_remove_recursive_never_follows(box: Box) -> None:
    plant_escapes(box)
    (box.root / "work/sub").mkdir()
    os.symlink(str(box.host / "outside"), box.root / "work/sub/out")
    os.symlink(rel_to_host(box, box.host / "outside", "work/sub"), box.root / "work/sub/rout")
    with pytest.raises(errors.NotFound):
        box.fs.remove("/work/rel_hostdir/outside/keep.txt")
    box.fs.remove("/work", recursive=True)
    assert os.listdir(box.root) == []


def test_e31_bad_caller_paths(box: Box) -> None:
    for bad in ("work/x", "./x", "", "/x\0y", "/" + "a/" * 3000):
        with pytest.raises(errors.BadRequest):
            box.fs.read(bad)
        with pytest.raises(errors.BadRequest):
            box.fs.write(bad, b"x")


@pytest.mark.parametrize("name", ["../evil", "/abs-evil", "a/../../evil", "ok/../../../evil",
                                  "..", "a/b/../../.."])
async def test_e31_tar_traversal_members_refused(box: Box, name: str) -> None:
    data = make_tar([(member(name), b"pwned")])
    with pytest.raises(errors.BadRequest):
        await box.fs.upload_tar("/work/up", once(data))


@pytest.mark.parametrize("linkname", ["/abs/canary.txt", "../canary.txt", "../../canary.txt"])
async def test_e31_tar_hardlink_out_refused(box: Box, linkname: str) -> None:
    data = make_tar([(member("h", tarfile.LNKTYPE, linkname), None)])
    with pytest.raises((errors.BadRequest, errors.NotFound)):
        await box.fs.upload_tar("/work/up", once(data))


async def test_e31_tar_symlink_then_file_through_it_stays_in_root(box: Box) -> None:
    # The in-root twin of the host dir exists, so writes through the absolute link succeed.
    twin = box.root / str(box.host).lstrip("/")
    twin.mkdir(parents=True)
    esc_rel = rel_to_host(box, box.host, "work/up")
    for link, target in [("esc_abs", str(box.host)), ("esc_rel", esc_rel)]:
        data = make_tar([
            (member(link, tarfile.SYMTYPE, target), None),
            (member(f"{link}/canary.txt"), b"pwned"),
            (member(f"{link}/passwd"), b"pwned"),
            (member(f"{link}/hl", tarfile.LNKTYPE, f"{link}/passwd"), None),
        ])
        await box.fs.upload_tar("/work/up", once(data))
        assert os.readlink(box.root / "work/up" / link) == target  # stored verbatim
    # the writes through the links landed in the sandbox's own tree
    assert (twin / "canary.txt").read_bytes() == b"pwned"
    assert (twin / "hl").stat().st_ino == (twin / "passwd").stat().st_ino
    assert (box.root / "canary.txt").read_bytes() == b"pwned"  # the relative one, clamped
    assert (box.root / "hl").stat().st_ino == (box.root / "passwd").stat().st_ino


async def test_e31_tar_hardlink_through_symlinked_dir_links_in_root_only(box: Box) -> None:
    os.symlink(str(box.host), box.root / "work/hostdir")  # planted by the agent beforehand
    data = make_tar([(member("h", tarfile.LNKTYPE, "../hostdir/canary.txt"), None)])
    with pytest.raises(errors.BadRequest):  # '..' in the link name
        await box.fs.upload_tar("/work/up", once(data))
    data = make_tar([(member("hostdir/canary.txt"), b"x"),
                     (member("h", tarfile.LNKTYPE, "hostdir/canary.txt"), None)])
    with pytest.raises(errors.NotFound):
        await box.fs.upload_tar("/work", once(data))
    assert box.canary.stat().st_nlink == 1


async def test_e31_upload_into_symlinked_dir_stays_in_root(box: Box) -> None:
    os.symlink(rel_to_host(box, box.host), box.root / "work/out")
    data = make_tar([(member("canary.txt"), b"pwned"), (member("outside/keep.txt"), b"pwned")])
    await box.fs.upload_tar("/work/out", once(data))
    assert (box.root / "canary.txt").read_bytes() == b"pwned"
    assert (box.root / "outside/keep.txt").read_bytes() == b"pwned"


async def test_e31_download_never_follows_out(box: Box) -> None:
    plant_escapes(box)
    (box.root / "work/file").write_bytes(b"mine")
    blob = await download(box.fs, "/work")
    assert CANARY not in blob and PASSWD.read_bytes()[:64] not in blob
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        kinds = {m.name: m.type for m in tf}
    assert kinds["file"] == tarfile.REGTYPE
    assert all(kinds[n] == tarfile.SYMTYPE for n in LEAF_LINKS + DIR_LINKS)
    # a top-level link to a directory is followed, but in-root: this is the root, not the host
    blob = await download(box.fs, "/work/rel_hostdir")
    assert CANARY not in blob
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        assert "canary.txt" not in tf.getnames() and "work/file" in tf.getnames()
    # a top-level link to a file is stored as a link
    blob = await download(box.fs, "/work/abs_canary")
    assert CANARY not in blob


def test_e31_race_rename_dir_to_escaping_symlink(box: Box) -> None:
    """The agent flips /work/race between a dir and links pointing out while we use it."""
    w = box.root / "work"
    targets = [str(box.host / "outside"), rel_to_host(box, box.host / "outside")]
    stop = threading.Event()

    def flipper() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            new = w / f".new{i}"
            try:
                if i % 3:
                    os.symlink(targets[i % 2], new)
                else:
                    new.mkdir()
                try:
                    os.rename(w / "race", w / f".old{i}")
                except FileNotFoundError:
                    pass
                os.rename(new, w / "race")
            except OSError:
                pass

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 2.0
        n = ok = 0
        while time.monotonic() < deadline:
            n += 1
            for op in (lambda: box.fs.write("/work/race/keep.txt", b"pwned"),
                       lambda: box.fs.read("/work/race/keep.txt"),
                       lambda: box.fs.mkdir("/work/race/sub", parents=True),
                       lambda: box.fs.remove("/work/race/keep.txt"),
                       lambda: box.fs.list("/work/race")):
                try:
                    op()
                    ok += 1
                except errors.RollboxError:
                    pass
        assert n > 10 and ok > 0
    finally:
        stop.set()
        t.join(5)
    assert (box.host / "outside/keep.txt").read_bytes() == CANARY


# ---- E32: FIFOs, devices, sparse giants, oversized payloads ------------------------------------

@pytest.mark.timeout(10)
def test_e32_fifo_read_refused_promptly(box: Box) -> None:
    os.mkfifo(box.root / "work/fifo")
    t0 = time.monotonic()
    with pytest.raises(errors.BadRequest, match="FIFO"):
        box.fs.read("/work/fifo")
    assert time.monotonic() - t0 < 1
    # writing over a FIFO replaces it, never opens it
    box.fs.write("/work/fifo", b"data")
    assert (box.root / "work/fifo").read_bytes() == b"data"


@pytest.mark.timeout(10)
def test_e32_device_nodes_refused(box: Box) -> None:
    os.mknod(box.root / "work/zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    os.mknod(box.root / "work/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for name in ("zero", "null"):
        with pytest.raises(errors.BadRequest, match="device"):
            box.fs.read(f"/work/{name}")
    assert box.fs.stat("/work/zero").type == "other"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(box.root / "work/sock"))
        with pytest.raises(errors.BadRequest, match="socket"):
            box.fs.read("/work/sock")
    finally:
        s.close()


@pytest.mark.timeout(10)
def test_e32_huge_sparse_file_refused_quickly(box: Box) -> None:
    with open(box.root / "work/huge", "wb") as f:
        f.truncate(10 << 30)
    t0 = time.monotonic()
    with pytest.raises(errors.PayloadTooLarge):
        box.fs.read("/work/huge")
    assert time.monotonic() - t0 < 1


@pytest.mark.timeout(30)
async def test_e32_download_tree_with_loops_fifos_devices(box: Box) -> None:
    w = box.root / "work"
    (w / "d").mkdir()
    os.symlink("b", w / "d/a")
    os.symlink("a", w / "d/b")
    os.symlink(".", w / "d/self")
    os.symlink("..", w / "d/up")
    os.symlink("/", w / "d/root")
    os.mkfifo(w / "d/fifo")
    os.mknod(w / "d/zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    (w / "d/f").write_bytes(b"content")
    blob = await download(box.fs, "/work")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        members = {m.name: m for m in tf}
        assert set(members) == {"d", "d/a", "d/b", "d/self", "d/up", "d/root", "d/f"}
        assert members["d/self"].issym() and members["d/self"].linkname == "."
        f = tf.extractfile(members["d/f"])
        assert f is not None and f.read() == b"content"


@pytest.mark.timeout(30)
async def test_e32_upload_bombs_capped(box: Box) -> None:
    fs = SandboxFS(box.root, SHIFT, max_upload=1 << 20, max_entries=100)
    try:
        # gzip bomb: 64 MiB of zeros compress to ~64 KiB
        ti = tarfile.TarInfo("bomb")
        ti.size = 64 << 20
        raw = ti.tobuf(format=tarfile.PAX_FORMAT) + bytes(64 << 20) + bytes(1024)
        with pytest.raises(errors.PayloadTooLarge):
            await fs.upload_tar("/work/up", once(gzip.compress(raw, compresslevel=1)))
        # entry-count bomb
        data = make_tar([(member(f"e{i}"), b"") for i in range(101)])
        with pytest.raises(errors.PayloadTooLarge):
            await fs.upload_tar("/work/up2", once(data))
        # device nodes and FIFOs in a tar are skipped, never created
        data = make_tar([(member("dev", tarfile.CHRTYPE), None),
                         (member("blk", tarfile.BLKTYPE), None),
                         (member("fifo", tarfile.FIFOTYPE), None)])
        assert await fs.upload_tar("/work/up3", once(data)) == 0
        assert os.listdir(box.root / "work/up3") == []
    finally:
        fs.close()


async def test_e32_concurrent_ops_are_thread_safe(box: Box) -> None:
    async def worker(i: int) -> None:
        for j in range(20):
            await box.fs.awrite(f"/work/c{i}/f{j}", f"{i}-{j}".encode())
            assert await box.fs.aread(f"/work/c{i}/f{j}") == f"{i}-{j}".encode()
    await asyncio.gather(*(worker(i) for i in range(8)))
    assert len(os.listdir(box.root / "work")) == 8
