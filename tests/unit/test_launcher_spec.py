"""The native launcher's input (backends/container/launcher.py): bundle.py's OCI config as
records, read back the way launcher.c reads them; what it can not carry out is refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox.backends.container import bundle
from rollbox.backends.container.launcher import CAP_NUMBERS, launcher_error, spec_bytes
from rollbox.backends.container.masks import NodeMask
from rollbox.errors import InfraError
from rollbox.isolation import cgroups
from rollbox.isolation.syscalls import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY
from rollbox.models import Resources

FIELDS = {"root": 1, "pidfile": 1, "netns": 1, "hostname": 1, "uid_map": 1, "gid_map": 1,
          "cwd": 1, "propagation": 1, "oom_score_adj": 1, "no_new_privs": 0, "cgroup": 1,
          "cgset": 2, "mount": 5, "device": 2, "symlink": 2, "masked": 1, "readonly": 1,
          "rlimit": 3, "caps": 5, "arg": 1, "env": 1, "exec_fd": 1, "subdir": 3,
          "mask_dir": 1}


def records(spec: bytes) -> list[tuple[str, ...]]:
    """launcher.c's reader: an op, its fixed number of fields; seccomp: a length, raw bytes."""
    out, pos = [], 0

    def field() -> str:
        nonlocal pos
        end = spec.index(b"\0", pos)
        value = spec[pos:end].decode()
        pos = end + 1
        return value

    while pos < len(spec):
        op = field()
        if op == "seccomp":
            n = int(field())
            out.append((op, str(n)))
            pos += n
            continue
        out.append((op, *(field() for _ in range(FIELDS[op]))))
    return out


def config(**kw) -> dict:  # noqa: ANN003
    args = dict(sandbox_id="t-1", rootfs="/run/x/merged", host_uid=1 << 20,
                netns_path="/run/netns/rollbox-t-1", cgroups_path="/rollbox/t-1",
                resources=Resources(cpus=1, memory_mib=128, disk_mib=64), hostname="t-1",
                mask=NodeMask(Path("/run/x/mask")))
    args.update(kw)
    return bundle.oci_config(**args)


needs_hybrid = pytest.mark.skipif(cgroups.is_pure_v2(), reason="the launcher needs v1 controllers")


@needs_hybrid
def test_every_part_of_the_config_becomes_a_record() -> None:
    recs = records(spec_bytes(config(), Path("/run/x/pid")))
    ops = [r[0] for r in recs]
    assert ("root", "/run/x/merged") in recs and ("netns", "/run/netns/rollbox-t-1") in recs
    assert ("uid_map", f"0 {1 << 20} 65536\n") in recs
    assert ("hostname", "t-1") in recs and ("no_new_privs",) in recs
    # one cgroup per hierarchy, the limits in the controllers' own files
    assert len([r for r in recs if r[0] == "cgroup"]) == len(cgroups.hierarchies())
    sets = {Path(r[1]).name: r[2] for r in recs if r[0] == "cgset"}
    assert sets["memory.limit_in_bytes"] == str(128 << 20)
    assert sets["cpu.cfs_quota_us"] == "100000" and sets["pids.max"] == "1024"
    assert [r[2] for r in recs if r[0] == "cgset" and r[1].endswith("devices.deny")] == ["a"]
    # mounts in the config's order, options split into flags and data
    mounts = [r for r in recs if r[0] == "mount"]
    assert [m[1] for m in mounts[:2]] == ["/proc", "/dev"]
    proc = mounts[0]
    assert int(proc[4]) == MS_NOSUID | MS_NOEXEC | MS_NODEV and proc[5] == ""
    assert mounts[1][5] == "mode=755,size=65536k"
    assert ("masked", "/proc/kcore") in recs and ("readonly", "/proc/sys") in recs
    caps = next(r for r in recs if r[0] == "caps")
    want = sum(1 << CAP_NUMBERS[c] for c in bundle.CAPABILITIES)
    assert [int(c) for c in caps[1:]] == [want, want, want, 0, 0]
    assert ("arg", "/proc/self/fd/4") in recs and ("env", "HOME=/root") in recs
    # seccomp last, a whole number of BPF instructions
    assert ops[-1] == "seccomp" and int(recs[-1][1]) % 8 == 0 and int(recs[-1][1]) > 0


