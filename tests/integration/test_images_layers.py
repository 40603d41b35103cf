"""Layers under real mounts: shared EROFS mounts, overlayfs stacking, OCI imports, uppers."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.errors import BadRequest, InfraError, NotFound
from rollbox.images import sources as builders
from rollbox.images.sources import oci
from rollbox.images.overlay import make_whiteout, set_opaque
from rollbox.images.snapshot import layer_from_upper
from rollbox.images.mounts import LayerMounts
from rollbox.images.store import ImageStore
from rollbox.isolation import syscalls
from rollbox.isolation.syscalls import read_mountinfo
from tests.conftest import private_image_store

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ImageStore]:
    with private_image_store(tmp_path) as s:
        yield s


@pytest.fixture
def mounts(store: ImageStore) -> LayerMounts:
    return LayerMounts(store)


def overlay(tmp_path: Path, mounts: LayerMounts, layers: list[str]) -> Path:
    """Read-only overlay of the layers (lowest first), as the container backend stacks them."""
    target = tmp_path / f"ovl{len(list(tmp_path.glob('ovl*')))}"
    target.mkdir()
    empty = tmp_path / f"{target.name}-empty"  # overlay without upper needs two lowers
    empty.mkdir()
    lowers = ":".join([str(mounts.ensure_mounted(d)) for d in reversed(layers)] + [str(empty)])
    syscalls.mount("overlay", target, "overlay", syscalls.MS_RDONLY, f"lowerdir={lowers}")
    return target


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# ---- shared layer mounts -------------------------------------------------------------------

def test_mount_once_and_find_it_after_restart(store: ImageStore, mounts: LayerMounts,
                                              tmp_path: Path) -> None:
    digest = store.add_layer_from_dir(tree(tmp_path / "s", {"etc/os": "x\n"}), source="t")
    path = mounts.ensure_mounted(digest)
    assert path == store.mnt_dir / digest and (path / "etc/os").read_text() == "x\n"
    with pytest.raises(OSError):
        (path / "new").write_text("read-only")
    fresh = LayerMounts(store)  # a restarted process: state comes from mountinfo
    assert fresh.is_mounted(digest) and fresh.ensure_mounted(digest) == path
    entries = [(m, t) for m, t, _ in read_mountinfo() if m == str(path)]
    assert entries == [(str(path), "erofs")]
    opts = next(line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if f" {path} " in line)
    assert "ro," in opts and "nosuid" in opts and "nodev" in opts
    assert fresh.mounted() == {digest: path}
    mounts.unmount(digest)
    assert not mounts.is_mounted(digest) and not path.exists()
    mounts.unmount(digest)  # idempotent
    with pytest.raises(NotFound):
        mounts.ensure_mounted("sha256-" + "1" * 64)


def test_concurrent_ensure_mounted_mounts_once(store: ImageStore, mounts: LayerMounts,
                                               tmp_path: Path) -> None:
    digest = store.add_layer_from_dir(tree(tmp_path / "s", {"f": "1"}), source="t")
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(LayerMounts(store).ensure_mounted(digest))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    async def many() -> list[Path]:
        return await asyncio.gather(*(mounts.ensure_mounted_async(digest) for _ in range(8)))

    results += asyncio.run(many())
    assert errors == [] and set(results) == {store.mnt_dir / digest}
    assert sum(1 for m, _, _ in read_mountinfo() if m == str(store.mnt_dir / digest)) == 1


def test_busy_layer_is_not_unmounted_or_collected(store: ImageStore, mounts: LayerMounts,
                                                  tmp_path: Path) -> None:
    digest = store.add_layer_from_dir(tree(tmp_path / "s", {"f": "1"}), source="t")
    merged = overlay(tmp_path, mounts, [digest])
    with pytest.raises(InfraError, match="in use"):
        mounts.unmount(digest)
    assert store.gc(grace_seconds=0) == []  # unreferenced but a sandbox uses it
    assert store.has_layer(digest)
    syscalls.umount(merged)
    assert store.gc(grace_seconds=0, keep=[digest]) == []  # the edge knows better
    assert store.gc(grace_seconds=0) == [digest]
    assert not mounts.is_mounted(digest) and not store.has_layer(digest)


def test_layer_is_not_unmounted_while_a_rootfs_is_composed(store: ImageStore,
                                                            mounts: LayerMounts,
                                                            tmp_path: Path) -> None:
    """Between ensure_mounted and the clone nothing marks a layer as used: another process of
    the node (an idle edge, a test sweep) must not unmount it then."""
    digest = store.add_layer_from_dir(tree(tmp_path / "s", {"f": "1"}), source="t")
    other = LayerMounts(store)  # another edge of the node
    with mounts.in_use():
        mounts.ensure_mounted(digest)
        with pytest.raises(InfraError, match="in use"):
            other.unmount(digest)
        assert other.unmount_all() == [digest]
        assert (mounts.ensure_mounted(digest) / "f").read_text() == "1"
    other.unmount(digest)  # free once the composition is over
    assert not mounts.is_mounted(digest)


# ---- overlay stacking ----------------------------------------------------------------------

def test_overlay_whiteout_and_opaque_dir_hide_lower_files(store: ImageStore, mounts: LayerMounts,
                                                          tmp_path: Path) -> None:
    base = store.add_layer_from_dir(tree(tmp_path / "base", {
        "etc/deleted": "d", "etc/kept": "k", "opt/old/a": "a", "opt/old/b": "b"}), source="b")
    top_src = tree(tmp_path / "top", {"etc/added": "new", "opt/old/c": "c"})
    make_whiteout(top_src / "etc/deleted")
    set_opaque(top_src / "opt/old")
    top = store.add_layer_from_dir(top_src, source="t")
    merged = overlay(tmp_path, mounts, [base, top])
    assert sorted(os.listdir(merged / "etc")) == ["added", "kept"]
    assert not os.path.lexists(merged / "etc/deleted")
    assert sorted(os.listdir(merged / "opt/old")) == ["c"]
    # the layer itself really holds the markers mkfs.erofs kept
    st = os.lstat(mounts.mount_point(top) / "etc/deleted")
    assert st.st_rdev == 0 and (st.st_mode & 0o170000) == 0o020000
    assert os.getxattr(mounts.mount_point(top) / "opt/old", "trusted.overlay.opaque") == b"y"


def test_layer_from_upper_round_trip(store: ImageStore, mounts: LayerMounts,
                                     tmp_path: Path) -> None:
    base = store.add_layer_from_dir(tree(tmp_path / "base", {
        "app/x.py": "old", "app/rm.txt": "rm", "cfg/a": "a"}), source="b")
    up = tree(tmp_path / "upper", {"app/x.py": "new", "app/__pycache__/x.pyc": "c",
                                   "cfg/b": "b"})
    os.link(up / "app/x.py", up / "app/y.py")
    make_whiteout(up / "app/rm.txt")
    set_opaque(up / "cfg")
    os.setxattr(up / "app/x.py", "trusted.overlay.origin", b"fh")
    diff = layer_from_upper(store, up, source="sandbox:test")
    merged = overlay(tmp_path, mounts, [base, diff])
    assert sorted(os.listdir(merged / "app")) == ["x.py", "y.py"]
    assert (merged / "app/x.py").read_text() == "new"
    assert os.listdir(merged / "cfg") == ["b"]
    layer_root = mounts.mount_point(diff)
    assert os.stat(layer_root / "app/x.py").st_nlink == 2
    assert os.listxattr(layer_root / "app/x.py") == []
    assert os.getxattr(layer_root / "cfg", "trusted.overlay.opaque") == b"y"


# ---- OCI / docker archives -----------------------------------------------------------------

def layer_tar(entries: dict[str, str | None], gz: bool = False) -> bytes:
    """A layer tar; a value of None makes a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, text in entries.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if text is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            else:
                data = text.encode()
                info.size, info.mode = len(data), 0o644
                tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if gz else raw


