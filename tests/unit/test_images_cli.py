"""`rollbox image` CLI through typer's CliRunner on a temporary store."""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollbox.image_cli import app
from rollbox.images.sources import build_busybox_image
from rollbox.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep root ownership")
runner = CliRunner()


def run(root: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["--root", str(root), *args])
    return result.exit_code, result.output


def test_build_ls_inspect_rm(tmp_path: Path) -> None:
    root = tmp_path / "images"
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/hello").write_text("hi")
    code, out = run(root, "build", "--from-dir", str(src), "mine:1")
    assert code == 0, out
    digest = ImageStore(root).resolve("mine:1").layers[0]
    assert digest in out
    code, out = run(root, "ls")
    assert code == 0 and "mine:1" in out
    code, out = run(root, "inspect", "mine:1")
    assert code == 0
    data = json.loads(out)
    assert data["layers"] == [digest] and data["layer_details"][0]["files"] == 2
    code, out = run(root, "rm", "mine:1", "--gc")
    assert code == 0 and "removed mine:1" in out
    assert ImageStore(root).list() == []


def test_errors_exit_nonzero_with_message(tmp_path: Path) -> None:
    root = tmp_path / "images"
    code, out = run(root, "inspect", "missing:1")
    assert code == 2 and "not found" in out and "missing:1" in out
    code, out = run(root, "rm", "Bad Name")
    assert code == 2 and "invalid image name" in out
    code, out = run(root, "build", "x")
    assert code == 2 and "exactly one of" in out
    code, out = run(root, "build", "--from-dir", str(tmp_path / "nope"), "x")
    assert code == 2 and "not a directory" in out
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar")
    code, out = run(root, "import", str(junk), "x")
    assert code == 2 and "not a readable tar" in out


def _seed_defaults(root: Path) -> None:
    store = ImageStore(root)
    image = build_busybox_image(store)
    store.tag("debian:bookworm", image.layers)  # stand-in: no debootstrap in unit tests


def test_ensure_defaults_skips_missing_python_module(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "images"
    _seed_defaults(root)
    monkeypatch.setitem(sys.modules, "rollbox.default_images", None)  # type: ignore[arg-type]
    code, out = run(root, "ensure-defaults")
    assert code == 0, out
    assert "busybox:test present" in out and "debian:bookworm present" in out
    assert "skipping the python image" in out


def test_ensure_defaults_calls_python_image_hook(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "images"
    _seed_defaults(root)
    calls: list[Path] = []
    fake = types.ModuleType("rollbox.default_images")
    fake.ensure_python_image = lambda store: calls.append(store.root)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rollbox.default_images", fake)
    code, out = run(root, "ensure-defaults")
    assert code == 0, out
    assert calls == [root]
