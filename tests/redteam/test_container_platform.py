"""Red team A1/A2 + hidden paths: the platform's own exec path, agent binary, control channel and
files the task hides, attacked from inside a real container sandbox."""
from __future__ import annotations

import pytest

from rollbox.errors import NotFound
from tests.conftest import needs_python
from tests.redteam.conftest import BB, PY, Boxes, needs_root

pytestmark = needs_root


async def test_a1_overwritten_shell_does_not_hijack_platform(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    # The agent replaces the shell and helpers with a script that logs "pwned" (the last
    # command uses busybox's builtin printf/chmod-free path: cp of a script prepared first).
    r = await boxes.run(sid, "printf '#!/bin/busybox sh\\necho pwned >> /tmp/pwned\\n' > /tmp/evil"
                        " && chmod 755 /tmp/evil && for f in /bin/sh /bin/cat /bin/ls /bin/tar; do"
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
    # The agent binary can't be replaced, removed or over-mounted.
    attack = ("busybox cp /tmp/evil /.rollbox/rollbox-agent; echo cp=$?; rm -f /.rollbox/rollbox-agent;"
              " echo rm=$?; mount -t tmpfs x /.rollbox; echo mount=$?")
    r = await boxes.run(sid, ["/bin/busybox", "sh", "-c", attack])
    assert r.stdout.count("=") == 3 and "=0" not in r.stdout, r
    # The agent (PID 1, from the read-only bind) still serves execs; an argv exec of the fake
    # shell runs the fake — the platform never runs a sandbox binary for its own work.
    r = await boxes.run(sid, ["/bin/busybox", "echo", "alive"])
    assert r.stdout == "alive\n"


async def test_a1_agent_binary_readonly_and_not_readable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "echo x > /.rollbox/rollbox-agent; echo rc=$?; "
                        "mv /.rollbox /.r2; echo mv=$?; "
                        "cat /.rollbox/rollbox-agent > /dev/null; echo read=$?; "
                        "/.rollbox/rollbox-agent; echo exec=$?; ls / >/dev/null; echo ls=$?")
    out = r.stdout
    assert "rc=0" not in out and "mv=0" not in out
    assert "read=1" in out  # Landlock: the platform's files are not readable
    assert "exec=126" in out or "exec=127" in out
    assert "ls=0" in out


async def test_a1_agent_binary_readable_unhardened(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hardened=False)
    r = await boxes.run(sid, "cat /.rollbox/rollbox-agent | wc -c")
    assert int(r.stdout) > 10000  # twin: without Landlock the binary is readable
    r = await boxes.run(sid, "echo x > /.rollbox/rollbox-agent")
    assert r.exit_code != 0  # still a read-only bind: never writable, hardened or not


async def test_landlock_keeps_the_tree_usable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "set -e; cat /etc/passwd >/dev/null; echo hi > /tmp/x; "
                        "cat /tmp/x; mkdir -p /root/a/b; echo y > /root/a/b/f; mv /root/a/b/f "
                        "/tmp/f2; ln -s /tmp/f2 /tmp/l; cat /tmp/l; ls /proc/self/fd >/dev/null;"
                        " echo ok > /dev/null; mkdir /newtop")
    assert r.exit_code == 0 and r.stdout == "hi\ny\n", r
    # A top-level directory made by an earlier command is fully usable by the next one.
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
    r = await boxes.run(sid, "umount /etc/group; mv /etc/group /etc/g2; mv /etc /e2; "
                        "cat /etc/group /etc/g2 /e2/group /e2/g2 2>/dev/null | wc -c")
    assert r.stdout.strip() == "0", r
    sid = await boxes.make(BB, hidden=("/etc",))
    r = await boxes.run(sid, "ls -A /etc | wc -l; cat /etc/passwd; echo rc=$?; "
                        "echo x > /etc/new; echo w=$?")
    assert r.stdout.startswith("0\n") and "rc=1" in r.stdout and "w=0" not in r.stdout, r


async def test_hidden_paths_unhardened_twin(boxes: Boxes) -> None:
    sid = await boxes.make(BB, hardened=False, hidden=("/etc/group",))
    r = await boxes.run(sid, "cat /etc/group | wc -c")
    assert int(r.stdout) > 0


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
