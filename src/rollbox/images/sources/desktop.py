"""Image source: the ``desktop`` VM disk image (issue 16 item 3), built from Debian only.

debootstrap (minbase) of a Debian suite into a private build tree, then ``apt-get`` in a chroot
of that tree (no recommends, no docs/man/locales beyond C.UTF-8) for systemd, udev, Xorg
(modesetting on the VGA device, libinput), JWM, xterm, mousepad and gnumeric; a user ``user``
(uid 1000) logged in on tty1 by getty, whose login starts X with a JWM panel of launchers. No
kernel and no modules: the ``vm`` backend's kernel and initramfs bring the drivers (DRM for
the VGA device, USB HID, evdev) before handing over to the image's ``/sbin/init``
(docs/backends/vm.md, "Guest boot contract"). The tree is packed into one raw ext4 disk
(``mkfs.ext4 -d``, sparse) with its manifest under ``<data_dir>/vm-disks`` (layout:
:mod:`rollbox.images.vmdisk`).

Everything run in the chroot comes from Debian's archive through the build tree rollbox made
(never from a sandbox's tree); chroot steps run in a private mount and PID namespace, so
nothing they mount or start outlives the step. Must not boot the image (the ``vm`` backend
and the tests do) nor contain rollbox code (the guest agent comes from the host's read-only
disk at boot).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid as uuid_mod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollbox.errors import BadRequest, InfraError, NotFound
from rollbox.images.names import validate_name
from rollbox.images.overlay import remove_entry
from rollbox.images.sources.debootstrap import _sources_entries, default_mirror
from rollbox.images.store import Progress
from rollbox.images.vmdisk import (
    DESKTOP_DRAWN_FILE,
    DISK_FILE,
    DISK_FORMAT,
    MANIFEST_FILE,
    VmDisk,
    resolve_vm_disk,
    sha256_file,
    vm_disk_dir,
    vm_disks_root,
)

DESKTOP_IMAGE = "desktop:1"
# The recipe's version, in the manifest: a disk built by an older recipe is built again by
# build_desktop_disk (2: the session's X cookie holds for any host name, XINITRC; JWM says
# it drew the screen, vmdisk.DESKTOP_DRAWN_FILE: its StartupCommands run after the tray and
# the background are drawn).
DESKTOP_RECIPE = 2
DESKTOP_SUITE = "bookworm"
DESKTOP_USER = "user"
DESKTOP_UID = 1000
# The display the session asks for (Xorg's modesetting driver on QEMU's `-device VGA`,
# i.e. the kernel's bochs DRM driver).
DESKTOP_MODE = (1024, 768)
DISK_LABEL = "rollbox-root"
# The disk (the guest's whole root filesystem, its free space the sandbox's): issue 16's
# ceiling for the base image, 1.5 GiB. The file is sparse: what the host stores is the tree.
DISK_BYTES = 3 << 29

DESKTOP_PACKAGES = [
    "systemd-sysv", "udev", "kmod", "procps",
    "xserver-xorg-core", "xserver-xorg-input-libinput", "xserver-xorg-legacy", "xinit",
    "jwm", "xterm", "mousepad", "gnumeric", "fonts-dejavu-core",
]
DPKG_NODOC = """\
# rollbox desktop image: no docs, man pages, info or translations (C.UTF-8 is glibc's own)
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/help/*
path-exclude=/usr/share/gnome/help/*
path-exclude=/usr/share/omf/*
"""
APT_CONF = """\
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
"""
XORG_CONF = f"""\
# rollbox desktop: QEMU's -device VGA through the kernel's bochs DRM driver, no GPU (no glamor),
# never blank the screen (an agent judges it by screenshots).
Section "ServerFlags"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection

Section "Device"
    Identifier "vga"
    Driver "modesetting"
    Option "AccelMethod" "none"
EndSection

Section "Monitor"
    Identifier "monitor"
    Option "PreferredMode" "{DESKTOP_MODE[0]}x{DESKTOP_MODE[1]}"
EndSection

Section "Screen"
    Identifier "screen"
    Device "vga"
    Monitor "monitor"
    DefaultDepth 24
    SubSection "Display"
        Depth 24
        Modes "{DESKTOP_MODE[0]}x{DESKTOP_MODE[1]}"
    EndSubSection
EndSection
"""
GETTY_AUTOLOGIN = f"""\
[Service]
ExecStart=
ExecStart=-/sbin/agetty --autologin {DESKTOP_USER} --noclear %I $TERM
"""
BASH_PROFILE = """\
# rollbox desktop: the login on tty1 (getty autologin) starts the X session
if [ -z "$DISPLAY" ] && [ "$(tty)" = /dev/tty1 ]; then
    exec startx -- vt1 -nolisten tcp -keeptty >"$HOME/.xsession.log" 2>&1
fi
"""
XINITRC = """\
#!/bin/sh
# rollbox desktop session: JWM, its panel of launchers at the bottom.
# The X cookie for any host name (family "wild", ffff): startx wrote it for this host name,
# and a restored desktop gets a new one (the platform's make_unique), so later clients (a
# launcher's editor) found no cookie and X refused them ("Authorization required"). Read
# first, then merged: in one pipe the two xauth runs contend for the file's lock ("timeout
# in locking authority file") and nothing is merged.
wild=$(xauth nlist "$DISPLAY" | sed -e 's/^..../ffff/')
printf '%s\\n' "$wild" | xauth nmerge -
exec jwm
"""
ACTIVE_BLUE = "#1f4e8c"


def _jwm_style(tag: str, font: str, fg: str, bg: str, extra: str = "") -> str:
    """One of JWM's style elements, its active colours the session's blue."""
    return (f"  <{tag}>\n    <Font>{font}</Font>\n{extra}"
            f"    <Foreground>{fg}</Foreground>\n    <Background>{bg}</Background>\n"
            f"    <Active><Foreground>#ffffff</Foreground><Background>{ACTIVE_BLUE}</Background>"
            f"</Active>\n  </{tag}>")


_JWM_STYLES = "\n".join([
    _jwm_style("WindowStyle", "DejaVu Sans-10:bold", "#ffffff", "#555555",
               "    <Width>4</Width>\n    <Height>24</Height>\n"),
    _jwm_style("TrayStyle", "DejaVu Sans-11", "#000000", "#d8d8d8"),
    _jwm_style("TaskListStyle", "DejaVu Sans-10", "#000000", "#c0c0c0"),
    _jwm_style("MenuStyle", "DejaVu Sans-11", "#000000", "#eeeeee"),
])
NOTE_FILE = "/home/user/note.txt"
EDITOR_COMMAND = f"mousepad {NOTE_FILE}"
JWMRC = f"""\
<?xml version="1.0"?>
<JWM>
  <RootMenu onroot="123">
    <Program label="Terminal">xterm</Program>
    <Program label="Text editor">{EDITOR_COMMAND}</Program>
    <Program label="Spreadsheet">gnumeric</Program>
    <Separator/>
    <Restart label="Restart window manager"/>
  </RootMenu>
  <Tray x="0" y="-1" height="34" autohide="off">
    <TrayButton label="Menu">root:1</TrayButton>
    <TrayButton label="Terminal">exec:xterm</TrayButton>
    <TrayButton label="Editor">exec:{EDITOR_COMMAND}</TrayButton>
    <TrayButton label="Spreadsheet">exec:gnumeric</TrayButton>
    <TaskList maxwidth="240"/>
  </Tray>
  <StartupCommand>touch {DESKTOP_DRAWN_FILE}</StartupCommand>
  <Desktops width="1" height="1">
    <Background type="solid">#3a6ea5</Background>
  </Desktops>
{_JWM_STYLES}
  <FocusModel>click</FocusModel>
  <DoubleClickSpeed>400</DoubleClickSpeed>
</JWM>
"""
XRESOURCES = """\
XTerm*faceName: DejaVu Sans Mono
XTerm*faceSize: 11
XTerm*cursorBlink: false
"""
FSTAB = f"LABEL={DISK_LABEL} / ext4 rw,noatime,errors=remount-ro 0 0\n"
# Units of a server that a throwaway desktop guest has no use for (they would cost CPU under TCG
# or write to the per-sandbox overlay).
MASKED_UNITS = ["apt-daily.timer", "apt-daily-upgrade.timer", "apt-daily.service",
                "apt-daily-upgrade.service", "dpkg-db-backup.timer", "e2scrub_all.timer",
                "e2scrub_reap.service", "fstrim.timer", "systemd-timesyncd.service",
                "man-db.timer", "systemd-networkd-wait-online.service",
                "getty@tty2.service", "serial-getty@ttyS0.service"]


def _noop(_msg: str) -> None:
    pass


def security_mirror() -> str:
    """The host's Debian security archive URI, else deb.debian.org's."""
    for uri, _suites in _sources_entries():
        if "security" in uri and uri.startswith(("http://", "https://")):
            return uri.rstrip("/")
    return "http://deb.debian.org/debian-security"


def _sources_list(mirror: str, security: str, suite: str) -> str:
    return (f"deb {mirror} {suite} main\n"
            f"deb {mirror} {suite}-updates main\n"
            f"deb {security} {suite}-security main\n")


class _Build:
    """One build: its tree, its log, the chroot steps."""

    def __init__(self, root: Path, log_path: Path, say: Callable[[str], None]) -> None:
        self.root = root
        self.log_path = log_path
        self.say = say

    def host(self, cmd: list[str], what: str, timeout: float = 3600) -> str:
        """Run a host command (debootstrap, mkfs); output to the log."""
        return self._run(cmd, f"$ {' '.join(cmd)}", what, timeout, None)

    def chroot(self, script: str, what: str, timeout: float = 3600) -> str:
        """Run ``script`` with /bin/sh in the build tree: a private mount and PID namespace
        (its /proc and every daemon a postinst starts die with it), Debian's tools only."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root",
               "DEBIAN_FRONTEND": "noninteractive", "DEBCONF_NONINTERACTIVE_SEEN": "true"}
        cmd = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
               f"--mount-proc={self.root / 'proc'}", "chroot", str(self.root),
               "/bin/sh", "-euc", script]
        self.say(what)
        return self._run(cmd, f"# {what}\n$ chroot {script}", what, timeout, env)

    def _run(self, cmd: list[str], header: str, what: str, timeout: float,
             env: dict[str, str] | None) -> str:
        """``cmd``'s stdout (also logged, with its stderr); InfraError naming the log."""
        with open(self.log_path, "ab") as log:
            log.write(f"\n{header}\n".encode())
            log.flush()
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log,
                                      stdin=subprocess.DEVNULL, env=env, timeout=timeout,
                                      check=False)
            except subprocess.TimeoutExpired:
                raise InfraError(f"desktop image build: {what} timed out after {timeout:.0f} s; "
                                 f"see {self.log_path}") from None
            log.write(proc.stdout)
        if proc.returncode != 0:
            raise InfraError(f"desktop image build: {what} failed (exit {proc.returncode}); "
                             f"see {self.log_path}: " + self._tail())
        return proc.stdout.decode(errors="replace")

    def write(self, rel: str, text: str, mode: int = 0o644, owner: int | None = None) -> None:
        path = self.root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.chmod(path, mode)
        if owner is not None:
            os.chown(path, owner, owner)

    def _tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-6:]
        return " | ".join(lines)


def build_desktop_disk(root: Path | None = None, name: str = DESKTOP_IMAGE,
                       suite: str = DESKTOP_SUITE, mirror: str | None = None, *,
                       progress: Progress | None = None, force: bool = False) -> VmDisk:
    """Build the desktop VM disk ``name`` under the vm-disks ``root`` (default
    ``<data_dir>/vm-disks``) unless it is there (``force``: build again; a running sandbox
    keeps the old disk's inode). Runs as root on the host (debootstrap, chroot, mkfs); slow:
    ~10 minutes on 2 cores; a disk of an older recipe (manifest ``recipe`` <
    :data:`DESKTOP_RECIPE`) is built again. The log: ``<root>/logs/desktop-<time>.log``."""
    validate_name(name)
    if not re.fullmatch(r"[a-z][a-z0-9.-]*", suite):
        raise BadRequest(f"invalid Debian suite {suite!r}")
    for tool in ("debootstrap", "unshare", "chroot", "mkfs.ext4", "qemu-img"):
        if shutil.which(tool) is None:
            raise InfraError(f"desktop image build needs {tool}: install it (make deps)")
    if os.geteuid() != 0:
        raise InfraError("the desktop image is built as root (debootstrap, chroot, mkfs)")
    say = progress or _noop
    root = Path(root) if root is not None else vm_disks_root()
    out_dir = vm_disk_dir(root, name)
    for d in (root, root / "logs", root / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o700)
    lock_path = out_dir.parent / (out_dir.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build of a name at a time; the second reuses it
        if not force:
            with contextlib.suppress(NotFound, InfraError):  # missing or broken: build it
                disk = resolve_vm_disk(root, name)
                if disk.manifest.get("recipe", 1) == DESKTOP_RECIPE:
                    return disk
                say(f"{name}: built by recipe {disk.manifest.get('recipe', 1)}, "
                    f"this is {DESKTOP_RECIPE}: building it again")
        return _build(root, name, suite, mirror or default_mirror(suite), out_dir, say)


def _build(vm_root: Path, name: str, suite: str, mirror: str, out_dir: Path,
           say: Callable[[str], None]) -> VmDisk:
    started = time.monotonic()
    security = security_mirror()
    log_path = vm_root / "logs" / f"desktop-{time.strftime('%Y%m%d-%H%M%S')}.log"
    staging = Path(tempfile.mkdtemp(dir=vm_root / "tmp", prefix=f"desktop-{os.getpid()}-"))
    root = staging / "rootfs"
    b = _Build(root, log_path, say)
    try:
        say(f"debootstrap {suite} (minbase) from {mirror} (log: {log_path})")
        b.host(["debootstrap", "--variant=minbase", suite, str(root), mirror], "debootstrap")
        _configure_apt(b, mirror, security, suite)
        b.chroot("apt-get update -q", "apt-get update")
        b.chroot("apt-get install -y -q " + " ".join(DESKTOP_PACKAGES),
                 f"apt-get install {len(DESKTOP_PACKAGES)} packages (Xorg, JWM, xterm, "
                 "mousepad, gnumeric)")
        _configure_session(b)
        packages = _package_list(b)
        _scrub(b)
        say("packing the ext4 disk")
        disk = _pack(b, staging, root)
        return _publish(vm_root, name, suite, mirror, security, out_dir, staging, disk,
                        packages, time.monotonic() - started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _configure_apt(b: _Build, mirror: str, security: str, suite: str) -> None:
    b.write("etc/apt/sources.list", _sources_list(mirror, security, suite))
    b.write("etc/apt/apt.conf.d/01-rollbox", APT_CONF)
    b.write("etc/dpkg/dpkg.cfg.d/01-rollbox-nodoc", DPKG_NODOC)
    # services never start during the build (a postinst's daemon would be the build's)
    b.write("usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n", 0o755)
    resolv = b.root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)


def _configure_session(b: _Build) -> None:
    uid = DESKTOP_UID
    home = f"/home/{DESKTOP_USER}"
    b.chroot(f"useradd --create-home --uid {uid} --user-group --shell /bin/bash "
             f"--groups video,input,tty {DESKTOP_USER} && passwd -d {DESKTOP_USER} >/dev/null",
             f"user {DESKTOP_USER}")
    b.write("etc/X11/xorg.conf.d/10-rollbox.conf", XORG_CONF)
    # no logind session here: Xorg's wrapper runs the server with root rights for its console
    b.write("etc/X11/Xwrapper.config", "allowed_users=console\nneeds_root_rights=yes\n")
    b.write("etc/systemd/system/getty@tty1.service.d/autologin.conf", GETTY_AUTOLOGIN)
    b.write(f"{home}/.bash_profile", BASH_PROFILE, owner=uid)
    b.write(f"{home}/.xinitrc", XINITRC, 0o755, owner=uid)
    b.write(f"{home}/.jwmrc", JWMRC, owner=uid)
    b.write(f"{home}/.Xresources", XRESOURCES, owner=uid)
    b.write(NOTE_FILE, "", owner=uid)
    b.write("etc/fstab", FSTAB)
    b.write("etc/hostname", "desktop\n")
    b.write("etc/hosts", "127.0.0.1 localhost\n127.0.1.1 desktop\n::1 localhost\n")
    b.chroot("systemctl set-default multi-user.target >/dev/null && "
             "systemctl mask " + " ".join(MASKED_UNITS) + " >/dev/null 2>&1 || true",
             "systemd units")


def _package_list(b: _Build) -> list[dict[str, Any]]:
    out = b.chroot("dpkg-query -W -f '${Package}\\t${Version}\\t${Installed-Size}\\n'",
                   "package list")
    pkgs = []
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 3:
            pkgs.append({"package": fields[0], "version": fields[1],
                         "installed_kib": int(fields[2] or 0)})
    return pkgs


def _scrub(b: _Build) -> None:
    b.chroot("apt-get clean", "removing apt caches")
    root = b.root
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*", "var/cache/debconf/*-old",
                    "var/log/*.log", "var/log/apt/*", "var/lib/dpkg/*-old", "tmp/*",
                    "var/tmp/*", "root/.cache", "usr/share/man/*", "usr/share/info/*",
                    "usr/share/lintian/*", "usr/share/locale/*", "var/cache/man/*",
                    "usr/sbin/policy-rc.d"):
        for path in root.glob(pattern):
            if path.name in ("lock", "partial", "auxfiles"):
                continue
            remove_entry(path)
    docs = root / "usr/share/doc"
    if docs.is_dir():  # debootstrap's own packages came before the dpkg filter
        for path in docs.rglob("*"):
            if (path.is_file() or path.is_symlink()) and path.name != "copyright":
                path.unlink()
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/machine-id").write_text("")  # systemd makes one at first boot
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)


def _pack(b: _Build, staging: Path, root: Path) -> dict[str, Any]:
    raw = staging / DISK_FILE
    tree = int(b.host(["du", "-sb", "--apparent-size", str(root)], "du").split()[0])
    if tree > DISK_BYTES * 0.85:
        raise InfraError(f"desktop image build: the tree is {tree >> 20} MiB, too big for "
                         f"a {DISK_BYTES >> 20} MiB disk")
    with open(raw, "wb") as f:
        f.truncate(DISK_BYTES)
    # inode tables and the journal zeroed now (a sparse file: holes), so the guest's
    # ext4lazyinit never writes them into a sandbox's overlay
    uuid = str(uuid_mod.uuid4())
    b.host(["mkfs.ext4", "-q", "-F", "-L", DISK_LABEL, "-U", uuid, "-d", str(root), "-m", "0",
            "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard", str(raw)], "mkfs.ext4")
    b.host(["e2fsck", "-fn", str(raw)], "e2fsck")
    return {"filesystem": "ext4", "label": DISK_LABEL, "uuid": uuid,
            "allocated_bytes": raw.stat().st_blocks * 512, "tree_bytes": tree}


def _publish(vm_root: Path, name: str, suite: str, mirror: str, security: str,
             out_dir: Path, staging: Path, disk: dict[str, Any],
             packages: list[dict[str, Any]], seconds: float) -> VmDisk:
    raw = staging / DISK_FILE
    os.chmod(raw, 0o444)
    manifest = {
        # the vm backend's keys (docs/backends/vm.md)
        "name": name, "format": DISK_FORMAT, "bytes": raw.stat().st_size,
        "sha256": sha256_file(raw), "init": "/sbin/init",
        "recipe": DESKTOP_RECIPE,
        # what it is and what it was built from
        **disk, "created": time.time(), "build_seconds": round(seconds, 1),
        "source": {"debootstrap": suite, "variant": "minbase", "mirror": mirror,
                   "security": security, "packages_asked": DESKTOP_PACKAGES},
        "session": {"user": DESKTOP_USER, "uid": DESKTOP_UID, "display": list(DESKTOP_MODE),
                    "window_manager": "jwm", "editor": EDITOR_COMMAND, "note_file": NOTE_FILE,
                    "launchers": ["Menu", "Terminal", "Editor", "Spreadsheet"]},
        "packages": packages,
    }
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    os.chmod(staging / MANIFEST_FILE, 0o444)
    new = out_dir.with_name(out_dir.name + f".new-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    for f in (DISK_FILE, MANIFEST_FILE):
        os.rename(staging / f, new / f)
    old = out_dir.with_name(out_dir.name + f".old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(new, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return resolve_vm_disk(vm_root, name)
