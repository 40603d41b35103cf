"""Image source: a directory tree, taken as is (ownership included), one layer."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from rollbox.errors import InfraError
from rollbox.images import git
from rollbox.images.names import validate_name
from rollbox.images.scrub import dropped_bytecode
from rollbox.images.store import Image, ImageStore, Progress


def build_from_directory(store: ImageStore, src_dir: Path, name: str,
                         config: dict[str, Any] | None = None, *,
                         progress: Progress | None = None,
                         keep_git_history: bool = False) -> Image:
    """One-layer image from a directory tree (taken as is, ownership included, bytecode as
    BYTECODE_KEPT_UNDER says). Its git repositories keep only what HEAD reaches (a staging copy
    is scrubbed; ``src_dir`` is never changed) unless ``keep_git_history``."""
    validate_name(name)
    src = Path(src_dir)
    source = f"dir:{src.resolve()}"
    if keep_git_history or next(git.git_dirs(src), None) is None:
        repos = git.process_tree(src, keep_history=True, scratch=store.tmp_dir)
        digest = store.add_layer_from_dir(src, source=source, progress=progress,
                                          git_repos=repos,
                                          exclude=dropped_bytecode(src))
        return store.tag(name, [digest], config)
    staging = store.staging_dir("dir")
    try:
        root = staging / "rootfs"
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(src), str(root)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise InfraError(f"copying {src} for its git scrub failed: {proc.stderr[-300:]}")
        if progress:
            progress("keeping only what HEAD reaches in its git repositories")
        repos = git.process_tree(root, keep_history=False, scratch=staging)
        digest = store.add_layer_from_dir(root, source=source, progress=progress,
                                          git_repos=repos,
                                          exclude=dropped_bytecode(root))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return store.tag(name, [digest], config)
