"""Layer builders without mounts: tar extraction, whiteouts, traversal guards, merging, uppers."""
from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from rollbox.errors import BadRequest
from rollbox.images.overlay import (
    OPAQUE_XATTR,
    is_opaque,
    is_whiteout,
    make_whiteout,
    merge_layer_dir,
    set_opaque,
    strip_overlay_markers,
)
from rollbox.images.scrub import dropped_bytecode
from rollbox.images.snapshot import layer_from_upper
from rollbox.images.sources import (
    build_busybox_image,
    build_from_directory,
    busybox_image_current,
    default_mirror,
    extract_layer_tar,
)
from rollbox.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, trusted xattrs)")


def tar_bytes(entries: list[tuple], gz: bool = False) -> io.BytesIO:
    """entries: (name, kind, payload) with kind in file|dir|sym|link|chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "file":
                data = payload.encode() if isinstance(payload, str) else payload
                info.size = len(data)
                info.mode = 0o644
                tf.addfile(info, io.BytesIO(data))
                continue
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            tf.addfile(info)
    buf.seek(0)
    return buf


def test_extract_converts_oci_whiteouts(tmp_path: Path) -> None:
    dest = tmp_path / "l"
    dest.mkdir()
    size = extract_layer_tar(tar_bytes([
        ("etc/", "dir", None),
        ("etc/keep", "file", "k"),
        ("etc/.wh.gone", "file", ""),
        ("opq/", "dir", None),
        ("opq/new", "file", "n"),
        ("opq/.wh..wh..opq", "file", ""),
        ("usr/bin/tool", "file", "#!"),
        ("usr/bin/alias", "link", "usr/bin/tool"),
        ("usr/bin/sl", "sym", "/etc/keep"),
        ("dev/null", "chr", None),
    ], gz=True), dest)
    assert size == 1 + 1 + 2
    assert (dest / "etc/keep").read_text() == "k"
    assert is_whiteout(os.lstat(dest / "etc/gone"))
    assert not (dest / "etc/.wh.gone").exists()
    assert is_opaque(dest / "opq") and (dest / "opq/new").read_text() == "n"
    assert not os.path.lexists(dest / "opq/.wh..wh..opq")
    assert os.stat(dest / "usr/bin/alias").st_ino == os.stat(dest / "usr/bin/tool").st_ino
    assert os.readlink(dest / "usr/bin/sl") == "/etc/keep"
    assert not os.path.lexists(dest / "dev/null")  # device nodes are not image content
    assert os.lstat(dest / "etc/keep").st_mtime == 1_700_000_000
    assert os.lstat(dest / "etc").st_mtime == 1_700_000_000


@pytest.mark.parametrize("entries,match", [
    ([("/etc/passwd", "file", "x")], "absolute"),
    ([("a/../../escape", "file", "x")], r"'\.\.'"),
    ([("../escape", "file", "x")], r"'\.\.'"),
    ([("lnk", "sym", "/"), ("lnk/etc/passwd", "file", "x")], "through symlink"),
    ([("d", "sym", "../.."), ("d/.wh.x", "file", "")], "through symlink"),
    ([("h", "link", "/etc/shadow")], "absolute"),
    ([("h", "link", "../../etc/shadow")], r"'\.\.'"),
    ([("s", "sym", "/etc"), ("h", "link", "s/shadow")], "through symlink"),
    ([("h", "link", "missing")], "target missing"),
])
def test_extract_refuses_traversal(tmp_path: Path, entries: list[tuple], match: str) -> None:
    dest = tmp_path / "l"
    dest.mkdir()
    outside = tmp_path / "outside"
    with pytest.raises(BadRequest, match=match):
        extract_layer_tar(tar_bytes(entries), dest)
    assert not outside.exists()
    assert not (tmp_path / "escape").exists()


def test_extract_refuses_non_tar(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="not a"):
        extract_layer_tar(io.BytesIO(b"\x28\xb5\x2f\xfd" + b"zstd?" * 100), tmp_path)


def test_merge_applies_whiteouts_between_layers(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for d in ("lower/a", "lower/dir/sub", "lower/o", "upper/o", "upper/dir"):
        (tmp_path / d).mkdir(parents=True)
    (lower / "a/del").write_text("old")
    (lower / "a/stay").write_text("s")
    (lower / "dir/sub/f").write_text("f")
    (lower / "o/old").write_text("o")
    (lower / "file2dir").write_text("was a file")
    (lower / "wh").mkdir()
    make_whiteout(lower / "hidden_below")  # hides something in a layer under the group
    (upper / "a").mkdir()
    make_whiteout(upper / "a/del")
    (upper / "dir/new").write_text("n")
    set_opaque(upper / "o")
    (upper / "o/fresh").write_text("x")
    (upper / "file2dir").mkdir()
    (upper / "hidden_below").mkdir()
    merge_layer_dir(lower, upper, keep_whiteouts=True)
    assert is_whiteout(os.lstat(lower / "a/del"))  # still hides the file in lower groups
    assert (lower / "a/stay").read_text() == "s"
    assert (lower / "dir/sub/f").exists() and (lower / "dir/new").read_text() == "n"
    assert sorted(os.listdir(lower / "o")) == ["fresh"] and is_opaque(lower / "o")
    assert is_opaque(lower / "file2dir") and is_opaque(lower / "hidden_below")
    assert not is_opaque(lower / "dir")


def test_merge_bottom_group_drops_markers(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "a").mkdir(parents=True)
    (lower / "a/del").write_text("old")
    (upper / "a").mkdir(parents=True)
    make_whiteout(upper / "a/del")
    (upper / "o").mkdir()
    set_opaque(upper / "o")
    merge_layer_dir(lower, upper, keep_whiteouts=False)
    strip_overlay_markers(lower)
    assert not os.path.lexists(lower / "a/del")
    assert not is_opaque(lower / "o")


def test_layer_from_upper_scrubs(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    up = tmp_path / "upper"
    for d in ("var/cache/apt/archives", "var/lib/apt/lists", "app/__pycache__", "root/.cache",
              "tmp", "app/data", "secret", "opq"):
        (up / d).mkdir(parents=True)
    (up / "var/cache/apt/archives/x.deb").write_text("deb")
    (up / "var/cache/apt/archives/lock").write_text("")
    (up / "var/lib/apt/lists/index").write_text("i")
    (up / "app/__pycache__/m.pyc").write_text("c")
    (up / "app/main.py").write_text("print(1)")
    (up / "root/.cache/pip").write_text("p")
    (up / "tmp/junk").write_text("j")
    (up / "secret/key").write_text("k")
    (up / "app/data/big").write_text("b")
    os.link(up / "app/main.py", up / "app/main_link.py")
    make_whiteout(up / "tmp/deleted_from_base")
    make_whiteout(up / "gone")
    os.setxattr(up / "app/main.py", "trusted.overlay.origin", b"\x00fh")
    os.setxattr(up / "app", "trusted.overlay.impure", b"y")
    os.setxattr(up / "app/main.py", "user.keep", b"1")
    set_opaque(up / "opq")
    os.chown(up / "app/main.py", 1_000_000_000, 1_000_000_000)
    digest = layer_from_upper(store, up, exclude=["/secret", "big"], source="upper:test",
                              id_shift=1_000_000_000)
    out = tmp_path / "out"
    subprocess.run(["fsck.erofs", f"--extract={out}", str(store.layer_path(digest))],
                   check=True, capture_output=True)
    present = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert present == sorted([
        "app", "app/data", "app/main.py", "app/main_link.py", "gone", "opq", "root", "tmp",
        "tmp/deleted_from_base", "var", "var/cache", "var/cache/apt", "var/cache/apt/archives",
        "var/cache/apt/archives/lock", "var/lib", "var/lib/apt", "var/lib/apt/lists"])
    assert stat.S_ISCHR(os.lstat(out / "gone").st_mode)  # whiteouts survive
    assert stat.S_ISCHR(os.lstat(out / "tmp/deleted_from_base").st_mode)
    main = os.lstat(out / "app/main.py")
    assert (main.st_uid, main.st_gid) == (0, 0)  # hard links: checked under a mount
    # the upper itself is untouched (it may belong to a live sandbox)
    assert (up / "var/cache/apt/archives/x.deb").exists()
    assert os.getxattr(up / "app/main.py", "trusted.overlay.origin") == b"\x00fh"
    assert list(store.tmp_dir.iterdir()) == []


def _bytecode_tree(root: Path) -> Path:
    for d in ("usr/lib/python3/dist-packages/pytest/__pycache__", "usr/lib/python3.11/__pycache__",
              "usr/local/lib/python3.11/dist-packages/pkg/__pycache__", "work/repo/tests/__pycache__",
              "opt/venv/lib/python3.11/site-packages/x/__pycache__"):
        (root / d).mkdir(parents=True)
        (root / d / "m.cpython-311.pyc").write_bytes(b"bytecode")
    (root / "usr/lib/python3/dist-packages/pytest/__pycache__/conftest.cpython-311-pytest-7.2.1.pyc"
     ).write_bytes(b"rewritten by pytest")
    (root / "work/repo/tests/test_hidden.py").write_text("def test(): pass\n")
    return root


KEPT_BYTECODE = ["usr/lib/python3.11/__pycache__/m.cpython-311.pyc",
                 "usr/lib/python3/dist-packages/pytest/__pycache__/m.cpython-311.pyc",
                 "usr/local/lib/python3.11/dist-packages/pkg/__pycache__/m.cpython-311.pyc"]


def _layer_files(store: ImageStore, digest: str, out: Path) -> list[str]:
    subprocess.run(["fsck.erofs", f"--extract={out}", str(store.layer_path(digest))],
                   check=True, capture_output=True)
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_builder_layers_keep_only_library_bytecode(tmp_path: Path) -> None:
    """Layers of the image builder (--run uppers, --from-dir) keep the standard library's and
    installed packages' __pycache__; bytecode of a workspace or tests (which sandboxes may hide)
    and pytest's rewritten modules are dropped."""
    store = ImageStore(tmp_path / "images")
    up = _bytecode_tree(tmp_path / "upper")
    want = sorted(KEPT_BYTECODE + ["work/repo/tests/test_hidden.py"])
    digest = layer_from_upper(store, up, source="upper:test")
    assert _layer_files(store, digest, tmp_path / "out1") == want
    src = _bytecode_tree(tmp_path / "dir")
    image = build_from_directory(store, src, "t/dir:1")
    assert _layer_files(store, image.layers[0], tmp_path / "out2") == want
    assert (src / "work/repo/tests/__pycache__").is_dir()  # the source is never changed
    # The layer's entry count leaves the dropped bytecode out too.
    assert store.layer_meta(image.layers[0])["files"] == len(
        [p for p in (tmp_path / "out2").rglob("*")])
    # An untrusted tree (uploads) drops every __pycache__.
    assert sorted(dropped_bytecode(src, keep_library=False)) == sorted(
        str(p.relative_to(src)) for p in src.rglob("__pycache__"))


