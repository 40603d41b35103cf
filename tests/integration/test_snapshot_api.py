"""Snapshots through the api and the SDK (push to the node's chunk store), and red-team E36:
git history past HEAD scrubbed from a snapshot on request."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore
from rollbox.images.chunks import default_store_url, open_store
from rollbox.models import ExecSpec, SandboxSpec, SnapshotSpec
from rollbox.placement import Placement
from tests.conftest import needs_python, new_name

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"




async def test_sdk_snapshot_push_and_restore(edge, names: list[str], tmp_path: Path,  # noqa: ANN001
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBOX_CHUNK_STORE", f"dir://{tmp_path / 'chunks'}")
    keys = KeyStore(tmp_path / "keys.db")
    app = create_app(Placement([edge]), edge.event_log, keys)
    key = keys.create("proj")
    name = new_name(names)
    async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
        async with await c.create(BB) as sb:
            await sb.exec("mkdir /app")
            await sb.exec("echo v1 > /app/state && echo secret > /app/key.pem")
            res = await sb.snapshot(name, exclude=["*.pem"], push="default")
            assert res.image == name and res.layers[-1] == res.layer
            assert res.pushed_to == default_store_url(edge.settings)
            with pytest.raises(errors.BadRequest):  # the name is taken now
                await sb.snapshot(name)
            with pytest.raises(errors.BadRequest):
                await sb.snapshot("UPPER CASE")
            with pytest.raises(errors.BadRequest):  # not the node's store nor allowed
                await sb.snapshot(new_name(names), push="dir:///etc/rollbox-x")
            assert not Path("/etc/rollbox-x").exists()
            assert (await sb.exec("cat /app/state")).stdout == "v1\n"  # still running
        async with await c.create(name) as copy:
            r = await copy.exec("cat /app/state; test ! -e /app/key.pem")
            assert r.exit_code == 0 and r.stdout == "v1\n"
    store = open_store(res.pushed_to)
    for layer in res.layers:
        assert await store.has_manifest(layer)


async def _sh(edge, sid: str, cmd: str) -> str:  # noqa: ANN001
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=60))
    res = await edge.exec_wait(sid, eid)
    assert res.exit_code == 0, (cmd, res)
    return res.stdout


GIT = "git -c user.email=a@x -c user.name=a"
REPO_SETUP = " && ".join([
    "cd /repo && git init -q -b main",
    "echo task > f.txt && git add f.txt && " + GIT + " commit -q -m task",
    "echo the-answer > f.txt && " + GIT + " commit -q -am solution",
    "git rev-parse HEAD > /tmp/answer-commit",
    "git branch future && git tag v-solution",
    "git reset -q --hard HEAD~1",
])


@needs_python
async def test_scrub_git_history(edge, names: list[str]) -> None:  # noqa: ANN001
    """E36: a repository whose future commit (the solution) is reachable from a branch, a tag,
    the reflog and ORIG_HEAD. Without scrubbing, a sandbox of the snapshot can read it (the
    test can fail); with scrub_git_history it is gone and HEAD's history is intact."""
    src = await edge.create(SandboxSpec(image="python:3.11"), "p")
    await _sh(edge, src.id, "mkdir /repo")
    await _sh(edge, src.id, REPO_SETUP)
    answer = (await _sh(edge, src.id, "cat /tmp/answer-commit")).strip()
    plain, scrubbed = new_name(names), new_name(names)
    await edge.snapshot(src.id, SnapshotSpec(name=plain), "p")
    res = await edge.snapshot(src.id, SnapshotSpec(name=scrubbed, scrub_git_history=True), "p")
    assert res.git_repos_scrubbed == ["/repo"]
    leaky = await edge.create(SandboxSpec(image=plain), "p")
    await _sh(edge, leaky.id, f"cd /repo && git cat-file -e {answer}")
    clean = await edge.create(SandboxSpec(image=scrubbed), "p")
    await _sh(edge, clean.id, " && ".join([
        "cd /repo",
        f"! git cat-file -e {answer} 2>/dev/null",
        "test \"$(git log --all --reflog --format=%s)\" = task",
        "test \"$(git branch --format='%(refname:short)')\" = main",
        "test -z \"$(git tag)\"",
        "test \"$(cat f.txt)\" = task && git status --porcelain | grep -c . | grep -qx 0",
        "git fsck --no-progress --unreachable --lost-found 2>&1 | grep -c commit | grep -qx 0",
        "! grep -rq the-answer .git",
    ]))
    # The source sandbox still has its full repository.
    await _sh(edge, src.id, f"cd /repo && git cat-file -e {answer}")
