"""Red-team E36 on the host side: layers built from directories, archives and uppers keep only
what HEAD reaches in their git repositories, and the host's git never runs a repository's code
or reads through its redirections. Real git, real mkfs.erofs (layers read back with
fsck.erofs --extract)."""
from __future__ import annotations

import io
import os
import secrets
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from rollbox.errors import BadRequest
from rollbox.images import git
from rollbox.images.snapshot import layer_from_upper
from rollbox.images.sources import build_from_directory, import_oci_archive
from rollbox.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (layer ownership)")

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
       "GIT_CONFIG_GLOBAL": "/dev/null"}


def sh(cwd: Path, *cmds: str) -> str:
    out = ""
    for cmd in cmds:
        out = subprocess.run(["bash", "-ec", cmd], cwd=cwd, env=ENV, check=True,
                             capture_output=True, text=True).stdout
    return out.strip()


G = "git -c user.email=a@x -c user.name=a"


def future_repo(repo: Path) -> str:
    """A repository at commit 'task' whose later commit (the answer, blob returned) is still
    reachable from a branch, a tag, a stash, packed refs, the reflog, ORIG_HEAD and FETCH_HEAD."""
    repo.mkdir(parents=True)
    sh(repo, "git init -q -b main .", f"echo task > f && git add f && {G} commit -qm task",
       f"echo the-answer > f && {G} commit -qam solution",
       "git branch future && git tag v-solution && git pack-refs --all",
       "git rev-parse HEAD > .git/FETCH_HEAD", "git reset -q --hard HEAD~1",
       f"echo wip > f && {G} stash -q")
    return sh(repo, "echo the-answer | git hash-object --stdin")


def has_object(gitdir: Path, oid: str) -> bool:
    return subprocess.run(["git", f"--git-dir={gitdir}", "cat-file", "-e", oid], env=ENV,
                          capture_output=True).returncode == 0


def extract(store: ImageStore, digest: str, out: Path) -> Path:
    subprocess.run(["fsck.erofs", f"--extract={out}", str(store.layer_path(digest))],
                   check=True, capture_output=True)
    return out


