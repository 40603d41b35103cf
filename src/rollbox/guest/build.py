"""Builds the guest artifacts (``make guest``: ``python -m rollbox.guest.build``).

1. Kernel: the version Debian's ``linux-image-cloud-amd64`` depends on (``apt-cache depends``,
   never a hard-coded version), fetched with ``apt-get download`` into the build cache and
   unpacked with ``dpkg-deb -x`` (never installed). ``vmlinux`` is the ELF inside its bzImage
   (an LZ4 legacy stream, decompressed by ``lz4``), checked to carry the Xen PVH entry note so
   QEMU boots it directly (no firmware, no decompressor run under TCG).
2. Initramfs (uncompressed newc cpio, deterministic: sorted, mtime 0, root-owned): the agent as
   ``/init``, the modules the guest needs with their dependencies (load order in
   ``/lib/modules/load.list``, dependencies first; the agent loads them by ``finit_module``),
   and the platform's own tools: ``/platform/busybox`` (busybox-static: ``EXEC_PLATFORM_TOOL``)
   and ``/platform/bash`` (bash-static as ``platform_shell.prepared`` rewrites it).
3. ``manifest.json``: kernel package and version, sha256 of vmlinux, initramfs, agent and tools
   (part of a template's key: any change rebuilds templates).

Re-running with the same inputs changes nothing (the deb and its unpacked tree are cached by
version). Owns ``Settings.vm_kernel``, ``vm_initrd``, ``vm_guest_manifest`` and the cache
directory beside the manifest, nothing else.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rollbox.agent import platform_shell
from rollbox.config import Settings, get_settings
from rollbox.errors import InfraError

# What the guest needs as modules (ext4 is built in): the virtio-mmio transport, disks,
# the agent's serial port, balloon, pmem (+DAX), layers and overlay, network, entropy.
# Module -> the virtio device id it drives when only that device needs it (0: always loaded).
# The agent loads such a module (and the dependencies only it needs) only when a virtio device
# of that id exists: a VM without a NIC or pmem does not pay for their drivers at boot.
WANTED_MODULES = {
    "virtio_mmio": 0, "virtio_blk": 0, "virtio_console": 0, "erofs": 0, "overlay": 0,
    "virtio_balloon": 5, "virtio_pmem": 27, "nd_pmem": 27, "virtio_net": 1, "virtio_rng": 4,
}
LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
MODULE_SIG_MAGIC = b"~Module signature appended~\n"
XEN_ELFNOTE_PHYS32_ENTRY = 18


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)  # type: ignore


def resolve_kernel_package(meta: str) -> str:
    """The concrete ``linux-image-<version>`` package the meta package depends on."""
    def depends() -> str | None:
        try:
            out = run(["apt-cache", "depends", meta]).stdout
        except subprocess.CalledProcessError:
            return None
        for line in out.splitlines():
            m = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
            if m and m.group(1) != meta:
                return m.group(1)
        return None

    pkg = depends()
    if pkg is None:  # no package lists yet (fresh machine)
        run(["apt-get", "update", "-q"])
        pkg = depends()
    if pkg is None:
        raise InfraError(f"apt-cache depends {meta}: no linux-image dependency found")
    return pkg


def fetch_deb(pkg: str, cache: Path) -> Path:
    debs = sorted(cache.glob(f"{pkg}_*.deb"))
    if not debs:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            run(["apt-get", "download", "-q", pkg], cwd=tmp)
            for f in Path(tmp).glob("*.deb"):
                os.replace(f, cache / f.name)
        debs = sorted(cache.glob(f"{pkg}_*.deb"))
    if not debs:
        raise InfraError(f"apt-get download {pkg} produced no .deb")
    return debs[-1]


def unpack_deb(deb: Path, cache: Path) -> Path:
    dest = cache / deb.stem
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
        run(["dpkg-deb", "-x", str(deb), str(tmp)])
        (tmp / ".complete").touch()
        os.replace(tmp, dest)
    return dest


def _elf_sections(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, type, offset, size) of an ELF64 little-endian file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise InfraError("not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = raw[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", strtab_off + off)
        return data[strtab_off + off:end].decode()

    return [(name(s[0]), s[1], s[4], s[5]) for s in raw]


def _elf_notes(data: bytes) -> list[tuple[bytes, int, bytes]]:
    """(name, type, desc) of every note in the ELF's program headers (PT_NOTE)."""
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    notes = []
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            off += 12
            name = data[off:off + namesz].rstrip(b"\0")
            off += (namesz + 3) & ~3
            desc = data[off:off + descsz]
            off += (descsz + 3) & ~3
            notes.append((name, ntype, desc))
    return notes


