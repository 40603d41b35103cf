"""`rollbox image push/pull` through typer's CliRunner: two image stores (two 'nodes') and a
dir:// chunk store between them."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollbox.image_cli import app
from rollbox.images.sources import build_from_directory
from rollbox.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.erofs") is None,
                                reason="needs root and mkfs.erofs")
runner = CliRunner()


def test_push_pull_cli(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/hello").write_text("hi " * 50_000)
    image = build_from_directory(ImageStore(a), src, "tool:1", {"env": {"X": "1"}})
    url = f"dir://{tmp_path}/chunks?compression=zstd"
    res = runner.invoke(app, ["--root", str(a), "push", "tool:1", url, "--chunk-size", "65536"])
    assert res.exit_code == 0, res.output
    assert "bytes pushed" in res.output and image.layers[0] in res.output
    res = runner.invoke(app, ["--root", str(a), "push", "tool:1", url, "--chunk-size", "65536"])
    assert res.exit_code == 0 and " 0/" in res.output  # dedupe: nothing uploaded
    res = runner.invoke(app, ["--root", str(b), "pull", "tool:1", url])
    assert res.exit_code == 0, res.output
    got = ImageStore(b).resolve("tool:1")
    assert got.layers == image.layers and got.config["env"]["X"] == "1"
    assert (ImageStore(b).layer_path(image.layers[0]).read_bytes()
            == ImageStore(a).layer_path(image.layers[0]).read_bytes())
    res = runner.invoke(app, ["--root", str(b), "pull", "nope:1", url])
    assert res.exit_code == 2 and "not in" in res.output
    res = runner.invoke(app, ["--root", str(b), "pull", "tool:1", "ftp://x"])
    assert res.exit_code == 2 and "scheme" in res.output
