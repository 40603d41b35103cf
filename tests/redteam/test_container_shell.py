"""Red team A1, the shell of command strings: the sandbox's root replaces every shell it can
reach (/bin/sh, /bin/bash, /usr/bin/bash, a `bash` first in PATH) with a trojan that logs that
it ran and forges the output and exit code. String commands run under the platform shell
(bash-static, exec'd by the agent from an fd), so they still give the true output and exit code
and the trojan never runs. The twins run the same attack against the old form (`/bin/sh -c` of
the sandbox), where it must succeed."""
from __future__ import annotations

import pytest

from rollbox.errors import NotFound
from tests.conftest import have_image
from tests.redteam.conftest import BB, Boxes, container_only, needs_root

DEB = "debian:bookworm"
pytestmark = [needs_root, pytest.mark.skipif(not have_image(DEB), reason=f"{DEB} not built")]

# The trojan: a script run by the sandbox's real dash (saved first), logging and forging.
TROJAN = "#!/opt/real/sh\necho ran >> /tmp/pwned\necho forged\nexit 0\n"
# Replace every shell a string command could be interpreted by, through argv (no string).
ATTACK = ("set -e; mkdir -p /opt/real; cp /bin/dash /opt/real/sh; "
          "printf '%s' \"$1\" > /opt/trojan; chmod 755 /opt/trojan; "
          "for f in /bin/sh /bin/dash /usr/bin/bash /usr/local/bin/bash /usr/local/bin/sh; do "
          "rm -f $f; cp /opt/trojan $f; done; ls -l /bin/bash /usr/bin/sh; echo replaced")
TRUE_CMD = "echo true-output; echo to-stderr >&2; exit 3"


async def _attack(boxes: Boxes, sid: str) -> None:
    r = await boxes.run(sid, ["/bin/dash", "-c", ATTACK, "sh",
                              TROJAN])
    assert r.exit_code == 0 and r.stdout.endswith("replaced\n"), r
    # really replaced: the sandbox's own shells are now the trojan (usrmerge: /bin/bash is
    # /usr/bin/bash)
    for path in ("/bin/sh", "/bin/bash", "/usr/local/bin/bash"):
        assert b"forged" in await boxes.edge.file_read(sid, path, 1 << 20), path


async def _pwned(boxes: Boxes, sid: str) -> bool:
    try:
        return b"ran" in await boxes.edge.file_read(sid, "/tmp/pwned", 1 << 20)
    except NotFound:
        return False


async def test_a1_trojan_shells_never_interpret_string_commands(boxes: Boxes) -> None:
    sid = await boxes.make(DEB)
    await _attack(boxes, sid)
    r = await boxes.run(sid, TRUE_CMD)
    assert (r.stdout, r.stderr, r.exit_code) == ("true-output\n", "to-stderr\n", 3), r
    # the command may still call the sandbox's tools (found in its PATH), and a nested shell
    # it names itself is the sandbox's (that is the user's choice, not the platform's)
    r = await boxes.run(sid, "cat /etc/debian_version >/dev/null && echo tools-ok; "
                        "bash -c 'echo nested'")
    assert r.stdout == "tools-ok\nforged\n", r
    assert await _pwned(boxes, sid)  # ...so the nested one ran the trojan, as asked
    await boxes.edge.file_write(sid, "/tmp/pwned", b"", 0o644)
    r = await boxes.run(sid, "echo $0 $BASH_VERSION; test -x /proc/$$/exe && echo exe-ok")
    assert r.stdout.startswith("bash 5.") and r.stdout.endswith("exe-ok\n"), r
    assert not await _pwned(boxes, sid)


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_a1_trojan_shells_unhardened_twin(boxes: Boxes) -> None:
    # twin: the same attack against the old form of a string command (the sandbox's /bin/sh)
    sid = await boxes.make(DEB)
    await _attack(boxes, sid)
    r = await boxes.run(sid, ["/bin/sh", "-c", TRUE_CMD])
    assert (r.stdout, r.exit_code) == ("forged\n", 0), r
    assert await _pwned(boxes, sid)


async def test_a1_string_commands_in_busybox(boxes: Boxes) -> None:
    # The platform shell is static: an image without bash or a libc runs string commands too.
    sid = await boxes.make(BB)
    r = await boxes.run(sid, "[[ -x /bin/busybox ]] && echo \"${BASH_VERSINFO[0]}\"; "
                        "ls / | grep -c bin; exit 7")
    assert (r.stdout, r.exit_code) == ("5\n1\n", 7), r