def extract_vmlinux(vmlinuz: Path, dest: Path) -> None:
    """The ELF kernel inside a bzImage whose payload is LZ4 (Debian's cloud kernel)."""
    data = vmlinuz.read_bytes()
    pos = data.find(LZ4_LEGACY_MAGIC)
    while pos >= 0:
        # The stream is followed by the decompressed size and the setup code's tail, which
        # lz4 reports as trailing garbage: judge by the output, as extract-vmlinux does.
        proc = subprocess.run(["lz4", "-dc"], input=data[pos:], capture_output=True)
        out = proc.stdout
        if out[:4] == b"\x7fELF":
            if not any(n == b"Xen" and t == XEN_ELFNOTE_PHYS32_ENTRY
                       for n, t, _ in _elf_notes(out)):
                raise InfraError(f"{vmlinuz}: kernel has no PVH entry note (CONFIG_PVH)")
            tmp = dest.with_suffix(".tmp")
            tmp.write_bytes(out)
            os.replace(tmp, dest)
            return
        pos = data.find(LZ4_LEGACY_MAGIC, pos + 1)
    raise InfraError(f"{vmlinuz}: no LZ4 payload holding an ELF kernel")


def module_info(ko: bytes) -> dict[str, str]:
    for name, _, off, size in _elf_sections(ko):
        if name == ".modinfo":
            info: dict[str, str] = {}
            for item in ko[off:off + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, value)
            return info
    return {}


def without_signature(ko: bytes) -> bytes:
    """The module without its appended signature. The kernel does not require one
    (CONFIG_MODULE_SIG_FORCE is off) and checking an RSA signature per module is slow under
    TCG; the modules' integrity is the initramfs digest's (manifest), not the guest's check."""
    if not ko.endswith(MODULE_SIG_MAGIC):
        return ko
    # struct module_signature (12 bytes, sig_len big-endian last) precedes the magic
    end = len(ko) - len(MODULE_SIG_MAGIC)
    (sig_len,) = struct.unpack_from(">I", ko, end - 4)
    cut = end - 12 - sig_len
    if cut <= 0:
        raise InfraError("malformed module signature")
    return ko[:cut]


def modules_in_load_order(moddir: Path, wanted: dict[str, int]) -> list[tuple[Path, int]]:
    """The .ko files of ``wanted`` and their dependencies, each after what it depends on, with
    the virtio device id that decides whether it is loaded (0: always; a dependency shared by
    modules of different devices, or by one always loaded, is always loaded)."""
    files = {p.stem.replace("-", "_"): p for p in moddir.rglob("*.ko")}
    order: list[Path] = []
    seen: set[str] = set()
    needed_for: dict[str, set[int]] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        needed_for.setdefault(name, set()).add(wanted[chain[0]] if chain else wanted[name])
        if name in seen:
            for dep in deps_of.get(name, ()):  # already placed: still note who needs it
                visit(dep, chain + (name,))
            return
        if name in chain:
            raise InfraError(f"module dependency cycle: {' -> '.join(chain + (name,))}")
        path = files.get(name)
        if path is None:
            raise InfraError(f"kernel module {name} not in {moddir}")
        deps = module_info(path.read_bytes()).get("depends", "")
        deps_of[name] = [d.replace("-", "_") for d in deps.split(",") if d]
        for dep in deps_of[name]:
            visit(dep, chain + (name,))
        seen.add(name)
        order.append(path)

    deps_of: dict[str, list[str]] = {}
    for name in wanted:
        visit(name, ())
    out = []
    for path in order:
        ids = needed_for[path.stem.replace("-", "_")]
        out.append((path, ids.pop() if len(ids) == 1 else 0))
    return out