@needs_hybrid
def test_a_bind_becomes_a_bind_with_its_flags_and_the_twin_has_no_filter() -> None:
    from rollbox.backends.container.cpuview import CpuView

    view = CpuView(cpus=[0], root=Path("/run/x"))
    recs = records(spec_bytes(config(cpu_view=view, hardened=False), Path("/run/x/pid")))
    binds = [r for r in recs if r[0] == "mount" and r[1] == "/proc/cpuinfo"]
    assert binds and int(binds[0][4]) == MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV
    assert "seccomp" not in [r[0] for r in recs]
    assert ("no_new_privs",) not in recs
    caps = next(r for r in recs if r[0] == "caps")
    assert int(caps[5]) == int(caps[1])  # ambient = every capability (the twin)


@needs_hybrid
@pytest.mark.parametrize("change", [
    lambda c: c["linux"]["resources"].update(hugepageLimits=[{"pageSize": "2MB", "limit": 1}]),
    lambda c: c["linux"]["resources"]["memory"].update(reservation=1),
    lambda c: c["process"].update(terminal=True),
    lambda c: c["linux"]["namespaces"].append({"type": "time"}),
    lambda c: c["process"]["capabilities"]["bounding"].append("CAP_NOT_A_CAP"),
    lambda c: c["mounts"].append({"destination": "/x", "type": "tmpfs", "source": "t",
                                  "options": ["rshared"]}),
    lambda c: c.update(hostname="a\0b"),
    lambda c: c["linux"]["maskedPaths"].append("/a\0b"),  # a field of a cached block
    lambda c: c["annotations"].update({"org.example.x": "1"}),
])
def test_what_the_launcher_can_not_carry_out_is_refused(change) -> None:  # noqa: ANN001
    c = config()
    change(c)
    with pytest.raises(InfraError):
        spec_bytes(c, Path("/run/x/pid"))


@needs_hybrid
def test_each_spec_has_its_own_records_where_the_shared_ones_are_cached() -> None:
    """The records every sandbox shares are encoded once (launcher._block) and the seccomp
    program compiled once per profile: a sandbox with other hidden paths, another uid or the
    unhardened twin still gets exactly its own, in one process after the others."""
    first = records(spec_bytes(config(), Path("/run/x/pid")))
    hidden = records(spec_bytes(config(hidden_paths=["/task/tests"], host_uid=2 << 20),
                                Path("/run/y/pid")))
    again = records(spec_bytes(config(), Path("/run/x/pid")))
    weak = records(spec_bytes(config(hardened=False), Path("/run/x/pid")))
    assert again == first
    assert ("masked", "/task/tests") in hidden and ("masked", "/task/tests") not in first
    assert ("uid_map", f"0 {2 << 20} 65536\n") in hidden and ("pidfile", "/run/y/pid") in hidden
    own = ("masked", "uid_map", "gid_map", "pidfile", "env")  # env: the Landlock paths
    assert [r for r in first if r[0] not in own] == [r for r in hidden if r[0] not in own]
    assert not [r for r in weak if r[0] in ("masked", "seccomp")]


