"""What layers leave out of the trees they are made from, besides what a snapshot's own rules
scrub (:data:`rollbox.images.snapshot.SCRUB_RULES`): the caches of an image build's upper, and
bytecode (the builder keeps the library's). Also the grammar of exclude patterns every capture
uses: ``/abs/glob`` matches the whole path in the image (fnmatch: ``*`` also matches ``/``), a
bare pattern any entry's basename.

A leaf of :mod:`rollbox.images`.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

# Caches dropped from an image build's writable layer (besides ``exclude``).
UPPER_CACHE_EXCLUDES = ["/var/cache/apt/archives/*.deb", "/var/lib/apt/lists/*", "/root/.cache",
                        "/tmp/*"]
# Bytecode policy. Layers the image builder makes from trusted sources (--run commands,
# --from-dir) keep the ``__pycache__`` of the standard library and of installed packages: a cold
# `import pytest` is ~4x slower without it. Everywhere else (a workspace, a task's tests, which
# sandboxes may hide) ``__pycache__`` is dropped, and so is what pytest compiled (its
# assertion-rewritten modules) wherever it is: no layer keeps bytecode of a hidden path next to
# it. Snapshots and uploaded layers drop every ``__pycache__`` (their sources are untrusted).
BYTECODE_KEPT_UNDER = ("/usr/lib/python3*/*", "/usr/local/lib/python3*/*")
PYTEST_BYTECODE = "*-pytest-*.pyc"


def bytecode_dropped(rel: str, name: str, *, keep_library: bool = True) -> bool:
    """Whether the entry ``name`` at ``rel`` (its absolute path in the image) is bytecode a
    layer leaves out (see BYTECODE_KEPT_UNDER)."""
    if name == "__pycache__":
        return not keep_library or not any(fnmatch.fnmatchcase(rel, p)
                                           for p in BYTECODE_KEPT_UNDER)
    return fnmatch.fnmatchcase(name, PYTEST_BYTECODE)


def dropped_bytecode(root: Path, *, keep_library: bool = True) -> list[str]:
    """Paths below ``root`` (relative, for ``add_layer_from_dir(exclude=...)``) of the bytecode
    its layer leaves out; links are not followed."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = "/" + os.path.relpath(dirpath, root).removeprefix(".").lstrip("/")
        for name in list(dirnames) + filenames:
            rel = rel_dir.rstrip("/") + "/" + name
            if bytecode_dropped(rel, name, keep_library=keep_library):
                out.append(rel.lstrip("/"))
                if name in dirnames:
                    dirnames.remove(name)
    return out


def matches(rel: str, name: str, patterns: list[str]) -> bool:
    """Whether the entry ``name`` at ``rel`` (its absolute path in the image) matches one of
    ``patterns``."""
    for pat in patterns:
        if pat.startswith("/"):
            if fnmatch.fnmatchcase(rel, pat.rstrip("/") or "/"):
                return True
        elif fnmatch.fnmatchcase(name, pat):
            return True
    return False