class Cpio:
    """A newc archive written in order (directories before their entries)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
               nlink: int = 1) -> None:
        fname = name.encode() + b"\0"
        head = b"070701" + b"".join(b"%08X" % v for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(fname), 0))
        self.ino += 1
        blob = head + fname
        blob += b"\0" * (-len(blob) % 4)
        blob += data
        blob += b"\0" * (-len(blob) % 4)
        self.parts.append(blob)

    def dir(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, 0o040000 | perm, nlink=2)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def chardev(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self._entry(name, 0o020000 | perm, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        out = b"".join(self.parts)
        return out + b"\0" * (-len(out) % 512)


def _static_elf(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        raise InfraError(f"{path} is not an ELF binary")
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        if struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3:  # PT_INTERP
            raise InfraError(f"{path} is dynamically linked (the guest has no libc)")
    return data


def build_initramfs(agent: bytes, busybox: bytes, bash: bytes,
                    modules: list[tuple[Path, int]]) -> bytes:
    c = Cpio()
    for d in ("dev", "proc", "sys", "run", "tmp", "layers", "rw", "sandbox", "platform", "lib",
              "lib/modules"):
        c.dir(d)
    # The kernel opens /dev/console for init's stdio before anything is mounted.
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3, 0o666)
    c.file("init", agent, 0o755)
    c.file("platform/busybox", busybox, 0o555)
    c.file("platform/bash", bash, 0o555)
    for ko, _ in modules:
        c.file(f"lib/modules/{ko.name}", without_signature(ko.read_bytes()), 0o644)
    # "<file>" or "<file> <virtio device id>": the agent loads them in this order
    c.file("lib/modules/load.list", "".join(
        f"{ko.name} {dev}\n" if dev else f"{ko.name}\n" for ko, dev in modules).encode())
    return c.finish()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_guest(settings: Settings, *, package: str, kernel: Path, initrd: Path,
                manifest_path: Path, wanted: dict[str, int],
                install_kernel: Callable[[Path, Path], None],
                kernel_key: str) -> dict[str, object]:
    """One guest's artifacts: the kernel of Debian meta package ``package`` put at ``kernel``
    by ``install_kernel(vmlinuz, kernel)``, the initramfs with the ``wanted`` modules at
    ``initrd``, the manifest (the kernel's digest under ``kernel_key``); the deb cache is
    beside the manifest. The microVM guest (:func:`build`) and the full VM's
    (``rollbox.guest.vmbuild``) differ only in these."""
    cache = manifest_path.parent / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    for path in (kernel, initrd):
        path.parent.mkdir(parents=True, exist_ok=True)
    pkg = resolve_kernel_package(package)
    version = pkg.removeprefix("linux-image-")
    deb = fetch_deb(pkg, cache)
    tree = unpack_deb(deb, cache)
    vmlinuz = tree / "boot" / f"vmlinuz-{version}"
    moddir = tree / "lib" / "modules" / version
    if not vmlinuz.exists() or not moddir.is_dir():
        raise InfraError(f"{deb.name}: no boot/vmlinuz-{version} or lib/modules/{version}")

    install_kernel(vmlinuz, kernel)
    modules = modules_in_load_order(moddir, wanted)
    agent = _static_elf(settings.agent_binary)
    busybox = _static_elf(settings.platform_busybox)
    bash = platform_shell.prepared(settings.platform_shell)
    initramfs = build_initramfs(agent, busybox, bash, modules)
    tmp = initrd.with_suffix(".tmp")
    tmp.write_bytes(initramfs)
    os.replace(tmp, initrd)

    manifest: dict[str, object] = {
        "kernel_package": pkg,
        "kernel_version": version,
        "deb": deb.name,
        kernel_key: _sha256(kernel.read_bytes()),
        "initramfs_sha256": _sha256(initramfs),
        "agent_sha256": _sha256(agent),
        "busybox_sha256": _sha256(busybox),
        "bash_sha256": _sha256(bash),
        "modules": [ko.name for ko, _ in modules],
    }
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, manifest_path)
    return manifest


def build(settings: Settings) -> dict[str, object]:
    return build_guest(settings, package=settings.vm_kernel_package, kernel=settings.vm_kernel,
                       initrd=settings.vm_initrd, manifest_path=settings.vm_guest_manifest,
                       wanted=WANTED_MODULES, install_kernel=extract_vmlinux,
                       kernel_key="vmlinux_sha256")


def run_build(target: str, build_fn: Callable[[Settings], dict[str, object]]) -> int:
    """``make <target>``'s entry point: build, print the kernel and initramfs built, or the
    failure (with a failed tool's stderr) and exit 1."""
    try:
        manifest = build_fn(get_settings())
    except (InfraError, subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"make {target}: {exc} {detail}".strip(), file=sys.stderr)
        return 1
    print(f"{target}: {manifest['kernel_version']} initramfs "
          f"{str(manifest['initramfs_sha256'])[:12]}")
    return 0


def main() -> int:
    return run_build("guest", build)


if __name__ == "__main__":
    raise SystemExit(main())
