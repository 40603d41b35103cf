"""Red team C (privilege) + F40 (garbling an agent channel): the agent-mediated sudo
(native/agent/agent.c "agent-mediated sudo", docs/security.md), attacked from inside real
sandboxes of e2b-base (labelled ``rollbox.sudo=1000``) and of an image without the label.

Each defence has a test that fails when it is removed: the label gate (no socket without it),
the SO_PEERCRED uid check (a uid outside the set runs nothing), the request parser (garbage,
oversized, wrong descriptors: the agent answers or drops that connection and keeps serving),
descriptor hygiene (every descriptor sent is closed: a pipe's reader sees EOF), and sandbox root
gained through sudo is the root of a root exec (no_new_privs, the same capabilities, the
caller's session cgroup)."""
from __future__ import annotations

import pytest

from rollbox.default_images import E2B_BASE_IMAGE
from tests.conftest import have_image
from tests.redteam.conftest import PY, Boxes, container_only, microvm_default, needs_root

pytestmark = [needs_root, pytest.mark.skipif(not have_image(E2B_BASE_IMAGE),
                                             reason=f"{E2B_BASE_IMAGE} not built (make images)")]

SOCK = "/dev/rollbox-sudo.sock"


@microvm_default
async def test_sudo_raises_to_the_root_of_a_root_exec(boxes: Boxes) -> None:
    sid = await boxes.make(E2B_BASE_IMAGE)
    try:
        r = await boxes.run(sid, "id -u; sudo whoami; sudo -u nobody id -u; sudo -n true; "
                            "echo rc=$?", user="user")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split() == ["1000", "root", "65534", "rc=0"]
        # Exit status, stdin/stdout passing, cwd, sudo's env handling (reset, VAR=x, -E, -i).
        r = await boxes.run(sid, "cd /tmp && echo piped | sudo sh -c 'cat; pwd; exit 7'; "
                            "echo rc=$?; FOO=leak sudo sh -c 'echo foo=${FOO:-none}'; "
                            "sudo FOO=set sh -c 'echo foo=$FOO'; FOO=kept sudo -E "
                            "sh -c 'echo foo=$FOO'; sudo -i pwd; sudo -- env | grep ^SUDO_USER",
                            user="user")
        assert r.stdout.splitlines() == ["piped", "/tmp", "rc=7", "foo=none", "foo=set",
                                         "foo=kept", "/root", "SUDO_USER=user"], r.stderr
        # The same root as a root exec: no_new_privs, capabilities, and the caller's cgroup.
        probe = "grep -E '^(NoNewPrivs|CapEff|Seccomp):' /proc/self/status; cat /proc/self/cgroup"
        as_root = await boxes.run(sid, probe)
        via_sudo = await boxes.run(sid, f"cat /proc/self/cgroup >&2; sudo sh -c \"{probe}\"",
                                   user="user")
        assert via_sudo.exit_code == 0, via_sudo.stderr
        lines = via_sudo.stdout.splitlines()
        if boxes.kind == "container":  # a guest's commands: capabilities dropped instead
            assert "NoNewPrivs:\t1" in lines
        assert [x for x in lines if not x.startswith("0::")] == [
            x for x in as_root.stdout.splitlines() if not x.startswith("0::")]
        unified = [x for x in lines if x.startswith("0::")]
        assert unified and unified == [
            x for x in via_sudo.stderr.splitlines() if x.startswith("0::")]
        # ^C reaches the command: the client forwards SIGINT to its process group.
        r = await boxes.run(sid, "sudo sleep 30 & p=$!; until pgrep -f '^sleep 30' >/dev/null; "
                            "do sleep 0.1; done; kill -INT $p; wait $p; echo rc=$?; "
                            "pgrep -f '^sleep 30' || echo none", user="user", timeout_s=60)
        assert r.stdout.split() == ["rc=130", "none"], r.stderr
    finally:
        await boxes.edge.delete(sid)


async def test_uid_outside_the_label_is_refused(boxes: Boxes) -> None:
    sid = await boxes.make(E2B_BASE_IMAGE)
    try:
        r = await boxes.run(sid, "sudo id -u", user="nobody")
        assert r.exit_code == 1 and r.stdout == ""
        assert "uid 65534 may not sudo" in r.stderr
        # A hand-made request gets the same answer before any byte is read.
        r = await boxes.run(sid, ["python3", "-c", RAW_REQUEST], user="nobody")
        assert r.stdout.strip() == "refused 1", r.stderr
        r = await boxes.run(sid, "sudo whoami", user="user")  # the allowed uid still can
        assert r.stdout.strip() == "root"
    finally:
        await boxes.edge.delete(sid)


