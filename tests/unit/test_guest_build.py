"""Pieces of `make guest` (rollbox.guest.build) that need no kernel deb: the cpio writer (read
back by busybox's cpio), module signature stripping, and the module load order with the
virtio device that decides whether a driver is loaded. The whole build and a boot of its
result are in tests/integration/test_guest_vm.py."""
from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from rollbox.errors import InfraError
from rollbox.guest import build as B


def test_cpio_is_read_back_by_busybox(tmp_path: Path) -> None:
    c = B.Cpio()
    c.dir("platform")
    c.chardev("console", 5, 1)
    c.file("platform/tool", b"\x7fELF" + b"x" * 1001, 0o555)
    c.file("init", b"#!", 0o755)
    data = c.finish()
    assert len(data) % 512 == 0
    (tmp_path / "a.cpio").write_bytes(data)
    listing = subprocess.run(["busybox", "cpio", "-tv"], input=data, capture_output=True,
                             check=True).stdout.decode()
    lines = [line.split() for line in listing.splitlines()]
    assert [(ln[0], ln[-1]) for ln in lines] == [
        ("drwxr-xr-x", "platform"), ("crw-------", "console"), ("-r-xr-xr-x", "platform/tool"),
        ("-rwxr-xr-x", "init")]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["busybox", "cpio", "-id", "platform/tool"], input=data, cwd=out,
                   capture_output=True, check=True)
    assert (out / "platform" / "tool").read_bytes() == b"\x7fELF" + b"x" * 1001


def test_module_signature_is_cut_exactly() -> None:
    body = b"\x7fELF module body"
    sig = b"S" * 300
    info = struct.pack(">BBBBB3xI", 0, 0, 2, 0, 0, len(sig))  # struct module_signature
    signed = body + sig + info + B.MODULE_SIG_MAGIC
    assert B.without_signature(signed) == body
    assert B.without_signature(body) == body  # unsigned: unchanged
    with pytest.raises(InfraError):
        B.without_signature(b"x" + struct.pack(">BBBBB3xI", 0, 0, 2, 0, 0, 5000)
                            + B.MODULE_SIG_MAGIC)


def test_load_order_puts_dependencies_first_and_tags_device_only_drivers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deps = {"virtio_ring": "", "virtio": "virtio_ring", "virtio_mmio": "virtio,virtio_ring",
            "failover": "", "net_failover": "failover", "virtio_net": "virtio,net_failover",
            "libnvdimm": "", "virtio_pmem": "libnvdimm,virtio", "nd_pmem": "libnvdimm",
            "virtio-rng": "virtio"}
    for name in deps:
        (tmp_path / f"{name}.ko").write_text(name)
    monkeypatch.setattr(B, "module_info", lambda ko: {"depends": deps[ko.decode()]})
    order = B.modules_in_load_order(tmp_path, {"virtio_mmio": 0, "virtio_net": 1,
                                               "virtio_pmem": 27, "nd_pmem": 27,
                                               "virtio_rng": 4})
    names = [(p.stem, dev) for p, dev in order]
    pos = {n: i for i, (n, _) in enumerate(names)}
    for mod, d in deps.items():
        for dep in filter(None, d.split(",")):
            assert pos[dep] < pos[mod], (dep, mod)
    tags = dict(names)
    # shared with an always-loaded module: always; only a NIC's or pmem's: with that device
    assert tags["virtio"] == tags["virtio_ring"] == tags["virtio_mmio"] == 0
    assert tags["failover"] == tags["net_failover"] == tags["virtio_net"] == 1
    assert tags["libnvdimm"] == tags["virtio_pmem"] == tags["nd_pmem"] == 27
    assert tags["virtio-rng"] == 4
    with pytest.raises(InfraError, match="not in"):
        B.modules_in_load_order(tmp_path, {"missing_driver": 0})
