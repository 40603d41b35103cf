"""The upstream test suites (tests/upstream/suites.py) against a real ``rollbox serve`` on a
scratch node: every test not excluded (with its reason, in suites.py and docs/compat.md) must
pass. Marked ``upstream`` (``make test-upstream``); needs the projects' sources: a checkout or
bare repository in UPSTREAM_SWEREX_SRC / UPSTREAM_SANDBOXFUSION_SRC, else a clone from GitHub.
SandboxFusion's go/java/rust/typescript tests run on the optional image fncall-polyglot:1, which
this tier builds when the node lacks it (minutes, ~1 GB; nothing else builds it).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollbox
from rollbox.embedded import ServerProcess
from tests.conftest import have_image, node_settings
from tests.upstream import suites

pytestmark = [pytest.mark.upstream,
              pytest.mark.skipif(not have_image("python:3.11"), reason="python:3.11 not built")]


@pytest.fixture
def server(tmp_node_dir: Path) -> Iterator[tuple[str, str]]:
    """(url, project key) of a scratch node's ``rollbox serve``; stopped (and its sandboxes
    with it) at the end, also on failure."""
    srv = ServerProcess(node_settings(tmp_node_dir))
    try:
        srv.start()
        with rollbox.Client(srv.url, srv.key) as admin:
            key = admin.create_key("upstream").key
        yield srv.url, key
    finally:
        srv.stop()


def _run(suite: suites.Suite, url: str, key: str, workdir: Path) -> suites.Outcome:
    src = os.environ.get(f"UPSTREAM_{suite.name.split('-')[0].upper()}_SRC") or None
    with suites.suite_env(suite, url, key) as env:
        return suites.run(suite, url, key, env, src, workdir=workdir)


@pytest.mark.parametrize("suite", [suites.SWEREX, suites.SANDBOXFUSION], ids=lambda s: s.name)
async def test_suite(suite: suites.Suite, server: tuple[str, str], tmp_path: Path) -> None:
    out = await asyncio.to_thread(_run, suite, *server, tmp_path)
    print(out.summary())
    assert not out.failed, out.failed
    assert not out.skipped, out.skipped
    assert sorted(out.excluded) == sorted(suite.excluded)
    assert len(out.passed) == suite.expected_passed, out.summary()


async def test_sandboxfusion_polyglot_suite(server: tuple[str, str], tmp_path: Path) -> None:
    from rollbox.config import Settings
    from rollbox.default_images import ensure_polyglot_image
    from rollbox.images.store import ImageStore

    await asyncio.to_thread(ensure_polyglot_image, ImageStore(Settings().images_dir))
    await test_suite(suites.SANDBOXFUSION_POLYGLOT, server, tmp_path)