def test_layer_from_upper_refuses_redirect_dirs(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    up = tmp_path / "upper"
    (up / "moved").mkdir(parents=True)
    os.setxattr(up / "moved", "trusted.overlay.redirect", b"/orig")
    with pytest.raises(BadRequest, match="redirect"):
        layer_from_upper(store, up, source="t")
    assert store.list_layers() == [] and list(store.tmp_dir.iterdir()) == []


def test_busybox_image_is_reproducible(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    a = build_busybox_image(store)
    b = build_busybox_image(store, "busybox:again")
    assert a.layers == b.layers
    out = tmp_path / "out"
    subprocess.run(["fsck.erofs", f"--extract={out}", str(store.layer_path(a.layers[0]))],
                   check=True, capture_output=True)
    assert os.readlink(out / "bin/sh") == "busybox"
    # every applet is linked: a command string runs under bash, which finds only those
    assert all(os.readlink(out / "bin" / a) == "busybox" for a in ("chmod", "grep", "mv"))
    assert busybox_image_current(store) and not busybox_image_current(store, "busybox:none")
    assert "nobody:x:65534" in (out / "etc/passwd").read_text()
    assert {"tmp", "proc", "dev", "sys", "root"} <= set(os.listdir(out))


def test_default_mirror_is_an_http_archive() -> None:
    mirror = default_mirror("bookworm")
    assert mirror.startswith(("http://", "https://")) and "security" not in mirror


def test_opaque_xattr_name() -> None:
    assert OPAQUE_XATTR == "trusted.overlay.opaque"
