"""Fixtures shared by the unit tests."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.hostfs import SandboxFS

# A sandbox uid shift as the edge would choose one (a multiple of 65536).
SHIFT = 1_000_000_000 // 65536 * 65536


@pytest.fixture
def box() -> Iterator[tuple[SandboxFS, Path]]:
    """A SandboxFS over a fresh temp dir playing the sandbox's merged root."""
    tmp = Path(tempfile.mkdtemp(prefix="rbx-files-"))
    root = tmp / "root"
    root.mkdir()
    fs = SandboxFS(root, SHIFT)
    try:
        yield fs, root
    finally:
        fs.close()
        shutil.rmtree(tmp)
