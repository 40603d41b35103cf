"""Git repositories inside layer sources (red-team E36): find them, keep only what HEAD
reaches, count what it does not.

A workspace imported with its git history carries every later commit a branch, tag, stash,
reflog or stray pack still holds (the task's solution, typically). Layers built from a
directory, an archive or a sandbox's changes (``pack_diff``) therefore keep, by default, only the
objects HEAD reaches in every repository of the tree; an opt-out (``keep_git_history``) keeps
them, and the layer's metadata then says how many objects HEAD does not reach (``image
inspect``).

Every host-side git invocation of the platform goes through :func:`run_git`. The repositories
are written by sandboxes or come with an image source, so git must never run their code or read
files outside them: the repository's config is replaced (before git ever reads it) and its
hooks, alternates, ``commondir``, grafts and worktree links removed; a tree holding anything but
plain files and directories is refused; git runs with a fixed environment (no system or global
config, no HOME, no protocols, no prompts), command-line overrides for every setting that names
a program (fsmonitor, hooks, ssh, proxy, askpass, credential helpers, pack-objects hook), and
address-space and CPU limits. Only staging copies owned by the caller are ever changed.

Must not touch: the image store (callers pass staging trees and record the returned facts).
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rollbox.errors import BadRequest, PayloadTooLarge
from rollbox.models import GitRepoFacts

GIT_TIMEOUT_S = 300.0
GIT_MEMORY_BYTES = 4 << 30
_OID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "XDG_CONFIG_HOME": "/nonexistent",
        "LANG": "C", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_SYSTEM": "/dev/null",
        "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false", "GIT_SSH_COMMAND": "/bin/false",
        "GIT_NO_REPLACE_OBJECTS": "1", "GIT_NO_LAZY_FETCH": "1", "GIT_OPTIONAL_LOCKS": "0",
        "GIT_CEILING_DIRECTORIES": "/"}
# Command-line config wins over every file git reads; each names a program git could start or
# a file outside the repository it could read.
_OVERRIDES = {
    "core.hooksPath": "/dev/null", "core.fsmonitor": "false", "core.sshCommand": "/bin/false",
    "core.gitProxy": "", "core.askPass": "/bin/false", "credential.helper": "",
    "uploadpack.packObjectsHook": "", "core.alternateRefsCommand": "",
    "protocol.allow": "never", "core.untrackedCache": "false", "core.splitIndex": "false",
    "gc.auto": "0", "gc.autoDetach": "false", "maintenance.auto": "false",
    "gc.writeCommitGraph": "false", "core.commitGraph": "false", "pack.threads": "1",
    # within the address-space limit below, also for large packs
    "core.packedGitLimit": "1g", "core.packedGitWindowSize": "128m", "pack.windowMemory": "256m",
}
_SCRUB_OVERRIDES = {"gc.reflogExpire": "now", "gc.reflogExpireUnreachable": "now",
                    "gc.pruneExpire": "now", "gc.rerereResolved": "now",
                    "gc.rerereUnresolved": "now", "gc.worktreePruneExpire": "now"}
_SANE_CONFIG = "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
# Redirections (another object store, another repository, a replaced history) and code.
_REDIRECTS = ("commondir", "objects/info/alternates", "objects/info/http-alternates",
              "config.worktree", "info/grafts", "gitdir")
_CODE_AND_LOGS = ("hooks", "logs", "worktrees", "rr-cache")
_SIDE_HEADS = ("ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD",
               "AUTO_MERGE", "BISECT_HEAD", "REBASE_HEAD")


def is_git_dir(path: Path) -> bool:
    """git's own test of a repository directory (HEAD, objects/, refs/), without following a
    symlink at any of them."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return is_git_dir_at(fd)
    finally:
        os.close(fd)


def is_git_dir_at(fd: int) -> bool:
    """:func:`is_git_dir` of the directory open at ``fd``."""
    def kind(name: str) -> int:
        return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode

    try:
        return (stat.S_ISREG(kind("HEAD")) and stat.S_ISDIR(kind("objects"))
                and stat.S_ISDIR(kind("refs")))
    except OSError:
        return False