def test_directory_layer_keeps_only_what_head_reaches(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    src = tmp_path / "ws"
    answer = future_repo(src / "repo")
    image = build_from_directory(store, src, "t/ws:1")
    out = extract(store, image.layers[0], tmp_path / "out")
    assert not has_object(out / "repo/.git", answer)
    assert sh(out / "repo", "git log --all --reflog --format=%s") == "task"
    assert sh(out / "repo", "cat f") == "task"  # the work tree is as it was
    assert not (out / "repo/.git/FETCH_HEAD").exists() and not (out / "repo/.git/logs").exists()
    meta = store.layer_meta(image.layers[0])["git_repos"]
    assert meta == [{"path": "/repo", "history_kept": False, "objects": 3, "unreachable": 0}]
    assert store.inspect("t/ws:1")["git_history"] == []
    assert has_object(src / "repo/.git", answer)  # the source directory is never changed
    assert list(store.tmp_dir.iterdir()) == []


def test_keep_git_history_is_reported_by_inspect(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    src = tmp_path / "ws"
    answer = future_repo(src / "repo")
    image = build_from_directory(store, src, "t/ws:1", keep_git_history=True)
    out = extract(store, image.layers[0], tmp_path / "out")
    assert has_object(out / "repo/.git", answer)  # the test can fail: history is there
    [repo] = store.inspect("t/ws:1")["git_history"]
    assert repo["path"] == "/repo" and repo["history_kept"] and repo["unreachable"] >= 3


def _layer_tar(files: dict[str, Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for arcname, path in files.items():
            tf.add(path, arcname=arcname)
    return buf.getvalue()


def test_archive_repo_changed_by_a_later_layer_is_scrubbed_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docker: `RUN git clone` (the answer on main) then `RUN git checkout <old>`: the lower
    layer's copy is scrubbed at its HEAD and hidden by the top layer's whole, scrubbed repo."""
    import json

    monkeypatch.setattr("rollbox.images.sources.oci.SMALL_LAYER_BYTES", 0)  # two layers, not one
    store = ImageStore(tmp_path / "images")
    work = tmp_path / "w"
    repo = work / "repo"
    repo.mkdir(parents=True)
    sh(repo, "git init -q -b main .", f"echo task > f && git add f && {G} commit -qm task",
       f"echo the-answer > f && {G} commit -qam solution")
    answer = sh(repo, "echo the-answer | git hash-object --stdin")
    lower = _layer_tar({"repo": repo})
    sh(repo, "git reset -q --hard HEAD~1")  # the second layer: HEAD and the branch moved back
    upper = _layer_tar({"repo/.git/refs/heads/main": repo / ".git/refs/heads/main",
                        "repo/f": repo / "f"})
    arc = tmp_path / "img.tar"
    with tarfile.open(arc, "w") as tf:
        for name, data in (("l0.tar", lower), ("l1.tar", upper)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        manifest = json.dumps([{"Config": None, "Layers": ["l0.tar", "l1.tar"]}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tf.addfile(info, io.BytesIO(manifest))
    image = import_oci_archive(store, arc, "t/img:1")
    assert len(image.layers) == 2
    top = extract(store, image.layers[1], tmp_path / "top")
    assert (top / "repo/.git/HEAD").is_file()  # whole, so it hides the lower copy
    assert not has_object(top / "repo/.git", answer)
    assert sh(top / "repo", "git log --all --format=%s") == "task"
    bottom = extract(store, image.layers[0], tmp_path / "bottom")
    assert has_object(bottom / "repo/.git", answer)  # its own HEAD, hidden under the top
    assert sh(bottom / "repo", "git log --all --format=%s") == "solution\ntask"


def armed_repo(repo: Path, marker: Path, host_store: Path) -> str:
    """A repository as an agent would write it: config naming programs (fsmonitor, hooks
    path, ssh, proxy, pager, filter drivers), every hook, and alternates pointing at a host
    object store that holds a secret. Returns the secret's blob id."""
    future_repo(repo)
    host_store.mkdir(parents=True)
    sh(host_store, "git init -q --bare .")
    secret = sh(host_store, "echo host-secret | git hash-object -w --stdin")
    run = f"touch {marker}"
    gitdir = repo / ".git"
    (gitdir / "objects/info/alternates").write_text(f"{host_store}/objects\n")
    with open(gitdir / "config", "a") as f:
        f.write(f"[core]\n\tfsmonitor = {run}\n\thooksPath = {gitdir}/hooks\n"
                f"\tsshCommand = {run}\n\tgitProxy = {run}\n\tpager = {run}\n"
                f"\talternateRefsCommand = {run}\n"
                f"[filter \"x\"]\n\tclean = {run}\n\tsmudge = {run}\n"
                f"[uploadpack]\n\tpackObjectsHook = {run}\n[gc]\n\tauto = 1\n")
    (repo / ".gitattributes").write_text("* filter=x\n")
    for hook in ("pre-auto-gc", "reference-transaction", "post-rewrite", "post-checkout",
                 "post-index-change", "fsmonitor-watchman", "pre-commit"):
        h = gitdir / "hooks" / hook
        h.write_text(f"#!/bin/sh\n{run}\n")
        h.chmod(0o755)
    return secret


def test_armed_repository_runs_nothing_and_reads_no_host_store(tmp_path: Path) -> None:
    marker = tmp_path / f"marker-{secrets.token_hex(4)}"
    twin = tmp_path / "twin"
    secret = armed_repo(twin / "repo", marker, tmp_path / "host-store-twin")
    # Twin: the host's git with the repository's own config runs its code and reads the host
    # store through the alternates (so the checks below can fail).
    subprocess.run(["git", "-c", "safe.directory=*", "status"], cwd=twin / "repo", env=ENV,
                   capture_output=True)
    assert marker.exists() and has_object(twin / "repo/.git", secret)
    marker.unlink()

    store = ImageStore(tmp_path / "images")
    src = tmp_path / "ws"
    secret = armed_repo(src / "repo", marker, tmp_path / "host-store")
    image = build_from_directory(store, src, "t/armed:1")
    out = extract(store, image.layers[0], tmp_path / "out")
    assert not marker.exists()
    assert not has_object(out / "repo/.git", secret)
    assert not (out / "repo/.git/objects/info/alternates").exists()
    assert not (out / "repo/.git/hooks").exists()
    assert "fsmonitor" not in (out / "repo/.git/config").read_text()
    # the same for an upper (a sandbox's changes), and with history kept (count only)
    digest = layer_from_upper(store, src, source="upper:test")
    assert not has_object(extract(store, digest, tmp_path / "out2") / "repo/.git", secret)
    build_from_directory(store, src, "t/armed:2", keep_git_history=True)
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["objects-symlink", "fifo", "head-symlink"])
def test_repository_with_links_or_fifos_is_refused(tmp_path: Path, plant: str) -> None:
    src = tmp_path / "ws"
    future_repo(src / "repo")
    gitdir = src / "repo/.git"
    if plant == "objects-symlink":
        shutil.move(gitdir / "objects/info", tmp_path / "info")
        (gitdir / "objects/info").symlink_to(tmp_path / "info")
    elif plant == "fifo":
        os.mkfifo(gitdir / "objects/fifo")
    else:
        (gitdir / "packed-refs").unlink()
        (gitdir / "packed-refs").symlink_to("/etc/shadow")
    store = ImageStore(tmp_path / "images")
    with pytest.raises(BadRequest, match="non-regular"):
        build_from_directory(store, src, "t/ws:1")
    assert list(store.tmp_dir.iterdir()) == []


def test_git_dir_symlink_is_never_followed(tmp_path: Path) -> None:
    # `.git -> /some/host/repo` in a tree is a link to copy, not a repository to scrub.
    host = tmp_path / "host"
    answer = future_repo(host)
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / ".git").symlink_to(host / ".git")
    assert list(git.git_dirs(tree)) == []
    assert git.process_tree(tree, keep_history=False, scratch=tmp_path) == []
    assert has_object(host / ".git", answer)


def test_staged_answer_and_repository_without_commits(tmp_path: Path) -> None:
    src = tmp_path / "ws"
    answer = future_repo(src / "repo")
    sh(src / "repo", "echo the-answer > f && git add f && echo task > f")  # staged only
    (src / "empty").mkdir()
    sh(src / "empty", "git init -q .", "echo the-answer > g && git add g")
    store = ImageStore(tmp_path / "images")
    out = extract(store, build_from_directory(store, src, "t/ws:1").layers[0], tmp_path / "o")
    assert not has_object(out / "repo/.git", answer) and not has_object(out / "empty/.git", answer)
    assert sh(out / "repo", "git diff --cached --stat") == ""


def test_bare_and_submodule_stores_are_found(tmp_path: Path) -> None:
    root = tmp_path / "r"
    future_repo(root / "w")
    sh(root, "git init -q --bare srv/x.git", "mkdir -p w/.git/modules && "
       "git init -q --bare w/.git/modules/sub")
    found = sorted(git.rel_path(root, p) for p in git.git_dirs(root))
    assert found == ["/srv/x.git", "/w", "/w/.git/modules/sub"]


def test_upper_changing_a_lower_repo_is_scrubbed_whole(tmp_path: Path) -> None:
    """`image build --base X --run "git ..."` over an image whose repository is in a lower
    layer: the commands' changes (a solution committed on a branch, then reset) are in the
    upper only; the layer gets the whole repository from the overlay view, scrubbed."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    repo = lower / "repo"
    repo.mkdir()
    sh(repo, "git init -q -b main .", f"echo task > f && git add f && {G} commit -qm task")
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)], check=True)
    try:
        sh(merged / "repo", f"echo the-answer > f && {G} commit -qam solution",
           "git branch future && git reset -q --hard HEAD~1")
        answer = sh(merged / "repo", "echo the-answer | git hash-object --stdin")
        assert not (upper / "repo/.git/HEAD").exists()  # partial: the repo is the lower's
        store = ImageStore(tmp_path / "images")
        digest = layer_from_upper(store, upper, source="upper:test", merged=merged)
    finally:
        subprocess.run(["umount", str(merged)], check=True)
    out = extract(store, digest, tmp_path / "out")
    assert (out / "repo/.git/HEAD").is_file() and not has_object(out / "repo/.git", answer)
    assert sh(out / "repo", "git log --all --format=%s") == "task"
    assert store.layer_meta(digest)["git_repos"][0]["path"] == "/repo"


def test_git_errors_do_not_name_host_paths(tmp_path: Path) -> None:
    """A broken repository's git error reaches the client (uploads, snapshots): the staging
    dir it names is a host path, shown as $GIT_DIR."""
    root = tmp_path / "staging-root"
    root.mkdir()
    sh(root, "git init -q r", "echo a > r/a", "git -C r add a", f"{G} -C r commit -qm one")
    obj = next(p for p in (root / "r/.git/objects").rglob("*") if p.is_file()
               and p.parent.name != "pack" and p.parent.name != "info")
    obj.chmod(0o644)
    obj.write_bytes(b"")
    with pytest.raises(BadRequest) as exc:
        git.process_tree(root, keep_history=False, scratch=tmp_path)
    assert "$GIT_DIR/objects/" in exc.value.message and str(tmp_path) not in exc.value.message


def test_completing_repos_never_follows_a_link_out_of_the_view(tmp_path: Path) -> None:
    """complete_repos reads repositories from the sandbox's view, which a sandbox that is not
    frozen (snapshot pause=False) changes meanwhile: a directory of the capture swapped for a
    symlink to a host directory must not bring a host repository into the layer."""
    from rollbox.images.snapshot import complete_repos

    host = tmp_path / "host"
    host.mkdir()
    sh(host, "git init -q -b main main", f"echo host-secret > main/s && {G} -C main add s",
       f"{G} -C main commit -qm secret")
    merged, capture = tmp_path / "merged", tmp_path / "capture"
    merged.mkdir()
    os.symlink(host, merged / "w")  # the sandbox swapped w for a link after the capture
    (capture / "w/main/.git").mkdir(parents=True)  # what the capture saw: real directories
    (capture / "w/main/.git/config").write_text("partial")
    assert complete_repos(merged, capture, id_shift=0) == []
    assert sorted(p.name for p in (capture / "w/main/.git").iterdir()) == ["config"]
    # A real repository of the view is still completed.
    sh(merged, "git init -q -b main real", f"echo x > real/x && {G} -C real add x",
       f"{G} -C real commit -qm x")
    (capture / "real/.git").mkdir(parents=True)
    assert complete_repos(merged, capture, id_shift=0) == ["/real/.git"]
    assert (capture / "real/.git/HEAD").is_file()