LAYERS: list[dict[str, str | None]] = [
    {"etc/": None, "etc/os-release": "base", "etc/gone": "x", "srv/": None, "srv/old": "o",
     "bin/tool": "v1"},
    {"etc/.wh.gone": "", "srv/.wh..wh..opq": "", "srv/new": "n", "bin/tool": "v2"},
    {"app/main.py": "print(1)", "etc/.wh.os-release": ""},
]
CONFIG = {"config": {"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "WorkingDir": "/app",
                     "User": "1000", "Cmd": ["python", "main.py"]}, "rootfs": {}}


def add_file(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def docker_save_tarball(path: Path) -> Path:
    with tarfile.open(path, "w") as tf:
        names = []
        for i, layer in enumerate(LAYERS):
            names.append(f"{i:064x}/layer.tar")
            add_file(tf, names[-1], layer_tar(layer))
        add_file(tf, "cfg.json", json.dumps(CONFIG).encode())
        add_file(tf, "manifest.json", json.dumps(
            [{"Config": "cfg.json", "RepoTags": ["x:1"], "Layers": names}]).encode())
    return path


def oci_archive(path: Path) -> Path:
    def blob(tf: tarfile.TarFile, data: bytes) -> str:
        hexd = hashlib.sha256(data).hexdigest()
        add_file(tf, f"blobs/sha256/{hexd}", data)
        return f"sha256:{hexd}"

    with tarfile.open(path, "w") as tf:
        add_file(tf, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                   "digest": blob(tf, layer_tar(layer, gz=True))} for layer in LAYERS]
        cfg = blob(tf, json.dumps(CONFIG).encode())
        manifest = blob(tf, json.dumps({"schemaVersion": 2, "config": {"digest": cfg},
                                        "layers": layers}).encode())
        add_file(tf, "index.json", json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest,
             "platform": {"os": "linux", "architecture": "amd64"}}]}).encode())
    return path