def git_dirs(root: Path) -> Iterator[Path]:
    """Every repository directory in ``root``: ``.git`` directories, bare repositories and
    submodule stores alike (git's structure, not the name, decides), outer ones first. Never
    follows links."""
    for dirpath, dirnames, _files in os.walk(root):
        here = Path(dirpath)
        if is_git_dir(here):
            yield here
            # Inside a repository only submodule stores (modules/<name>) are repositories.
            dirnames[:] = [d for d in dirnames if d == "modules"]
            continue
        dirnames[:] = [d for d in dirnames if not os.path.islink(here / d)]


def rel_path(root: Path, gitdir: Path) -> str:
    """The repository's path inside the layer: its work tree for a ``.git`` directory."""
    rel = gitdir.relative_to(root)
    if rel.name == ".git":
        rel = rel.parent
    return "/" if str(rel) == "." else f"/{rel}"


def run_git(gitdir: Path, args: list[str], *, what: str, scrub: bool = False,
            timeout: float = GIT_TIMEOUT_S) -> str:
    """The host's git on repository ``gitdir`` (already :func:`neutralise`d), with the fixed
    environment and overrides above; BadRequest with git's message when it fails."""
    overrides = {**_OVERRIDES, **(_SCRUB_OVERRIDES if scrub else {}),
                 "safe.directory": str(gitdir)}
    cmd = ["prlimit", f"--as={GIT_MEMORY_BYTES}", f"--cpu={int(timeout)}", "--", "git"]
    for key, value in overrides.items():
        cmd += ["-c", f"{key}={value}"]
    cmd += [f"--git-dir={gitdir}", *args]
    try:
        proc = subprocess.run(cmd, env={**_ENV, "GIT_DIR": str(gitdir)}, capture_output=True,
                              text=True, errors="replace", check=False, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd="/")
    except subprocess.TimeoutExpired:
        raise PayloadTooLarge(f"git {args[0]} on {what} took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        # git names files by their host path (a staging dir): the caller sees $GIT_DIR instead.
        stderr = proc.stderr.replace(str(gitdir), "$GIT_DIR").strip()
        raise BadRequest(f"git {args[0]} failed on {what} (is the whole repository in this "
                         f"tree?): {stderr[-300:]}")
    return proc.stdout


def check_plain_tree(gitdir: Path, what: str) -> None:
    """A repository git will read must be real files and directories only: git would follow
    a symlink (objects -> somewhere on the host) or block on a FIFO."""
    for dirpath, dirnames, filenames in os.walk(gitdir):
        for name in dirnames + filenames:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise BadRequest(f"git repository {what} contains a non-regular entry "
                                 f"{name!r}: refused")


def neutralise(gitdir: Path, what: str) -> str | None:
    """Make a staging copy of a repository safe for the host's git: plain tree checked,
    redirections and hooks removed, config replaced. Returns HEAD's branch (None: detached)."""
    check_plain_tree(gitdir, what)
    for name in _REDIRECTS:
        (gitdir / name).unlink(missing_ok=True)
    config = gitdir / "config"
    config_st = os.lstat(config) if config.exists() else os.lstat(gitdir)
    config.write_text(_SANE_CONFIG)
    os.chown(config, config_st.st_uid, config_st.st_gid)
    with open(gitdir / "HEAD", errors="replace") as f:  # written by a sandbox: bounded read
        head = f.read(4096).strip()
    # git's ref-name rules, enough of them that the name stays inside refs/heads
    m = re.fullmatch(r"ref: (refs/heads/[^\s~^:?*\[\\]+)", head)
    if m is not None and (".." in m.group(1) or "//" in m.group(1)
                          or m.group(1).endswith(("/", ".lock"))):
        m = None
    if m is None and not _OID.fullmatch(head):
        raise BadRequest(f"git repository {what}: HEAD is {head[:80]!r}")
    return m.group(1) if m else None


def _keep_only_ref(gitdir: Path, keep: str | None, what: str) -> bool:
    """Delete every ref but ``keep`` (HEAD's branch; None: detached HEAD), loose or packed.
    False if HEAD's branch has no commit (a repository without commits)."""
    packed = gitdir / "packed-refs"
    keep_line = None
    if packed.is_file():
        with open(packed, errors="replace") as f:  # any size: read by bounded lines
            for line in iter(lambda: f.readline(4096), ""):
                parts = line.split()
                if len(parts) == 2 and parts[1] == keep:
                    keep_line = parts[0]
        packed.unlink()
    refs = gitdir / "refs"
    for dirpath, _dirs, files in os.walk(refs, topdown=False):
        for f in files:
            path = os.path.join(dirpath, f)
            if os.path.relpath(path, gitdir) != keep:
                os.unlink(path)
    born = True
    if keep is not None:
        loose = gitdir / keep
        if not loose.is_file():
            if keep_line is None or not _OID.fullmatch(keep_line):
                born = False
            else:
                loose.parent.mkdir(parents=True, exist_ok=True)
                loose.write_text(keep_line + "\n")
    for sub in ("heads", "tags"):
        (refs / sub).mkdir(parents=True, exist_ok=True)
    return born


def scrub(gitdir: Path, what: str) -> GitRepoFacts:
    """Keep only what HEAD reaches in the staging repository ``gitdir``: other branches, tags,
    remotes, stashes, reflogs, side heads (ORIG_HEAD, FETCH_HEAD, ...), hooks, worktrees and
    every object only they reach are removed (``git gc --prune=now``). Files git writes get
    the repository directory's owner."""
    keep = neutralise(gitdir, what)
    for sub in _CODE_AND_LOGS:
        p = gitdir / sub
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for name in _SIDE_HEADS:
        (gitdir / name).unlink(missing_ok=True)
    born = _keep_only_ref(gitdir, keep, what)
    if (gitdir / "index").is_file():
        # The index names blobs too (a staged answer): it becomes HEAD's tree. The work tree
        # is not read; git re-hashes changed-looking files on the next status.
        run_git(gitdir, ["read-tree", "HEAD" if born else "--empty"], what=what)
    run_git(gitdir, ["reflog", "expire", "--expire=all", "--expire-unreachable=all", "--all"],
            what=what, scrub=True)
    run_git(gitdir, ["gc", "--prune=now", "--quiet"], what=what, scrub=True)
    st = os.lstat(gitdir)
    for dirpath, dirnames, filenames in os.walk(gitdir):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), st.st_uid, st.st_gid, follow_symlinks=False)
    objects = len(_all_objects(gitdir, what))
    return GitRepoFacts(path=what, history_kept=False, objects=objects, unreachable=0)