RAW_REQUEST = r'''
import os, socket, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect("/dev/rollbox-sudo.sock")
req = b"rbsudo1\0" + struct.pack("<IIII", 0, 0, 1, 0) + b"/\0id\0"
try:
    socket.send_fds(s, [req], [0, 1, 2])
except OSError:
    pass
kind, value = struct.unpack_from("<ii", s.recv(512))
print("refused" if kind == 2 else "ran", value)
'''


async def test_no_socket_without_the_label(boxes: Boxes) -> None:
    sid = await boxes.make(PY)
    try:
        r = await boxes.run(sid, f"test -e {SOCK} && echo present || echo absent; "
                            "ls -a /dev | grep -c rollbox || true")
        assert r.stdout.split() == ["absent", "0"]
        # The client itself, run in that sandbox, finds nothing to talk to.
        client = (await boxes.run(sid, "true")).exit_code  # the sandbox is healthy
        assert client == 0
        from importlib import resources
        code = resources.files("rollbox.images").joinpath("sudo_client.py").read_text()
        r = await boxes.run(sid, ["python3", "-c", code, "whoami"], user="nobody")
        assert r.exit_code == 1 and "no privilege raising" in r.stderr
    finally:
        await boxes.edge.delete(sid)


GARBAGE = r'''
import os, socket, struct, select
P = "/dev/rollbox-sudo.sock"
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(P); return s
def answer(s):
    r, _, _ = select.select([s], [], [], 5)
    if not r:
        return "silent"
    try:
        d = s.recv(512)
    except OSError:  # reset: the agent closed with our packet unread
        return "closed"
    return "closed" if not d else "refused" if struct.unpack_from("<i", d)[0] == 2 else "ran"
rd, wr = os.pipe()
head = lambda argc, envc: b"rbsudo1\0" + struct.pack("<IIII", 0, 0, argc, envc)
cases = {
    "empty": (b"", []), "short": (b"rbsu", [wr]), "magic": (b"xxxxxxx\0" + b"\0" * 40, [wr] * 3),
    "nofds": (head(1, 0) + b"/\0id\0", []), "twofds": (head(1, 0) + b"/\0id\0", [wr, wr]),
    "manyfds": (head(1, 0) + b"/\0id\0", [wr] * 8), "argc0": (head(0, 0) + b"/\0", [wr] * 3),
    "argc_huge": (head(0xFFFFFFFF, 0xFFFFFFFF) + b"/\0", [wr] * 3),
    "unterminated": (head(2, 1) + b"/\0id", [wr] * 3),
    "uid-1": (b"rbsudo1\0" + struct.pack("<IIII", 0xFFFFFFFF, 0, 1, 0) + b"/\0id\0", [wr] * 3),
    "oversized": (head(1, 0) + b"/\0" + b"x" * 70000 + b"\0", [wr] * 3),
}
out = {}
for name, (data, fds) in cases.items():
    s = conn()
    try:
        if fds:
            socket.send_fds(s, [data], fds)
        else:
            s.send(data)
    except OSError as e:
        out[name] = "send:" + e.__class__.__name__
        s.close()
        continue
    out[name] = answer(s)
    s.close()
# A stalled client holding connections: the agent stays responsive for others.
held = [conn() for _ in range(40)]
for h in held:
    h.close()
# Signals from a client that never sent a request, and a packet after the request.
s = conn(); s.send(struct.pack("<i", 9)); out["signal_first"] = answer(s); s.close()
os.close(wr)
r, _, _ = select.select([rd], [], [], 10)
out["fds_closed"] = bool(r) and os.read(rd, 1) == b""
print(sorted(out.items()))
'''


async def test_malformed_requests_leave_the_agent_serving(boxes: Boxes) -> None:
    sid = await boxes.make(E2B_BASE_IMAGE)
    try:
        r = await boxes.run(sid, ["python3", "-c", GARBAGE], user="user", timeout_s=60)
        assert r.exit_code == 0, r.stderr
        got = dict(eval(r.stdout))  # noqa: S307 - our own probe's repr
        assert got.pop("fds_closed") is True  # every descriptor the agent got is closed
        assert got.pop("oversized") in ("refused", "closed")
        assert set(got.values()) <= {"refused", "closed"}, got  # nothing ran, nothing hung
        r = await boxes.run(sid, "sudo whoami; echo ok", user="user")
        assert r.stdout.split() == ["root", "ok"]
        assert (await boxes.run(sid, "echo alive")).stdout == "alive\n"
    finally:
        await boxes.edge.delete(sid)


