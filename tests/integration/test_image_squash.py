"""`squash`: a stack of layers (with whiteouts and opaque dirs) collapsed into one layer shows
the same tree under overlayfs as the original stack."""
from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollbox.errors import BadRequest
from rollbox.image_cli import app
from rollbox.images.overlay import make_whiteout, set_opaque
from rollbox.images.mounts import LayerMounts
from rollbox.images.squash import squash_image
from rollbox.images.store import ImageStore
from rollbox.isolation import syscalls
from tests.conftest import private_image_store

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ImageStore]:
    with private_image_store(tmp_path) as s:
        yield s
        assert not any(s.tmp_dir.iterdir()), "squash left staging behind"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def overlay_view(store: ImageStore, tmp_path: Path, layers: list[str]) -> dict[str, tuple]:
    """Everything a sandbox would see over ``layers``: path -> (type, mode, uid, content)."""
    mounts = LayerMounts(store)
    target = tmp_path / f"ovl{len(list(tmp_path.glob('ovl*')))}"
    target.mkdir()
    empty = tmp_path / f"{target.name}-empty"
    empty.mkdir()
    lowers = ":".join([str(mounts.ensure_mounted(d)) for d in reversed(layers)] + [str(empty)])
    syscalls.mount("overlay", target, "overlay", syscalls.MS_RDONLY, f"lowerdir={lowers}")
    view: dict[str, tuple] = {}
    try:
        for dirpath, dirnames, filenames in os.walk(target):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode):
                    body = hashlib.sha256(Path(p).read_bytes()).hexdigest()
                elif stat.S_ISLNK(st.st_mode):
                    body = os.readlink(p)
                else:
                    body = ""
                view[os.path.relpath(p, target)] = (stat.S_IFMT(st.st_mode),
                                                    stat.S_IMODE(st.st_mode), st.st_uid, body)
    finally:
        syscalls.umount(target, syscalls.MNT_DETACH)
    return view


def three_layers(store: ImageStore, tmp_path: Path) -> list[str]:
    base = store.add_layer_from_dir(tree(tmp_path / "l0", {
        "etc/deleted": "d", "etc/kept": "k", "opt/old/a": "a", "opt/old/b": "b",
        "srv/replaced": "file", "usr/bin/tool": "v1"}), source="l0")
    mid_src = tree(tmp_path / "l1", {"etc/added": "new", "opt/old/c": "c", "srv/replaced/x": "x",
                                     "home/u/notes": "n1"})
    make_whiteout(mid_src / "etc/deleted")
    set_opaque(mid_src / "opt/old")
    os.chmod(mid_src / "home/u/notes", 0o600)
    os.chown(mid_src / "home/u/notes", 1000, 1000)
    mid = store.add_layer_from_dir(mid_src, source="l1")
    top_src = tree(tmp_path / "l2", {"usr/bin/tool": "v2", "etc/deleted": "back again",
                                     "home/u/more": "m"})
    make_whiteout(top_src / "etc/added")  # deletes a file of the layer below
    os.symlink("tool", top_src / "usr/bin/alias")
    top = store.add_layer_from_dir(top_src, source="l2")
    return [base, mid, top]


@pytest.mark.parametrize("start", [0, 1])
def test_squash_preserves_the_overlay_view(store: ImageStore, tmp_path: Path,
                                           start: int) -> None:
    layers = three_layers(store, tmp_path)
    store.tag("app:1", layers, {"env": {"A": "1"}})
    before = overlay_view(store, tmp_path, layers)
    assert "etc/added" not in before and "etc/deleted" in before and "opt/old/a" not in before
    squashed = squash_image(store, "app:1", start=start, tag="app:squashed")
    assert squashed.layers[:start] == layers[:start] and len(squashed.layers) == start + 1
    assert squashed.config["env"]["A"] == "1"
    assert store.resolve("app:1").layers == layers  # the original ref is untouched
    after = overlay_view(store, tmp_path, squashed.layers)
    assert after == before
    if start == 0:  # a bottom layer keeps no markers: nothing below to hide
        mnt = LayerMounts(store).ensure_mounted(squashed.layers[0])
        for dirpath, _dirs, files in os.walk(mnt):
            for f in files:
                st = os.lstat(os.path.join(dirpath, f))
                assert not (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0)


def test_squash_default_picks_trailing_small_layers_and_cli(store: ImageStore,
                                                            tmp_path: Path) -> None:
    layers = three_layers(store, tmp_path)
    store.tag("app:1", layers)
    before = overlay_view(store, tmp_path, layers)
    result = CliRunner().invoke(app, ["--root", str(store.root), "squash", "app:1"])
    assert result.exit_code == 0, result.output
    image = store.resolve("app:1")
    assert len(image.layers) == 1  # all three are small: squashed from 0
    assert image.layers[0] in result.output
    assert overlay_view(store, tmp_path, image.layers) == before
    # one layer left: nothing to squash
    with pytest.raises(BadRequest):
        squash_image(store, "app:1")
    result = CliRunner().invoke(app, ["--root", str(store.root), "squash", "app:1", "--from", "5"])
    assert result.exit_code == 2


def test_build_over_a_base_adds_one_layer_and_reuses_the_base(tmp_path: Path,
                                                              tmp_node_dir: Path) -> None:
    """Item 4: a workspace/toolkit layer built over a base is the only new layer; a second
    version of it shares the base layers by digest; squash then folds the two tops."""
    import asyncio

    from rollbox.config import Settings
    from rollbox.backends.container.build import build_layer_with_commands
    from tests.conftest import have_image, node_settings

    if not Path(node_settings(tmp_node_dir).agent_binary).exists():
        pytest.skip("agent binary not built (make agent)")
    if not have_image("debian:bookworm"):
        pytest.skip("debian:bookworm not built (make images)")
    # under tmp_node_dir (0711): the sandbox's unprivileged host uid must reach the layers
    store = ImageStore(tmp_node_dir / "images")
    node = ImageStore(Settings().images_dir)
    deb = node.resolve("debian:bookworm")
    store.tag("bb:1", [store.add_layer_file(node.layer_path(d)) for d in deb.layers], deb.config)
    base = store.resolve("bb:1")
    settings = node_settings(tmp_node_dir)
    settings.images_root = store.root
    base_file = store.layer_path(base.layers[0])
    ino = base_file.stat().st_ino
    try:
        for version, text in ((1, "one"), (2, "two")):
            asyncio.run(build_layer_with_commands(
                store, "bb:1", [f"mkdir -p /root/ws && echo {text} > /root/ws/v"], f"ws:{version}",
                settings=settings, network="none", log=lambda _m: None))
        v1, v2 = store.resolve("ws:1"), store.resolve("ws:2")
        assert v1.layers[:-1] == v2.layers[:-1] == base.layers
        assert v1.layers[-1] != v2.layers[-1]
        assert base_file.stat().st_ino == ino  # the base layer file was not rewritten
        asyncio.run(build_layer_with_commands(
            store, "ws:2", ["echo tool > /root/ws/tool"], "ws:3", settings=settings,
            network="none", log=lambda _m: None))
        v3 = store.resolve("ws:3")
        assert v3.layers[:-1] == v2.layers and len(v3.layers) == 3
        before = overlay_view(store, tmp_path, v3.layers)
        squashed = squash_image(store, "ws:3", start=1, tag="ws:3s")
        assert squashed.layers[0] == base.layers[0] and len(squashed.layers) == 2
        after = overlay_view(store, tmp_path, squashed.layers)
        assert after == before and "root/ws/tool" in after and "root/ws/v" in after
    finally:
        LayerMounts(store).unmount_all()