def test_the_seccomp_program_is_compiled_for_the_profile_asked() -> None:
    """compile_bpf's cache compares whole profiles: a changed rule is a new program, the
    unchanged profile the same one, whichever came first."""
    from rollbox.isolation import seccomp

    base = seccomp.profile()
    program = seccomp.compile_bpf(base)
    other = seccomp.profile()
    other["syscalls"].append({"names": ["getpid"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1})
    changed = seccomp.compile_bpf(other)
    assert changed != program and len(changed) > len(program)
    assert seccomp.compile_bpf(seccomp.profile()) == program
    assert seccomp.compile_bpf(other) == changed


def test_no_superblock_of_its_own_for_shm_and_the_masks() -> None:
    """/dev/shm (a tmpfs below the /dev tmpfs, the same size limit) becomes a 1777 directory
    of /dev bound onto itself with its own flags, in its place in the mount order; the
    masked dirs get the node's empty mask dir. Anything else stays a tmpfs of its own."""
    recs = records(spec_bytes(config(), Path("/run/x/pid")))
    order = [r[1] for r in recs if r[0] in ("mount", "subdir")]
    assert order[:5] == ["/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue"]
    shm = next(r for r in recs if r[0] == "subdir")
    assert shm == ("subdir", "/dev/shm", str(MS_NOSUID | MS_NODEV | MS_NOEXEC), str(0o1777))
    assert ("mask_dir", "/run/x/mask/empty") in recs
    sys_ = next(r for r in recs if r[0] == "mount" and r[1] == "/sys")
    assert sys_[2:4] == ("bind", "/run/x/mask/empty")
    assert int(sys_[4]) == MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV
    for change in (lambda m: m["options"].append("size=1m"),  # not the /dev limit
                   lambda m: m["options"].append("nr_inodes=8"),  # an option beyond size
                   lambda m: m.update(destination="/run/shm")):  # no tmpfs at its parent
        c = config()
        shm_mount = next(m for m in c["mounts"] if m["destination"] == "/dev/shm")
        shm_mount["options"] = [o for o in shm_mount["options"] if not o.startswith("size=")] \
            + ["size=65536k"]
        change(shm_mount)
        recs = records(spec_bytes(c, Path("/run/x/pid")))
        assert "subdir" not in [r[0] for r in recs]
        assert shm_mount["destination"] in [r[1] for r in recs if r[0] == "mount"]


def test_the_launchers_message_becomes_step_and_errno() -> None:
    err = launcher_error(1, "rollbox-launcher: mount: bind /a at /b: No such file or directory "
                            "(errno 2)\nrollbox-launcher: cleanup: cgroup /sys/fs/cgroup/x left\n")
    assert err.details["step"] == "mount" and err.details["errno"] == 2
    assert err.details["left"] == ["cgroup /sys/fs/cgroup/x left"]
    assert launcher_error(1, "garbage").details["step"] == "unknown"


@needs_hybrid
def test_boot_id_hook_becomes_a_read_only_bind_and_other_hooks_are_refused() -> None:
    """runc binds each boot's id by a createContainer hook; the launcher, which runs no hooks,
    binds it itself, after the config's own mounts (over the /proc it mounted). Any other hook
    is refused, never dropped."""
    conf = config(boot_id="/run/x/boot_id")
    hook = conf["hooks"]["createContainer"][0]
    assert hook["args"][-2:] == ["/run/x/boot_id", "/run/x/merged" + bundle.BOOT_ID_PATH]
    mounts = [r for r in records(spec_bytes(conf, Path("/run/x/pid"))) if r[0] == "mount"]
    assert mounts[-1][1:4] == (bundle.BOOT_ID_PATH, "bind", "/run/x/boot_id")
    flags = int(mounts[-1][4])
    assert flags & MS_BIND and flags & MS_RDONLY and flags & MS_NOSUID and flags & MS_NOEXEC
    assert [r[1] for r in mounts].index("/proc") < len(mounts) - 1
    assert bundle.boot_id_source(config()) is None
    for bad in ({"prestart": [hook]},
                {"createContainer": [{**hook, "path": "/tmp/evil"}]},
                {"createContainer": [hook, hook]}):
        with pytest.raises(InfraError):
            spec_bytes({**conf, "hooks": bad}, Path("/run/x/pid"))


def test_a_pure_v2_host_refuses_the_native_runtime_at_start(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """No device filter on cgroup v2 (a BPF program the launcher does not attach): the backend
    does not start with it, instead of creating sandboxes without one."""
    from rollbox.backends.container.launcher import NativeRuntime

    binary = tmp_path / "rollbox-launcher"
    binary.write_bytes(b"")
    monkeypatch.setattr(cgroups, "is_pure_v2", lambda: True)
    with pytest.raises(InfraError, match="ROLLBOX_RUNTIME=runc"):
        NativeRuntime(binary)
    monkeypatch.setattr(cgroups, "is_pure_v2", lambda: False)
    assert NativeRuntime(binary).name == "native"
    with pytest.raises(InfraError, match="make native"):
        NativeRuntime(tmp_path / "missing")