@container_only("the platform shell as runc's fd 5 in a non-dumpable agent; in a VM guest root may read its own initramfs")
async def test_a1_platform_shell_fd_unreachable(boxes: Boxes) -> None:
    sid = await boxes.make(BB)
    # The agent's fd of the platform shell: not listable or openable (non-dumpable PID 1);
    # commands do not inherit it (close-on-exec); the platform shell's own binary, visible as
    # /proc/<its pid>/exe, is the host's read-only root-owned copy: not writable, even as root.
    r = await boxes.run(sid, "readlink /proc/1/fd/5; echo link=$?; cat /proc/1/fd/5 >/dev/null; "
                        "echo open=$?; ls /proc/self/fd | tr '\\n' ' '; echo; "
                        "for f in /proc/$$/fd/*; do readlink $f; done | grep -c rollbox; "
                        "echo x >> /proc/$$/exe; echo write=$?; "
                        "cat /proc/$$/exe | wc -c")
    lines = r.stdout.splitlines()
    assert lines[0] == "link=1" and lines[1] == "open=1", r
    assert lines[2].split() == ["0", "1", "2", "3"], r  # ls's own directory fd is 3
    assert lines[3] == "0" and lines[4] == "write=1" and int(lines[5]) > 1_000_000, r


@container_only("unhardened twin of a container layer (hardened=False is a container-backend switch)")
async def test_a1_platform_shell_fd_unhardened_twin(boxes: Boxes) -> None:
    # twin: with every capability (CAP_SYS_PTRACE) the agent's fd 5 is reachable, which the
    # hardened sandbox refuses above; even then the shell binary can not be written.
    sid = await boxes.make(BB, hardened=False)
    r = await boxes.run(sid, "cat /proc/1/fd/5 | wc -c; echo x >> /proc/1/fd/5; echo write=$?")
    out = r.stdout.splitlines()
    assert int(out[0]) > 1_000_000 and out[1] == "write=1", r


# An NSS module the sandbox plants: static glibc dlopens what /etc/nsswitch.conf names when bash
# looks a user up (it does at every start). Its constructor logs that it ran.
EVIL_NSS = r'''
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void pwn(void) {
    int fd = open("/tmp/pwned", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "ran\n", 4); close(fd); }
}
'''


async def _plant_nss(boxes: Boxes, sid: str, tmp_path) -> None:  # noqa: ANN001
    import asyncio
    import subprocess

    src = tmp_path / "evil.c"
    src.write_text(EVIL_NSS)
    lib = tmp_path / "libnss_evil.so.2"
    await asyncio.to_thread(subprocess.run, ["gcc", "-shared", "-fPIC", "-o", str(lib),
                                             str(src)], check=True)
    await boxes.edge.file_write(sid, "/lib/x86_64-linux-gnu/libnss_evil.so.2",
                                lib.read_bytes(), 0o755)
    await boxes.edge.file_write(sid, "/etc/nsswitch.conf",
                                b"passwd: evil files\ngroup: evil files\n", 0o644)


async def test_a1_platform_shell_loads_no_nss_module(boxes: Boxes, tmp_path) -> None:  # noqa: ANN001
    sid = await boxes.make(DEB)
    await _plant_nss(boxes, sid, tmp_path)
    r = await boxes.run(sid, "echo ~root ~nosuchuser; id -un")
    # the command's own tools (id) are the sandbox's, and load its module: that is its code
    assert r.stdout == "/root ~nosuchuser\nroot\n", r
    await boxes.edge.file_write(sid, "/tmp/pwned", b"", 0o644)
    r = await boxes.run(sid, "echo ~root ~nosuchuser; exit 4")
    assert (r.stdout, r.exit_code) == ("/root ~nosuchuser\n", 4), r
    assert not await _pwned(boxes, sid)


async def test_a1_stock_bash_static_loads_nss_module_twin(boxes: Boxes, tmp_path) -> None:  # noqa: ANN001
    # twin: the unpatched bash-static, given the same sandbox, runs the planted module
    from pathlib import Path

    sid = await boxes.make(DEB)
    await _plant_nss(boxes, sid, tmp_path)
    await boxes.edge.file_write(sid, "/opt/bash-static", Path("/bin/bash-static").read_bytes(),
                                0o755)
    r = await boxes.run(sid, ["/opt/bash-static", "-c", "echo ~nosuchuser"])
    assert await _pwned(boxes, sid), r
