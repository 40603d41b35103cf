"""The native runtime (backends/container/launcher.py, native/launcher/launcher.c) against runc.

Both runtimes start the same sandbox from the same OCI config: what the sandbox's commands see
of their own hardening (seccomp filter mode, no_new_privs, the capability sets, the uid map,
the hostname, the cgroup namespace) is read from /proc inside and must be the same, and what
bundle.py asks for; so are the superblocks a sandbox mounts of its own (fewer on native). A native launch that fails halfway (in the launcher's parent before the
clone, in its parent after it, in the child, and at a symlink where a mount goes) is a typed
InfraError naming the step and errno,
and leaves no process, mount, cgroup, netns or file behind (the edge fixture's teardown check,
and the host's cgroup trees and the edge's descendants checked here).
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest

from rollbox.backends.container import bundle
from rollbox.backends.container.launcher import CAP_NUMBERS
from rollbox.benchkit import own_superblocks
from rollbox.errors import InfraError
from rollbox.isolation import cgroups
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.integration.test_container_create_cancel import descendants

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root, runc and the launcher")]
BB = "busybox:test"
SPEC = SandboxSpec(image=BB, resources=Resources(cpus=1, memory_mib=128, disk_mib=64))


@pytest.fixture(params=["runc", "native"])
def edge_settings(request: pytest.FixtureRequest) -> dict:
    return {"runtime": request.param}


async def run(edge, sid: str, cmd: str) -> str:  # noqa: ANN001
    eid = await edge.exec_start(sid, ExecSpec(cmd=["sh", "-c", cmd]))
    res = await edge.exec_wait(sid, eid)
    assert res.exit_code == 0, res
    return res.stdout


def status_field(text: str, name: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith(name + ":"))


async def test_the_sandbox_sees_its_hardening_applied(edge) -> None:  # noqa: ANN001
    info = await edge.create(SPEC, "t")
    backend = edge.backends["container"]
    assert backend.runtime.name == edge.settings.runtime
    host_uid = backend.slots.host_uid(min(backend.slots.in_use()))
    want = sum(1 << CAP_NUMBERS[c] for c in bundle.CAPABILITIES)
    for who in ("self", "1"):  # a command, and the agent (pid 1 of the sandbox)
        st = await run(edge, info.id, f"cat /proc/{who}/status")
        assert status_field(st, "Seccomp") == "2", who
        assert status_field(st, "NoNewPrivs") == "1", who
        for cap in ("CapEff", "CapPrm", "CapBnd"):
            assert int(status_field(st, cap), 16) == want, (who, cap)
        assert int(status_field(st, "CapAmb"), 16) == 0
        assert status_field(st, "Uid").split() == ["0"] * 4
    # the filter is the profile's: a denied call fails with EPERM, an allowed one works
    out = await run(edge, info.id, "unshare -U true 2>&1; echo rc=$?; "
                    "cat /proc/self/uid_map; hostname; cat /proc/self/cgroup; "
                    "ulimit -c; ulimit -f")
    assert "rc=0" not in out and "Operation not permitted" in out
    lines = out.split("rc=", 1)[1].splitlines()[1:]
    assert lines[0].split() == ["0", str(host_uid), "65536"]
    assert lines[1] == info.id[:63]
    # rooted at the sandbox's own cgroup in every hierarchy (a cgroup namespace of its own)
    assert all(row.split(":", 2)[2] in ("/", "/x1", "/x2", "/x3") for row in lines[2:-2])
    assert lines[-2:] == ["0", str((SPEC.resources.disk_mib << 20) // 512)]
    await edge.delete(info.id)


async def test_the_sandbox_mounts_few_superblocks_of_its_own(edge) -> None:  # noqa: ANN001
    """Each superblock makes every memory cgroup of the host bigger (backends/container/
    masks.py): besides its overlay a sandbox holds its /proc, /dev tmpfs, devpts and mqueue
    (made with its ipc namespace anyway); /sys and the masked dirs are binds of the node's
    mask, /dev/shm a directory of /dev (native). runc mounts a tmpfs for /dev/shm and for
    each masked dir itself."""
    info = await edge.create(SandboxSpec(image=BB, hidden_paths=["/task/tests"],
                                         resources=SPEC.resources), "t")
    own = own_superblocks(await run(edge, info.id, "cat /proc/self/mountinfo"),
                          Path("/proc/self/mountinfo").read_text())
    want = {("overlay", "/"), ("proc", "/proc"), ("tmpfs", "/dev"), ("devpts", "/dev/pts"),
            ("mqueue", "/dev/mqueue")}
    if edge.settings.runtime == "runc":
        want |= {("tmpfs", "/dev/shm"), ("tmpfs", "/proc/acpi"), ("tmpfs", "/task/tests")}
    assert own == want
    mask_dev = os.stat(edge.backends["container"].mask.path).st_dev
    out = await run(edge, info.id, "stat -c %d /sys /proc/acpi /task/tests; stat -c %a /dev/shm")
    devs = [int(x) for x in out.split()[:3]]
    assert devs[0] == mask_dev and out.split()[3] == "1777"
    assert (devs[1] == devs[2] == mask_dev) == (edge.settings.runtime == "native")
    await edge.delete(info.id)


@pytest.fixture
def native(edge):  # noqa: ANN001, ANN201
    if edge.settings.runtime != "native":
        pytest.skip("a native-launcher failure (the runc run covers the sandbox's view)")
    return edge


def break_config(monkeypatch: pytest.MonkeyPatch, change) -> None:  # noqa: ANN001
    real = bundle.oci_config

    def broken(**kw):  # noqa: ANN003, ANN202
        config = real(**kw)
        change(config)
        return config

    monkeypatch.setattr(bundle, "oci_config", broken)


def bad_mount(config: dict) -> None:
    config["mounts"].append({"destination": "/opt/x", "type": "bind",
                             "source": "/nonexistent/rollbox-launcher-test",
                             "options": ["bind", "ro"]})


def symlinked_target(config: dict) -> None:
    """The image's tree has a symlink where a mount goes: refused, never followed (inside or
    outside the rootfs), and nothing made where it points."""
    os.symlink("/etc", os.path.join(config["root"]["path"], "evil"))
    config["mounts"].append({"destination": "/evil/x", "type": "tmpfs", "source": "tmpfs",
                             "options": ["nosuid"]})


def bad_cgroup(config: dict) -> None:
    config["linux"]["resources"]["cpu"]["cpus"] = "4095"  # no such cpu: cpuset.cpus refuses


def bad_mask_dir(config: dict) -> None:
    config["annotations"][bundle.MASK_ANNOTATION] = "/nonexistent/rollbox-mask"


def bad_uid_map(config: dict) -> None:
    for key in ("uidMappings", "gidMappings"):
        config["linux"][key][0]["size"] = 1 << 33  # the kernel refuses the map


@pytest.mark.parametrize("change, step, err", [
    (bad_mount, "mount", errno.ENOENT),          # in the child, after the clone
    (symlinked_target, "mount", errno.ELOOP),    # the same, a symlink in the image's tree
    (bad_mask_dir, "masked paths", errno.ENOENT),  # in the child, before pivot_root
    (bad_cgroup, "cgroup", None),                # in the parent, before the clone
    (bad_uid_map, "uid_map", errno.EINVAL),      # in the parent, the child waiting
])
async def test_a_launch_failing_halfway_is_typed_and_leaves_nothing(
        native, monkeypatch: pytest.MonkeyPatch, change, step: str,  # noqa: ANN001
        err: int | None) -> None:
    edge = native
    before = descendants(os.getpid())
    parent = edge.settings.cgroup_parent
    break_config(monkeypatch, change)
    with pytest.raises(InfraError) as exc:
        await edge.create(SPEC, "t")
    assert exc.value.details["step"] == step, exc.value.message
    if err is not None:
        assert exc.value.details["errno"] == err, exc.value.message
    else:
        assert exc.value.details["errno"] > 0
    assert "left" not in exc.value.details  # the launcher's own cleanup check
    assert not os.path.lexists("/etc/x")
    backend = edge.backends["container"]
    assert backend.host_sandbox_ids(edge.settings.sandbox_id_prefix) == set()  # other nodes: theirs
    assert cgroups.leftover(parent) == []
    assert descendants(os.getpid()) <= before
    assert backend.slots.in_use() == set()
    monkeypatch.undo()
    info = await edge.create(SPEC, "t")  # the node still starts sandboxes afterwards
    assert (await run(edge, info.id, "echo ok")).strip() == "ok"
    await edge.delete(info.id)


async def test_a_cpuset_parent_another_launcher_has_not_filled_yet_is_filled(native) -> None:  # noqa: ANN001
    """The first creates of a node at once: one launcher makes the v1 cpuset parent and then
    copies its cpus and mems down; another finds it made (EEXIST) before that copy. The
    second must fill it too, or its sandbox's cpuset, copied from the empty parent, refuses
    its cpus (the cgroup step) or, the first launcher's copy of the cpus landing in between,
    the init (ENOSPC at placement: seen in bench container's warm-up at c2). Here the parent
    is made empty beforehand, as the first launcher's mkdir leaves it (the launcher before the
    fix fails this at the cgroup step)."""
    edge = native
    parent = cgroups.ROOT / "cpuset" / edge.settings.cgroup_parent
    if not (cgroups.ROOT / "cpuset" / "cgroup.procs").exists():
        pytest.skip("no v1 cpuset hierarchy on this host")
    parent.mkdir()
    try:
        assert (parent / "cpuset.mems").read_text().strip() == ""  # as mkdir leaves it
        info = await edge.create(SPEC, "t")
        assert (await run(edge, info.id, "echo ok")).strip() == "ok"
        assert (parent / "cpuset.mems").read_text().strip() != ""
        assert (parent / "cpuset.cpus").read_text().strip() != ""
        await edge.delete(info.id)
    finally:
        with contextlib.suppress(OSError):
            parent.rmdir()  # the edge's own clean-up may have taken it already