def check_imported(tmp_path: Path, store: ImageStore, mounts: LayerMounts, name: str) -> None:
    image = store.resolve(name)
    merged = overlay(tmp_path, mounts, image.layers)
    assert sorted(os.listdir(merged / "etc")) == []
    assert os.listdir(merged / "srv") == ["new"]
    assert (merged / "bin/tool").read_text() == "v2"
    assert (merged / "app/main.py").read_text() == "print(1)"
    assert image.config["env"] == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    assert image.config["cwd"] == "/app" and image.config["user"] == "1000"
    assert image.config["cmd"] == ["python", "main.py"]


@pytest.mark.parametrize("make", [docker_save_tarball, oci_archive])
def test_import_merges_small_layers(store: ImageStore, mounts: LayerMounts, tmp_path: Path,
                                    make) -> None:  # type: ignore[no-untyped-def]
    builders.import_oci_archive(store, make(tmp_path / "img.tar"), "imported:1")
    assert len(store.resolve("imported:1").layers) == 1  # three small layers, one mount
    check_imported(tmp_path, store, mounts, "imported:1")
    # the bottom group has nothing to hide: no whiteouts left in it
    root = mounts.ensure_mounted(store.resolve("imported:1").layers[0])
    assert all(not os.path.lexists(root / p) for p in ("etc/gone", "etc/os-release"))


@pytest.mark.parametrize("make", [docker_save_tarball, oci_archive])
def test_import_keeps_big_layers_separate(store: ImageStore, mounts: LayerMounts,
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          make) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(oci, "SMALL_LAYER_BYTES", 4)  # every layer counts as big
    builders.import_oci_archive(store, make(tmp_path / "img.tar"), "imported:2")
    assert len(store.resolve("imported:2").layers) == 3
    check_imported(tmp_path, store, mounts, "imported:2")


def test_import_refuses_bad_archives(store: ImageStore, tmp_path: Path) -> None:
    bad = tmp_path / "evil.tar"
    with tarfile.open(bad, "w") as tf:
        add_file(tf, "l.tar", layer_tar({"../../escape": "x"}))
        add_file(tf, "manifest.json", json.dumps([{"Layers": ["l.tar"]}]).encode())
    with pytest.raises(BadRequest, match=r"'\.\.'"):
        builders.import_oci_archive(store, bad, "evil")
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w") as tf:
        add_file(tf, "hello", b"x")
    with pytest.raises(BadRequest, match="neither manifest.json"):
        builders.import_oci_archive(store, empty, "empty")
    corrupt = oci_archive(tmp_path / "corrupt.tar")
    with tarfile.open(corrupt) as tf:
        members = [(m, tf.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
                   for m in tf.getmembers()]
    with tarfile.open(corrupt, "w") as tf:
        for m, data in members:
            if m.name.startswith("blobs/") and data[:2] == b"\x1f\x8b":
                data = gzip.compress(layer_tar({"evil": "swapped"}), mtime=0)
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data))
    with pytest.raises(BadRequest, match="corrupt"):
        builders.import_oci_archive(store, corrupt, "corrupt")
    assert store.list() == [] and list(store.tmp_dir.iterdir()) == []
    assert not (tmp_path / "escape").exists()


@pytest.mark.slow
def test_debootstrap_bookworm(store: ImageStore, mounts: LayerMounts, tmp_path: Path) -> None:
    image = builders.build_debian_base(store)
    root = mounts.ensure_mounted(image.layers[0])
    assert (root / "etc/debian_version").read_text().startswith("12")
    assert os.listdir(root / "dev") == []
    assert image.config["env"]["LANG"] == "C.UTF-8"
