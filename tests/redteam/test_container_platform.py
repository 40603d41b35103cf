"""Red team A1/A2 + hidden paths: the platform's own exec path, agent binary, control channel and
files the task hides, attacked from inside a real container sandbox."""
from __future__ import annotations

import pytest

from rollbox.errors import NotFound
from tests.conftest import needs_python
from tests.redteam.conftest import BB, PY, Boxes, container_only, needs_root

pytestmark = needs_root


async def test_a1_overwritten_shell_does_not_hijack_platform(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    # The agent replaces the shell and helpers with a script that logs "pwned" (the last
    # command uses busybox's builtin printf/chmod-free path: cp of a script prepared first).
    r = await boxes.run(sid, "printf '#!/bin/busybox sh\\necho pwned >> /tmp/pwned\\n' > /tmp/evil"
                        " && busybox chmod 755 /tmp/evil && for f in /bin/sh /bin/cat /bin/ls /bin/tar; do"
                        " rm -f $f; busybox cp /tmp/evil $f; done; echo done")
    assert r.stdout == "done\n", r
    assert b"pwned" in await boxes.edge.file_read(sid, "/bin/sh", 1 << 20)  # really replaced
    # The platform's file operations run on the host side, never through the sandbox's shell.
    await boxes.edge.file_write(sid, "/tmp/after.txt", b"platform data", 0o644)
    assert await boxes.edge.file_read(sid, "/tmp/after.txt", 1 << 20) == b"platform data"
    listing = await boxes.edge.file_list(sid, "/tmp")
    assert {"after.txt", "evil"} <= {f.name for f in listing}
    with pytest.raises(NotFound):
        await boxes.edge.file_read(sid, "/tmp/pwned", 1 << 20)  # nothing ran the fake shell
    # The agent binary is not in the sandbox's tree: planting a file where an agent might be
    # changes nothing, and the agent (PID 1) still serves execs.
    r = await boxes.run(sid, ["/bin/busybox", "sh", "-c",
                              "mkdir -p /.rollbox && busybox cp /tmp/evil /.rollbox/rollbox-agent"
                              " && echo planted"])
    assert r.stdout == "planted\n", r
    r = await boxes.run(sid, ["/bin/busybox", "echo", "alive"])
    assert r.stdout == "alive\n"
    with pytest.raises(NotFound):
        await boxes.edge.file_read(sid, "/tmp/pwned", 1 << 20)


@container_only("in a VM the agent is the guest's own init: guest root may read or replace it (the guest is its own; F40 covers what that buys)")
async def test_a1_agent_binary_not_in_the_tree(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    # runc execs the agent from an inherited fd that the agent closes first: no path inside
    # the sandbox (its tree, /proc/1/exe, /proc/1/fd) leads to the platform's binary.
    r = await boxes.run(sid, "ls -a /; echo ---; find / -xdev -name 'rollbox-agent*' 2>/dev/null;"
                        " echo ---; cat /proc/1/exe > /dev/null; echo exe=$?;"
                        " cat /proc/1/fd/4 > /dev/null; echo fd=$?; cat /proc/1/cmdline; echo")
    tree, found, rest = r.stdout.split("---\n")
    assert ".rollbox" not in tree.split() and found.strip() == "", r
    assert "exe=0" not in rest and "fd=0" not in rest, r
    assert "/proc/self/fd/4" in rest, r


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_a1_agent_binary_readable_unhardened(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hardened=False)
    # twin: with all capabilities (CAP_SYS_PTRACE among them) the agent's exe is readable
    # through /proc/1/exe — what the hardened sandbox refuses above.
    r = await boxes.run(sid, "cat /proc/1/exe | wc -c")
    assert int(r.stdout) > 10000, r


async def test_landlock_keeps_the_tree_usable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "set -e; cat /etc/passwd >/dev/null; echo hi > /tmp/x; "
                        "cat /tmp/x; mkdir -p /root/a/b; echo y > /root/a/b/f; mv /root/a/b/f "
                        "/tmp/f2; ln -s /tmp/f2 /tmp/l; cat /tmp/l; ls /proc/self/fd >/dev/null;"
                        " echo ok > /dev/null; mkdir -p /newtop/d && echo n > /newtop/d/f &&"
                        " cat /newtop/d/f")
    assert r.exit_code == 0 and r.stdout == "hi\ny\nn\n", r
    # A new top-level directory is usable at once and by the next command.
    r = await boxes.run(sid, "echo z > /newtop/f && cat /newtop/f", user="0")
    assert r.stdout == "z\n", r
    r = await boxes.run(sid, "cat /etc/passwd", user="1000")
    assert r.exit_code == 0, r


async def test_hidden_paths_absent_for_commands_visible_to_platform(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hidden=("/etc/group",))
    r = await boxes.run(sid, "cat /etc/group | wc -c; cat /etc/passwd | wc -c")
    assert r.stdout.split()[0] == "0" and int(r.stdout.split()[1]) > 0, r
    # The platform (host-side file API, e.g. to grade) still sees the real file.
    assert b"root" in await boxes.edge.file_read(sid, "/etc/group", 1 << 20)
    # Unmounting the mask, renaming it away or hard-linking it out gets nothing.
    r = await boxes.run(sid, UNDO_MASK)
    assert r.stdout.strip() == "0", r
    if boxes.kind == "microvm":  # the guest's root: not out of its chroot by init's root either
        r = await boxes.run(sid, ESCAPE_CHROOT)
        assert r.stdout.split()[0] == "0" and "chroot=0" not in r.stdout, r
    sid = await boxes.make(BB, hidden=("/etc",))
    r = await boxes.run(sid, "ls -A /etc | wc -l; cat /etc/passwd; echo rc=$?; "
                        "echo x > /etc/new; echo w=$?")
    assert r.stdout.startswith("0\n") and "rc=1" in r.stdout and "w=0" not in r.stdout, r


UNDO_MASK = ("umount /etc/group; mv /etc/group /etc/g2; mv /etc /e2; "
             "cat /etc/group /etc/g2 /e2/group /e2/g2 2>/dev/null | wc -c")
ESCAPE_CHROOT = ("cat /proc/1/root/layers/*/etc/group /proc/1/root/view/etc/group 2>/dev/null"
                 " | wc -c; chroot / true; echo chroot=$?")


@pytest.mark.microvm_slow
async def test_vm_hidden_path_mask_alone(vms: Boxes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer of a guest's hidden path on its own: without the mask the file is readable
    (so the mask is what hides it); with the mask but the guest's root keeping every
    capability (the unhardened twin), the root unmounts it (so the capability drop is what
    keeps it) and leaves the chroot."""
    full = await vms.make(BB, hidden=("/etc/group",), hardened=False)
    r = await vms.run(full, "cat /etc/group | wc -c")
    assert r.stdout.strip() == "0", r  # masked
    r = await vms.run(full, UNDO_MASK)
    assert int(r.stdout) > 0, r  # the mask undone by a root that may unmount
    r = await vms.run(full, ESCAPE_CHROOT)
    assert int(r.stdout.split()[0]) > 0 and "chroot=0" in r.stdout, r
    monkeypatch.setattr("rollbox.backends.microvm.backend.mask_hidden", _no_mask)
    bare = await vms.make(BB, hidden=("/etc/group",))
    r = await vms.run(bare, "cat /etc/group | wc -c")
    assert int(r.stdout) > 0, r  # no mask: the dropped capabilities alone hide nothing


async def _no_mask(*_a: object) -> None:
    pass


async def test_masked_hidden_path_leaves_its_parent_usable(boxes: Boxes) -> None:
    # The mask hides /etc/group; Landlock then only locks the mount topology, so a directory
    # made next to it is usable in the same command (pip's <name>.egg-info, .pytest_cache).
    sid = await boxes.make(BB, hidden=("/etc/group",))
    r = await boxes.run(sid, "mkdir /etc/newd && echo x > /etc/newd/f && cat /etc/newd/f; "
                        "cat /etc/group | wc -c")
    assert r.stdout == "x\n0\n", r


async def test_hidden_path_written_after_start_stays_hidden(boxes: Boxes) -> None:
    """Absent from the image: made (empty) before start, so it is masked, and what the
    platform writes there later stays under the mask."""
    sid = await boxes.make(BB, hidden=("/task/tests",))
    await boxes.edge.file_mkdir(sid, "/task/tests", True)
    await boxes.edge.file_write(sid, "/task/tests/test_x.py", b"ANSWER = 42\n", 0o644)
    r = await boxes.run(sid, "cat /task/tests/test_x.py; echo rc=$?; ls /task/tests; "
                        "echo ls=$?; cp -r /task /tmp/t; cat /tmp/t/tests/test_x.py")
    assert "ANSWER" not in r.stdout and "rc=0" not in r.stdout, r
    assert "\nls=0\n" in r.stdout, r  # listable and empty: the mask, not Landlock's refusal
    assert b"ANSWER" in await boxes.edge.file_read(sid, "/task/tests/test_x.py", 1 << 20)
    if boxes.kind != "container":
        return  # the twin below is a container-backend switch
    # twin: without Landlock the file is readable
    twin = await boxes.make(BB, hardened=False, hidden=("/task/tests",))
    await boxes.edge.file_mkdir(twin, "/task/tests", True)
    await boxes.edge.file_write(twin, "/task/tests/test_x.py", b"ANSWER = 42\n", 0o644)
    r = await boxes.run(twin, "cat /task/tests/test_x.py")
    assert "ANSWER" in r.stdout, r


@container_only("patches the container backend's hidden-path set-up to test its Landlock layer alone")
async def test_landlock_hides_an_unmasked_hidden_path(boxes: Boxes,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The Landlock layer on its own: a hidden path that could not be made before start has
    no mask; written later by the platform, it is still unreadable for commands."""
    monkeypatch.setattr("rollbox.backends.container.sandbox._make_hidden_paths",
                        lambda *_a: None)
    sid = await boxes.make(BB, hidden=("/task/tests",))
    r = await boxes.run(sid, "test -e /task/tests; echo e=$?")
    assert r.stdout == "e=1\n", r  # really no mask: the path does not exist
    await boxes.edge.file_mkdir(sid, "/task/tests", True)
    await boxes.edge.file_write(sid, "/task/tests/test_x.py", b"ANSWER = 42\n", 0o644)
    r = await boxes.run(sid, "cat /task/tests/test_x.py; echo rc=$?; cp -r /task /tmp/t; "
                        "cat /tmp/t/tests/test_x.py; ln /task/tests/test_x.py /tmp/l; cat /tmp/l")
    assert "ANSWER" not in r.stdout and "rc=0" not in r.stdout, r


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_hidden_paths_unhardened_twin(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hardened=False, hidden=("/etc/group",))
    r = await boxes.run(sid, "cat /etc/group | wc -c")
    assert int(r.stdout) > 0


@container_only("guest root owns its virtio-serial port by design; what a guest can do with it is F40 (test_microvm_channel.py)")
async def test_a2_control_channel_unreachable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "ls -l /proc/1/fd 2>&1; echo rc=$?; head -c 100 /proc/1/environ; "
                        "echo env=$?; head -c 1 /proc/1/mem; echo mem=$?; "
                        "find / -xdev -type s 2>/dev/null | grep -c agent.sock")
    out = r.stdout
    assert "socket:" not in out, out  # non-dumpable PID 1: its fds are not listable
    assert "env=0" not in out.replace("env=0\n", "X") or "ROLLBOX" not in out
    assert "mem=0" not in out
    assert out.strip().endswith("0")  # no agent socket in the sandbox's tree
    r = await boxes.run(sid, "cat /proc/1/cmdline; ls /run /var/log 2>/dev/null | grep -ci "
                        "rollbox || true")
    assert "agent.log" not in r.stdout


@needs_python
@container_only("guest root owns its virtio-serial port by design; what a guest can do with it is F40 (test_microvm_channel.py)")
async def test_a2_forged_connection_fails(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    code = (
        "import socket, os\n"
        "ok = 0\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        s = socket.socket(fileno=os.dup(fd)); ok += 1\n"
        "    except OSError: pass\n"
        "for p in ['/proc/1/fd/3', '/proc/1/root/proc/1/fd/3']:\n"
        "    try: os.open(p, os.O_RDWR); ok += 1\n"
        "    except OSError: pass\n"
        "print(ok)\n")
    r = await boxes.py(sid, code)
    assert r.stdout.strip() == "0", r
