"""The pure parts of ``bench/vm.py`` (``rollbox bench vm``): the plain-QEMU peer's argv (the
backend's machine with the jail's paths and descriptors replaced), the screen-change and
still-screen waits of the input-to-screen phase, the summaries and ``--only``."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox.backends.microvm import qemu
from rollbox.backends.vm import machine
from rollbox.benchkit import load_bench


@pytest.fixture(scope="module")
def vm():  # noqa: ANN201
    return load_bench("vm")


def _plain(vm, spec: qemu.MachineSpec) -> list[str]:  # noqa: ANN001
    return vm.plain_argv(spec, binary="qemu", kernel=Path("/k/bzImage"),
                         initrd=Path("/k/initrd"),
                         layers=[Path(f"/l/{i}.erofs") for i in range(spec.layers)],
                         rw=Path("/t/rw.img"), agent=Path("/t/agent.sock"),
                         qmp_sock=Path("/t/qmp.sock"))


def test_plain_argv_is_the_backends_machine_with_host_paths(vm) -> None:  # noqa: ANN001
    spec = qemu.MachineSpec(cpus=1, memory_mib=256, layers=2, tsc_khz=2_000_000)
    ours, plain = machine.argv(spec, "qemu"), _plain(vm, spec)
    assert len(ours) == len(plain)
    # the same devices, machine, CPU and kernel command line
    for flag in ("-M", "-cpu", "-append", "-device", "-m", "-smp"):
        assert [b for a, b in zip(ours, ours[1:]) if a == flag] == \
               [b for a, b in zip(plain, plain[1:]) if a == flag], flag
    assert plain[plain.index("-kernel") + 1] == "/k/bzImage"
    assert plain[plain.index("-initrd") + 1] == "/k/initrd"
    drives = [b for a, b in zip(plain, plain[1:]) if a == "-drive"]
    assert [d.split(",")[1] for d in drives] == ["file=/l/0.erofs", "file=/l/1.erofs",
                                                 "file=/t/rw.img"]
    chardevs = [b for a, b in zip(plain, plain[1:]) if a == "-chardev"]
    assert "null,id=console" in chardevs
    assert "socket,id=agent,path=/t/agent.sock,server=on,wait=off" in chardevs
    assert "socket,id=qmp,path=/t/qmp.sock,server=on,wait=off" in chardevs
    assert not [a for a in plain if "/vm/" in a or "fd=" in a]


def test_plain_argv_refuses_what_it_can_not_map(vm, monkeypatch) -> None:  # noqa: ANN001
    spec = qemu.MachineSpec(cpus=1, memory_mib=256, layers=1)
    with pytest.raises(ValueError, match="layer files"):
        vm.plain_argv(spec, binary="q", kernel=Path("/k"), initrd=Path("/i"), layers=[],
                      rw=Path("/r"), agent=Path("/a"), qmp_sock=Path("/q"))
    # a jail path the mapping does not know (the backend's argv grew a device) is refused
    real = machine.argv
    monkeypatch.setattr(machine, "argv", lambda s, b: [*real(s, b), "-drive",
                                                       "file=/vm/new.img"])
    with pytest.raises(ValueError, match="/vm/new.img"):
        _plain(vm, spec)


async def test_wait_for_change(vm) -> None:  # noqa: ANN001
    now = [0.0]
    shots = iter([b"same", b"same", b"other"])

    async def shot() -> bytes:
        now[0] += 0.5
        return next(shots)

    took = await vm.wait_for_change(shot, b"same", timeout=10, since=-1.0,
                                    clock=lambda: now[0])
    assert took == 2.5  # three shots of 0.5 s after the key sent 1 s before the call

    async def never() -> bytes:
        now[0] += 1.0
        return b"same"

    assert await vm.wait_for_change(never, b"same", timeout=3, clock=lambda: now[0]) is None


async def test_still_screen(vm) -> None:  # noqa: ANN001
    seq = iter([b"a", b"b", b"b", b"b", b"b"])

    async def shot() -> bytes:
        return next(seq)

    assert await vm.still_screen(shot, n=3, gap_s=0) == b"b"
    n = [0]

    async def blinking() -> bytes:
        n[0] += 1
        return b"on" if n[0] % 2 else b"off"

    assert await vm.still_screen(blinking, n=3, gap_s=0, tries=4) is None


def test_summaries_and_only(vm) -> None:  # noqa: ANN001
    assert vm.summarize([0.01, 0.02, 0.03], "x") == {"x_p50_ms": 20.0, "x_p99_ms": 30.0}
    assert vm.summarize([1.0, 3.0], "r", "s") == {"r_p50_s": 1.0, "r_p99_s": 3.0}
    assert vm.parse_only("") is None
    assert vm.parse_only("plain, ready") == frozenset({"plain", "ready"})
    with pytest.raises(SystemExit, match="phases are"):
        vm.main(only=frozenset({"nope"}))


def test_plain_argv_of_a_disk_image_guest(vm) -> None:  # noqa: ANN001
    from rollbox.backends.vm import rootdisk

    spec = qemu.MachineSpec(cpus=2, memory_mib=1024, layers=0, rw_disk=False,
                            root_disk="desktop:1", init="/sbin/init")
    plain = vm.plain_argv(spec, binary="qemu", kernel=Path("/k"), initrd=Path("/i"),
                          layers=[], rw=None, agent=Path("/t/a"), qmp_sock=Path("/t/q"),
                          base=Path("/d/disk.img"), overlay=Path("/t/root.qcow2"))
    ours = machine.argv(spec, "qemu")
    blockdevs = [b for a, b in zip(plain, plain[1:]) if a == "-blockdev"]
    assert blockdevs[0].startswith("driver=file,filename=/d/disk.img,")
    assert "read-only=on" in blockdevs[0] and "read-only=on" in blockdevs[1]
    assert blockdevs[2].startswith("driver=file,filename=/t/root.qcow2,")
    assert "backing=base" in blockdevs[3]
    assert rootdisk.BASE_IMG in " ".join(ours) and not [a for a in plain if "/vm/" in a]
    append = plain[plain.index("-append") + 1]
    assert "rollbox.root=1" in append and "rollbox.init=/sbin/init" in append
    with pytest.raises(ValueError, match="/vm/"):  # a disk guest's paths not given
        vm.plain_argv(spec, binary="qemu", kernel=Path("/k"), initrd=Path("/i"), layers=[],
                      rw=None, agent=Path("/t/a"), qmp_sock=Path("/t/q"))


async def test_desktop_drawn(vm) -> None:  # noqa: ANN001
    from PIL import Image

    from rollbox.desktop.episode import encode_png

    # no screen yet, then VGA text mode, then a real 1024x768 desktop frame (QEMU's)
    frames = [b"not a png", encode_png(Image.new("RGB", (720, 400)), 1)]
    real = Path(__file__).resolve().parents[2] / "docs" / "backends" / "vm-desktop.png"
    frames.append(real.read_bytes())

    async def shot() -> bytes:
        return frames.pop(0)

    took = await vm.desktop_drawn(shot, t0=0.0, timeout=1e12)
    assert took > 0 and frames == []
    with pytest.raises(TimeoutError):
        await vm.desktop_drawn(shot, t0=-1e12, timeout=1.0)
