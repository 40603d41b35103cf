"""Snapshots and grading of microVMs through the edge: a VM's writable layer (its upper,
streamed out by the guest's busybox tar and parsed as hostile) becomes a layer that a
container boots from, a container's snapshot boots as a VM, and a VM's grade runs in a fresh
VM of the pristine layers plus only the declared files (the source VM is never trusted).
User xattrs survive a VM's snapshot as a container's (busybox tar carries none: the agent's
rollbox-xattrs records do)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


from rollbox.models import ExecSpec, GradeSpec, Resources, SandboxSpec, SnapshotSpec
from rollbox.images.sources import build_from_directory
from tests.conftest import new_name
from tests.helpers.vm_guest import real_guest_marks

BB = "busybox:test"
pytestmark = real_guest_marks(BB)
VM = Resources(cpus=1, memory_mib=256, disk_mib=64)

CHANGES = " && ".join([
    "mkdir -p /work/pkg/__pycache__ /data",
    "echo hello > /work/new.txt",
    "ln /work/new.txt /work/hard.txt",
    "ln -s /etc/shadow /work/shadow_link",
    "mkfifo /work/fifo",
    "echo cached > /work/pkg/__pycache__/m.pyc",
    "chown 1000:100 /work/hard.txt && chmod 4755 /work/new.txt",  # chown clears setuid
    "rm /bin/yes",  # a file of the image: a whiteout
    # a directory of the image removed and made again: opaque (the image's group file stays
    # hidden)
    "rm -rf /etc && mkdir /etc && echo only > /etc/only",
    "echo 'root:x:0:0:root:/root:/bin/sh' > /etc/passwd",
    "echo answer > /work/secret.txt",
])
EXPECTED = " && ".join([
    "test \"$(cat /work/new.txt)\" = hello",
    "test \"$(stat -c %i /work/new.txt)\" = \"$(stat -c %i /work/hard.txt)\"",
    "test \"$(stat -c %u:%g:%a /work/new.txt)\" = 1000:100:4755",
    "test \"$(readlink /work/shadow_link)\" = /etc/shadow",
    "test -p /work/fifo",
    "test ! -e /bin/yes && test -e /bin/ls",
    "test \"$(ls -A /etc | tr '\\n' ' ')\" = 'only passwd '",
    "test ! -e /work/pkg/__pycache__ && test -d /work/pkg",
    "test ! -e /work/secret.txt",
])


async def sh(edge, sid: str, cmd: str) -> str:  # noqa: ANN001
    res = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=60)))
    assert res.exit_code == 0, (cmd, res)
    return res.stdout


TAGGED = "work/tagged.txt"  # a file of the lower layer with a user xattr
MANY, MANY_FILES = "work/many", 200  # ~100 KiB of xattr records once all are copied up


def repo_layer(edge, names: list[str], tmp: Path) -> str:  # noqa: ANN001
    """A layer with a git repository at /work/repo whose history goes past its HEAD, and
    TAGGED with the user xattr user.rollbox.test=kept."""
    repo = tmp / "ws/work/repo"
    repo.mkdir(parents=True)
    (tmp / "ws" / TAGGED).write_text("tagged\n")
    os.setxattr(tmp / "ws" / TAGGED, "user.rollbox.test", b"kept")
    many = tmp / "ws" / MANY
    many.mkdir()
    for i in range(MANY_FILES):  # more records than a pipe holds: the tool must stream them
        (many / f"f{i}").write_text("")
        os.setxattr(many / f"f{i}", "user.rollbox.n", b"%d" % i + b"." * 500)
    git = ["git", "-C", str(repo), "-c", "user.email=a@x", "-c", "user.name=a"]
    for cmd in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "task"],
                ["commit", "-q", "--allow-empty", "-m", "the-answer"],
                ["branch", "future"], ["reset", "-q", "--hard", "HEAD~1"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    name = new_name(names, "vm-repo")
    build_from_directory(edge.store, tmp / "ws", name)
    return name


async def test_vm_snapshot_boots_as_container_and_grades_in_a_fresh_vm(  # noqa: ANN001
        edge, names: list[str], tmp_path: Path) -> None:
    repo = repo_layer(edge, names, tmp_path)
    src = await edge.create(SandboxSpec(image=BB, layers=[repo], backend="microvm",
                                        resources=VM), "p")
    await sh(edge, src.id, CHANGES)
    # a file of the layer changed: copied up with its xattr, which the snapshot keeps
    await sh(edge, src.id, f"echo more >> /{TAGGED} && touch /{MANY}/*")
    # touches a repository of a lower layer: completed from the merged view, then scrubbed
    await sh(edge, src.id, "echo touched > /work/repo/.git/description")
    name = new_name(names)
    res = await edge.snapshot(src.id, SnapshotSpec(name=name, exclude=["/work/secret.txt"]),
                              "p")
    assert res.whiteouts >= 1 and res.scrubbed >= 1 and res.layers[-1] == res.layer
    assert res.git_repos_scrubbed == ["/work/repo"]
    tagged = edge.layer_mounts.ensure_mounted(res.layer) / TAGGED
    assert tagged.read_text() == "tagged\nmore\n"
    assert os.getxattr(tagged, "user.rollbox.test") == b"kept"
    last = tagged.parent.parent / MANY / f"f{MANY_FILES - 1}"
    assert os.getxattr(last, "user.rollbox.n") == b"%d" % (MANY_FILES - 1) + b"." * 500
    copy = await edge.create(SandboxSpec(image=name), "p")  # a container
    assert copy.backend == "container"
    await sh(edge, copy.id, EXPECTED)
    # the grader: a fresh VM of the pristine layers + only the declared file; the source's
    # other changes (and anything it did to its own tools) are not there
    await sh(edge, src.id, "echo 'exit 0' > /bin/true-forged; echo forged > /work/other.txt")
    grade = await edge.grade(src.id, GradeSpec(
        cmd="test \"$(cat /work/new.txt)\" = hello && test ! -e /work/other.txt "
            "&& test ! -e /bin/true-forged && test -e /etc/group && echo graded",
        files=["/work/new.txt"]), "p")
    assert grade.result.exit_code == 0, grade.result
    assert "graded" in grade.result.stdout and grade.result.guest_reported
    assert grade.grader_id != src.id
    for sid in (src.id, copy.id):
        await edge.delete(sid)


async def test_container_snapshot_boots_as_vm(edge, names: list[str]) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB), "p")
    await sh(edge, src.id, CHANGES)
    name = new_name(names)
    await edge.snapshot(src.id, SnapshotSpec(name=name, exclude=["/work/secret.txt"]), "p")
    vm = await edge.create(SandboxSpec(image=name, backend="microvm", resources=VM), "p")
    await sh(edge, vm.id, EXPECTED)
    for sid in (src.id, vm.id):
        await edge.delete(sid)