def _all_objects(gitdir: Path, what: str) -> set[str]:
    out = run_git(gitdir, ["cat-file", "--batch-all-objects", "--batch-check=%(objectname)"],
                  what=what)
    return set(out.split())


def count_unreachable(gitdir: Path, what: str, scratch: Path) -> GitRepoFacts:
    """Objects of the repository HEAD does not reach, counted on a neutralised copy in the
    caller's ``scratch`` directory (the repository itself is not changed)."""
    check_plain_tree(gitdir, what)
    tmp = Path(tempfile.mkdtemp(dir=scratch, prefix="git-count-")) / "repo"
    shutil.copytree(gitdir, tmp, symlinks=True,  # submodule stores are counted on their own
                    ignore=lambda d, names: ["modules"] if d == str(gitdir) else [])
    try:
        neutralise(tmp, what)
        every = _all_objects(tmp, what)
        reached = run_git(tmp, ["rev-list", "--objects", "--missing=allow-any", "HEAD"],
                          what=what)
        reachable = {line.split(" ", 1)[0] for line in reached.splitlines() if line}
        return GitRepoFacts(path=what, history_kept=True, objects=len(every),
                         unreachable=len(every - reachable))
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def process_tree(root: Path, *, keep_history: bool, scratch: Path) -> list[GitRepoFacts]:
    """Scrub the repositories of the staging tree ``root`` or, keeping history, count what HEAD
    does not reach in each (``root`` then is not changed: it may be a caller's directory)."""
    facts = []
    root = Path(os.path.abspath(root))
    for gitdir in list(git_dirs(root)):
        what = rel_path(root, gitdir)
        facts.append(count_unreachable(gitdir, what, scratch) if keep_history
                     else scrub(gitdir, what))
    return facts