@container_only("a microVM fork restores the source's agent, socket and all")
async def test_fork_children_serve_sudo_too(boxes: Boxes) -> None:
    """A container fork's children run new agents: each is told the label's uids again (the
    socket lives in /dev, never in the forked files)."""
    from rollbox.models import ForkSpec

    sid = await boxes.make(E2B_BASE_IMAGE)
    children: list[str] = []
    try:
        made = await boxes.edge.fork(sid, ForkSpec(n=1), "redteam")
        children = [c.id for c in made.children]
        r = await boxes.run(children[0], "sudo whoami", user="user")
        assert r.stdout.strip() == "root", r.stderr
        r = await boxes.run(children[0], "sudo id -u", user="nobody")
        assert r.exit_code == 1 and "may not sudo" in r.stderr
    finally:
        for cid in children:
            await boxes.edge.delete(cid)
        await boxes.edge.delete(sid)


DESCRIPTORS = r'''
import os, socket, struct, select, sys
P = "/dev/rollbox-sudo.sock"
rd, wr = os.pipe()
req = b"rbsudo1\0" + struct.pack("<IIII", 0, 0, 1, 0) + b"/\0id\0"
out = {}
for name, data, fds in [("nine", req, [wr] * 9), ("many", req, [wr] * 200),
                        ("split", req, ([wr] * 3, [wr] * 3)), ("empty", b"", [wr] * 20)]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(P)
    try:
        if isinstance(fds, tuple):  # two SCM_RIGHTS messages in one packet
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", *f))
                               for f in fds])
        else:
            socket.send_fds(s, [data], fds)
    except OSError:  # a refused uid's connection closed before its packet was sent
        out[name] = "closed"
        s.close()
        continue
    r, _, _ = select.select([s], [], [], 5)
    try:
        d = s.recv(512) if r else None
    except OSError:
        d = b""
    out[name] = ("silent" if d is None else "closed" if not d else
                 "refused" if struct.unpack_from("<i", d)[0] == 2 else "ran")
    s.close()
os.close(wr)
r, _, _ = select.select([rd], [], [], 10)
out["fds_closed"] = bool(r) and os.read(rd, 1) == b""
print(sorted(out.items()))
'''


async def test_descriptors_beyond_the_limit_leak_none(boxes: Boxes) -> None:
    """More descriptors than a request may carry (nine and 200: beyond the agent's control
    buffer, MSG_CTRUNC; two SCM_RIGHTS messages of three; twenty on an empty packet), from an
    allowed uid (the request's read) and from a refused one (the refusal's drain): nothing
    runs, and the agent's descriptor count (/proc/<agent>/fd, the host's view of a container's
    agent, the guest's /proc/1 of a microVM's) is no higher than before."""
    import asyncio
    import os
    import time

    sid = await boxes.make(E2B_BASE_IMAGE)

    async def agent_fds() -> int:
        if boxes.kind == "container":
            return len(os.listdir(f"/proc/{boxes.edge.live[sid].box.agent_pid}/fd"))
        r = await boxes.run(sid, "ls /proc/1/fd | wc -l")  # the guest's root: its own init
        assert r.exit_code == 0, r.stderr
        return int(r.stdout)

    try:
        assert (await boxes.run(sid, "sudo true; echo rc=$?", user="user")).stdout == "rc=0\n"
        # The fewest over a second: an exec's or a sudo connection's descriptors just ended
        # may still be held for a moment (the agent closes them on its own time).
        before = await agent_fds()
        for _ in range(5):
            await asyncio.sleep(0.2)
            before = min(before, await agent_fds())
        for user in ("user", "nobody"):
            r = await boxes.run(sid, ["python3", "-c", DESCRIPTORS], user=user, timeout_s=60)
            assert r.exit_code == 0, r.stderr
            got = dict(eval(r.stdout))  # noqa: S307 - our own probe's repr
            assert got.pop("fds_closed") is True, (user, got)  # the pipe's reader saw EOF
            assert set(got.values()) <= {"refused", "closed"}, (user, got)
        deadline = time.monotonic() + 10
        while (after := await agent_fds()) > before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert after <= before  # a leak would hold up to 8 of each packet's descriptors
        r = await boxes.run(sid, "sudo whoami", user="user")
        assert r.stdout == "root\n", r.stderr
    finally:
        await boxes.edge.delete(sid)
