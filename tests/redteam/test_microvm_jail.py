"""Red team F41: QEMU itself not jailed, QMP or other VMs' sockets reachable from a VM or from
another sandbox's QEMU, the host reached through emulated devices.

The checker (``qemu_jail.problems``) is proved able to fail on QEMU processes started here
without one layer of the jail at a time (host root, no ``-sandbox``, the host's namespaces);
then every microVM sandbox's QEMU must pass it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator


from rollbox.backends.microvm.backend import MicroVMBackend
from tests.integration.test_microvm_backend import backend, guest, spec  # noqa: F401 - fixtures
from tests.redteam import qemu_jail
from tests.redteam.conftest import needs_root

pytestmark = needs_root
QEMU = "/usr/bin/qemu-system-x86_64"
# Stopped before the first instruction (-S): no kernel needed, nothing runs in the guest.
IDLE_QEMU = [QEMU, "-M", "microvm", "-nodefaults", "-no-user-config", "-display", "none",
             "-S", "-m", "32"]
SANDBOX = ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,"
           "resourcecontrol=deny"]


@contextlib.contextmanager
def qemu(prefix: list[str], extra: list[str]) -> Iterator[int]:
    """Start QEMU (under ``prefix``: setpriv/unshare) and yield the QEMU process's pid."""
    p = subprocess.Popen(prefix + IDLE_QEMU + extra, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pid: int | None = None
    try:
        for _ in range(100):  # unshare --fork: QEMU is a child of the unshare process
            pids = [p.pid] + [int(x) for x in
                              open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
            pid = next((q for q in pids if open(f"/proc/{q}/comm").read().startswith("qemu")),
                       None)
            if pid is not None and qemu_jail.status(pid).get("Seccomp") is not None:
                time.sleep(0.3)  # past QEMU's start-up (the -sandbox filter is set early)
                break
            time.sleep(0.05)
        assert pid is not None and p.poll() is None, p.stderr.read() if p.stderr else ""
        yield pid
    finally:
        # unshare --fork leaves QEMU running when only unshare is killed: kill QEMU itself.
        if pid is not None and pid != p.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.kill()
        p.wait()


def test_f41_checker_fails_an_unjailed_qemu() -> None:
    # twin: plain QEMU as host root, no seccomp, the host's namespaces: every layer missing.
    with qemu([], []) as pid:
        found = qemu_jail.problems(qemu_jail.inspect(pid), "no-such-sandbox")
    text = "\n".join(found)
    for missing in ("uid/gid 0", "capabilities", "seccomp mode 0", "mnt, pid, net",
                    "not in a cgroup"):
        assert missing in text, found


def test_f41_checker_sees_each_layer_on_its_own() -> None:
    # -sandbox alone: seccomp filter (mode 2) and no_new_privs, still root in the host's ns.
    with qemu([], SANDBOX) as pid:
        r = qemu_jail.inspect(pid)
        found = "\n".join(qemu_jail.problems(r))
    assert r.seccomp == 2 and r.no_new_privs == 1, r
    assert "seccomp" not in found and "uid/gid 0" in found and "mnt, pid, net" in found
    # An unprivileged uid in its own mount/pid/net namespaces, no -sandbox: only seccomp and
    # no_new_privs are missing.
    prefix = ["unshare", "--mount", "--pid", "--net", "--fork", "--",
              "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
              "--inh-caps=-all", "--bounding-set=-all", "--"]
    with qemu(prefix, []) as pid:
        r = qemu_jail.inspect(pid)
        found = qemu_jail.problems(r)
    assert r.uids == (65534,) * 4 and not r.shared_ns and r.cap_eff == 0, r
    assert found == ["seccomp mode 0 (no -sandbox filter)", "no_new_privs not set"], found


def test_f41_visible_files_walks_the_process_mount_namespace() -> None:
    # The helper reads another process's view (its mount namespace), not this one's: a QEMU in
    # a fresh mount namespace with a tmpfs over /mnt sees the tmpfs's file, the host does not.
    marker = f"rbx-f41-{os.getpid()}"
    prefix = ["unshare", "--mount", "--fork", "--", "sh", "-c",
              f"mount -t tmpfs none /mnt && touch /mnt/{marker} && exec \"$@\"", "sh"]
    with qemu(prefix, []) as pid:
        seen = qemu_jail.visible_files(pid, "/mnt")
    assert f"/mnt/{marker}" in seen, seen[:20]
    assert not os.path.exists(f"/mnt/{marker}")


# Run as a separate process: optionally enter a QEMU's mount and network namespaces and take
# its host uid/gid (what code that took over that QEMU would have), then try every target:
# "connect:<path>" a unix socket, "open:<path>" read a file, "list:<path>" a directory.
PROBE = r"""
import ctypes, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
args = json.loads(sys.argv[1])
if args["as_jail"]:
    fds = {ns: os.open(f"/proc/{args['pid']}/ns/{ns}", os.O_RDONLY) for ns in ("net", "mnt")}
    for ns, fd in fds.items():
        if libc.setns(fd, 0) != 0:
            raise SystemExit(f"setns {ns}: {os.strerror(ctypes.get_errno())}")
    os.setgroups([])
    os.setresgid(args["uid"], args["uid"], args["uid"])
    os.setresuid(args["uid"], args["uid"], args["uid"])
out = {}
for t in args["targets"]:
    kind, _, path = t.partition(":")
    try:
        if kind == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            s.connect(path)
            s.close()
        elif kind == "open":
            os.close(os.open(path, os.O_RDONLY))
        else:
            os.listdir(path)
        out[t] = "ok"
    except OSError as e:
        out[t] = e.strerror
print(json.dumps(out))
"""


def probe(targets: list[str], *, as_jail_of: tuple[int, int] | None) -> dict[str, str]:
    args = {"targets": targets, "as_jail": as_jail_of is not None,
            "pid": as_jail_of[0] if as_jail_of else 0, "uid": as_jail_of[1] if as_jail_of else 0}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


async def test_f41_other_vms_sockets_and_disks_unreachable_from_a_qemu(
        backend: MicroVMBackend) -> None:  # noqa: F811 - the fixture
    a = await backend.create("vmtest-f41a", spec())
    try:
        b = await backend.create("vmtest-f41b", spec())
        try:
            for vm in (a, b):  # every VM's QEMU passes the checker
                assert qemu_jail.qemu_pids_of(vm.id) == [vm.pid]
                assert qemu_jail.problems(qemu_jail.inspect(vm.pid), vm.id) == []
            b_files = [str(b.agent_path), str(b.qmp_path), str(b.jail.socket_path("console"))]
            targets = ([f"connect:{p}" for p in b_files] + [f"list:{b.jail.dir}",
                       f"list:/proc/{b.pid}/root/", f"open:/proc/{b.pid}/root{'/vm/rw.img'}"])
            # twin: host root in the host's namespaces reaches every one of B's sockets
            twin = probe(targets, as_jail_of=None)
            assert all(twin[f"connect:{p}"] == "ok" for p in b_files), twin
            # A's QEMU (its namespaces and uid): nothing of B, by any path
            got = probe(targets, as_jail_of=(a.pid, a.host_uid))
            assert not [t for t, v in got.items() if v == "ok"], got
            # nor anything of the host's state: its own jail view has only its own files
            seen = qemu_jail.visible_files(a.pid, "/vm")
            assert b.id not in "".join(seen) and not any(
                s.endswith(".sock") for s in seen), seen
        finally:
            await backend.destroy(b)
    finally:
        await backend.destroy(a)
    assert backend.leftovers(a.id) == [] and backend.leftovers(b.id) == []
