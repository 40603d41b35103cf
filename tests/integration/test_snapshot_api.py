"""Snapshots through the api and the SDK (push to the node's chunk store), and red-team E36:
git history past HEAD scrubbed from every snapshot unless kept on request."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.iam import KeyStore
from rollbox.images.chunks import default_store_url, open_store
from rollbox.models import ExecSpec, SandboxSpec, SnapshotSpec
from tests.conftest import BOTH_TRANSPORTS, api_app, needs_python, new_name

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"




@BOTH_TRANSPORTS
async def test_sdk_snapshot_push_and_restore(edge, api_edge, names: list[str],  # noqa: ANN001
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge.settings, "chunk_store", f"dir://{tmp_path / 'chunks'}")
    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys)
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
    the reflog and ORIG_HEAD. With keep_git_history, a sandbox of the snapshot can read it (the
    test can fail); by default it is gone and HEAD's history is intact."""
    src = await edge.create(SandboxSpec(image="python:3.11"), "p")
    await _sh(edge, src.id, "mkdir /repo")
    await _sh(edge, src.id, REPO_SETUP)
    answer = (await _sh(edge, src.id, "cat /tmp/answer-commit")).strip()
    plain, scrubbed = new_name(names), new_name(names)
    kept = await edge.snapshot(src.id, SnapshotSpec(name=plain, keep_git_history=True), "p")
    assert kept.git_repos_scrubbed == [] and kept.git_repos[0].unreachable >= 3
    res = await edge.snapshot(src.id, SnapshotSpec(name=scrubbed), "p")
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


@needs_python
async def test_repo_of_a_lower_layer_is_scrubbed_whole(edge, names: list[str]) -> None:  # noqa: ANN001
    """The repository lives in the image (a lower layer); the sandbox commits the solution on
    a branch and resets: the snapshot's layer gets the whole repository, scrubbed, and the
    solution is unreadable from a sandbox of it."""
    src = await edge.create(SandboxSpec(image="python:3.11"), "p")
    await _sh(edge, src.id, "mkdir /repo && cd /repo && git init -q -b main && echo task > f "
              f"&& git add f && {GIT} commit -q -m task")
    base = new_name(names)
    await edge.snapshot(src.id, SnapshotSpec(name=base), "p")
    box = await edge.create(SandboxSpec(image=base), "p")
    await _sh(edge, box.id, f"cd /repo && echo the-answer > f && {GIT} commit -q -am solution "
              "&& git rev-parse HEAD > /tmp/answer-commit && git branch future && git tag v1 "
              "&& git reset -q --hard HEAD~1")
    answer = (await _sh(edge, box.id, "cat /tmp/answer-commit")).strip()
    top = new_name(names)
    res = await edge.snapshot(box.id, SnapshotSpec(name=top), "p")
    assert res.git_repos_scrubbed == ["/repo"]
    clean = await edge.create(SandboxSpec(image=top), "p")
    await _sh(edge, clean.id, " && ".join([
        "cd /repo", f"! git cat-file -e {answer} 2>/dev/null",
        "test \"$(git log --all --reflog --format=%s)\" = task", "test \"$(cat f)\" = task"]))


@needs_python
async def test_armed_repo_runs_nothing_on_the_host(edge, names: list[str],  # noqa: ANN001
                                                   tmp_path: Path) -> None:
    """A sandbox-written repository whose config, hooks and attributes name host commands and
    whose alternates point at a host object store: the snapshot's scrub runs none of them
    (the marker stays absent) and reads nothing of the host store."""
    import secrets
    import subprocess

    marker = tmp_path / f"marker-{secrets.token_hex(4)}"
    host_store = tmp_path / "host-store"
    subprocess.run(["git", "init", "-q", "--bare", str(host_store)], check=True)
    secret = subprocess.run(["git", f"--git-dir={host_store}", "hash-object", "-w", "--stdin"],
                            input="host-secret\n", capture_output=True, text=True,
                            check=True).stdout.strip()
    src = await edge.create(SandboxSpec(image="python:3.11"), "p")
    run = f"touch {marker}"
    await _sh(edge, src.id, " && ".join([
        "mkdir /repo && cd /repo && git init -q -b main && echo task > f && git add f",
        f"{GIT} commit -q -m task",
        f"git config core.fsmonitor '{run}' && git config core.hooksPath /repo/.git/hooks",
        f"git config core.sshCommand '{run}' && git config filter.x.clean '{run}'",
        f"git config uploadpack.packObjectsHook '{run}' && git config gc.auto 1",
        "echo '* filter=x' > .gitattributes",
        f"for h in pre-auto-gc reference-transaction post-rewrite; do printf '#!/bin/sh\\n{run}\\n'"
        " > .git/hooks/$h && chmod +x .git/hooks/$h; done",
        f"echo {host_store}/objects > .git/objects/info/alternates",
    ]))
    name = new_name(names)
    res = await edge.snapshot(src.id, SnapshotSpec(name=name), "p")
    assert res.git_repos_scrubbed == ["/repo"]
    assert not marker.exists()
    clean = await edge.create(SandboxSpec(image=name), "p")
    await _sh(edge, clean.id, " && ".join([
        "cd /repo", f"! git cat-file -e {secret} 2>/dev/null",
        "test ! -e .git/objects/info/alternates && test ! -e .git/hooks",
        "! grep -q fsmonitor .git/config", "test \"$(git log --format=%s)\" = task"]))


async def test_snapshot_errors_name_no_host_path(edge, names: list[str],  # noqa: ANN001
                                                 tmp_path: Path) -> None:
    """A broken repository in the sandbox's changes fails the snapshot's scrub: git's message
    reaches the caller without the staging dir's host path."""
    import io
    import subprocess
    import tarfile

    subprocess.run(["bash", "-ec", "git init -q r; echo a > r/a; git -C r add a; "
                    "git -C r -c user.email=a@b -c user.name=a commit -qm one"],
                   cwd=tmp_path, check=True, capture_output=True)
    obj = next((tmp_path / "r/.git/objects").glob("??/*"))
    obj.chmod(0o644)
    obj.write_bytes(b"")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(tmp_path / "r", "r")

    async def chunks():  # noqa: ANN202
        yield buf.getvalue()

    src = await edge.create(SandboxSpec(image=BB), "p")
    await edge.upload_tar(src.id, "/", chunks())
    with pytest.raises(errors.BadRequest, match="git") as exc:
        await edge.snapshot(src.id, SnapshotSpec(name=new_name(names)), "p")
    assert "$GIT_DIR" in exc.value.message
    assert str(edge.store.root) not in exc.value.message and "rootfs" not in exc.value.message
    await edge.delete(src.id)
