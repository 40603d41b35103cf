"""ImageStore: content addressing, refs, name validation, gc (real mkfs.erofs, tmp store)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rollbox.errors import BadRequest, NotFound
from rollbox.images.store import Image, ImageStore, validate_name

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep root ownership")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def make_tree(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def extract(store: ImageStore, digest: str, dest: Path) -> Path:
    subprocess.run(["fsck.erofs", f"--extract={dest}", str(store.layer_path(digest))],
                   check=True, capture_output=True)
    return dest


def test_add_layer_is_content_addressed_and_idempotent(store: ImageStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"etc/hello": "hi\n", "usr/bin/tool": "#!/bin/sh\n"})
    os.utime(src / "etc/hello", (1_600_000_000, 1_600_000_000))
    d1 = store.add_layer_from_dir(src, source="test")
    d2 = store.add_layer_from_dir(src, source="test again")
    assert d1 == d2 and d1.startswith("sha256-") and len(d1) == 7 + 64
    assert store.list_layers() == [d1]
    meta = json.loads((store.layers_dir / f"{d1}.json").read_text())
    assert meta["source"] == "test" and meta["size"] == store.layer_path(d1).stat().st_size
    assert meta["files"] == 5  # etc, etc/hello, usr, usr/bin, usr/bin/tool
    assert list(store.tmp_dir.iterdir()) == []  # no staging left behind
    out = extract(store, d1, tmp_path / "out")
    assert (out / "etc/hello").read_text() == "hi\n"
    assert (out / "etc/hello").stat().st_mtime == 1_600_000_000  # mtimes survive
    (src / "etc/hello").write_text("changed\n")
    assert store.add_layer_from_dir(src, source="test") != d1


def test_add_layer_file_validates_and_dedups(store: ImageStore, tmp_path: Path) -> None:
    digest = store.add_layer_from_dir(make_tree(tmp_path / "s", {"a": "1"}), source="t")
    copy = tmp_path / "copy.erofs"
    copy.write_bytes(store.layer_path(digest).read_bytes())
    assert store.add_layer_file(copy) == digest
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(BadRequest, match="not an EROFS image"):
        store.add_layer_file(junk)
    assert store.list_layers() == [digest]


def test_tag_resolve_list_remove(store: ImageStore, tmp_path: Path) -> None:
    base = store.add_layer_from_dir(make_tree(tmp_path / "b", {"base": "b"}), source="b")
    top = store.add_layer_from_dir(make_tree(tmp_path / "t", {"top": "t"}), source="t")
    image = store.tag("team/python:3.11", [base, top], {"env": {"X": "1"}, "cwd": "/work"})
    assert isinstance(image, Image)
    got = store.resolve("team/python:3.11")
    assert got.layers == [base, top] and got.config["cwd"] == "/work"
    assert got.config["user"] == "root" and got.config["env"] == {"X": "1"}
    store.tag("plain", [base])
    store.tag("tool:latest", [top])
    assert store.resolve("tool").layers == [top]  # bare name falls back to :latest
    assert [i.name for i in store.list()] == ["plain", "team/python:3.11", "tool:latest"]
    by_digest = store.resolve(top)
    assert by_digest.layers == [top] and by_digest.name == top
    store.remove("plain")
    with pytest.raises(NotFound, match="'plain' not found"):
        store.resolve("plain")
    with pytest.raises(NotFound):
        store.remove("plain")
    info = store.inspect("team/python:3.11")
    assert info["size"] == sum(store.layer_path(d).stat().st_size for d in (base, top))
    assert [m["source"] for m in info["layer_details"]] == ["b", "t"]


def test_tag_refuses_unknown_layers_and_bad_config(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        store.tag("x", ["sha256-" + "0" * 64])
    with pytest.raises(BadRequest):
        store.tag("x", ["not-a-digest"])
    with pytest.raises(BadRequest):
        store.tag("x", [])
    d = store.add_layer_from_dir(make_tree(tmp_path / "s", {"a": "1"}), source="t")
    with pytest.raises(BadRequest, match="cwd"):
        store.tag("x", [d], {"cwd": "relative"})
    assert store.list() == []


@pytest.mark.parametrize("name", ["busybox:test", "debian:bookworm", "a", "ghcr.io/org/img:v1.2-rc_3",
                                  "x/y/z", "python:3.11"])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "Upper", "-dash", ".hidden", "/abs", "a:b:c", "a:", "a b",
                                  "a/../b:1" + "x" * 200, "x" * 201, "a//b", "a/", "ns/:tag",
                                  "a:t@g", "img\n", "a/../b", "a/./b"])
def test_invalid_names(store: ImageStore, name: str) -> None:
    with pytest.raises(BadRequest):
        validate_name(name)
    with pytest.raises(BadRequest):
        store.resolve(name)


def test_ref_names_cannot_collide_or_escape(store: ImageStore, tmp_path: Path) -> None:
    d = store.add_layer_from_dir(make_tree(tmp_path / "s", {"a": "1"}), source="t")
    store.tag("a/b", [d])
    store.tag("a_b", [d])
    with pytest.raises(BadRequest):
        store.tag("../..", [d])
    assert sorted(p.name for p in store.refs_dir.iterdir()) == ["a%2Fb.json", "a_b.json"]


def test_gc_removes_only_unreferenced_layers(store: ImageStore, tmp_path: Path) -> None:
    keep = store.add_layer_from_dir(make_tree(tmp_path / "k", {"k": "1"}), source="k")
    drop = store.add_layer_from_dir(make_tree(tmp_path / "d", {"d": "1"}), source="d")
    store.tag("keep", [keep])
    store.tag("drop", [drop])
    assert store.gc(grace_seconds=0) == []
    store.remove("drop")
    assert store.gc(grace_seconds=3600) == []  # too young: may be about to be tagged
    assert store.gc(grace_seconds=0) == [drop]
    assert store.list_layers() == [keep]
    assert not (store.layers_dir / f"{drop}.json").exists()
    # staging of a dead builder is reclaimed, a live one's is not
    dead = store.tmp_dir / "import-999999999-x"
    dead.mkdir()
    live = store.staging_dir("import")
    store.gc(grace_seconds=0)
    assert not dead.exists() and live.exists()


def test_concurrent_readers_never_see_partial_refs(store: ImageStore, tmp_path: Path) -> None:
    d = store.add_layer_from_dir(make_tree(tmp_path / "s", {"a": "1"}), source="t")
    store.tag("img", [d])
    deadline = time.monotonic() + 0.5
    import threading

    errors: list[BaseException] = []

    def reader() -> None:
        while time.monotonic() < deadline:
            try:
                assert store.resolve("img").layers == [d]
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    while time.monotonic() < deadline:
        store.tag("img", [d], {"env": {"N": str(time.monotonic())}})
    for t in threads:
        t.join()
    assert errors == []
