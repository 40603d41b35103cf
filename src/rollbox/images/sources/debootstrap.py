"""Image source: debootstrap of a minbase Debian suite into one layer."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollbox.errors import BadRequest, InfraError
from rollbox.images.names import validate_name
from rollbox.images.overlay import remove_entry
from rollbox.images.store import Image, ImageStore, Progress

DEBIAN_CONFIG: dict[str, Any] = {
    "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8"},
    "cwd": "/",
    "user": "root",
}
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def _noop(_msg: str) -> None:
    pass


def _sources_entries() -> list[tuple[str, list[str]]]:
    """(uri, suites) of every deb entry in /etc/apt/sources.list(.d)."""
    entries: list[tuple[str, list[str]]] = []
    files = [Path("/etc/apt/sources.list")]
    d = Path("/etc/apt/sources.list.d")
    if d.is_dir():
        files += sorted(d.iterdir())
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.name.endswith(".list"):
            for line in text.splitlines():
                fields = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).split()
                if len(fields) >= 3 and fields[0] == "deb":
                    entries.append((fields[1], [fields[2]]))
        elif path.name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                kv: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    k, _, v = line.partition(":")
                    kv[k.strip().lower()] = v.strip()
                if "deb" in kv.get("types", "").split() and kv.get("enabled", "yes") != "no":
                    for uri in kv.get("uris", "").split():
                        entries.append((uri, kv.get("suites", "").split()))
    return entries


def default_mirror(suite: str = "bookworm") -> str:
    """The host's main Debian archive URI (not security/updates), else deb.debian.org."""
    for uri, suites in _sources_entries():
        if "security" in uri or not uri.startswith(("http://", "https://")):
            continue
        if suite in suites or any(s.split("-")[0] == suite for s in suites):
            return uri.rstrip("/")
    return DEFAULT_MIRROR


def _scrub_rootfs(root: Path) -> None:
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb",
                    "var/cache/debconf/*-old", "var/log/*.log", "var/log/apt/*",
                    "var/lib/dpkg/*-old", "dev/*", "tmp/*", "var/tmp/*", "root/.cache"):
        for path in root.glob(pattern):
            if path.name in ("lock", "partial", "auxfiles"):
                continue
            remove_entry(path)
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("# rollbox: replaced at sandbox start\n")
    (root / "etc/hostname").write_text("sandbox\n")
    machine_id = root / "etc/machine-id"
    if machine_id.exists():
        machine_id.write_text("")


def build_debian_base(store: ImageStore, name: str = "debian:bookworm", suite: str = "bookworm",
                      mirror: str | None = None, *, progress: Progress | None = None,
                      extra_packages: list[str] | None = None) -> Image:
    """debootstrap a minbase Debian ``suite`` into one layer and tag it ``name``.

    debootstrap's output goes to ``<store>/logs/debootstrap-<suite>-<time>.log``;
    ``progress`` gets one line per stage.
    """
    validate_name(name)
    if not re.fullmatch(r"[a-z][a-z0-9.-]*", suite):
        raise BadRequest(f"invalid Debian suite {suite!r}")
    if shutil.which("debootstrap") is None:
        raise InfraError("debootstrap not found: install it (make deps)")
    say = progress or _noop
    mirror = mirror or default_mirror(suite)
    log_path = store.logs_dir / f"debootstrap-{suite}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    staging = store.staging_dir("debian")
    root = staging / "rootfs"
    cmd = ["debootstrap", "--variant=minbase"]
    if extra_packages:
        cmd.append("--include=" + ",".join(extra_packages))
    cmd += [suite, str(root), mirror]
    try:
        say(f"debootstrap {suite} from {mirror} (log: {log_path})")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            _follow_log(proc, log_path, say)
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            raise InfraError(f"debootstrap failed (exit {proc.returncode}); see {log_path}: "
                             + " | ".join(tail))
        say("scrubbing caches and logs")
        _scrub_rootfs(root)
        digest = store.add_layer_from_dir(root, source=f"debootstrap:{suite}:{mirror}",
                                          progress=progress)
        return store.tag(name, [digest], DEBIAN_CONFIG)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _follow_log(proc: subprocess.Popen[bytes], log_path: Path,
                say: Callable[[str], None]) -> None:
    """Report debootstrap's "I: ..." stage lines while it runs."""
    pos = 0
    last = ""
    while True:
        done = proc.poll() is not None
        with open(log_path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            pos += nl + 1
            for line in chunk[:nl].decode(errors="replace").splitlines():
                if line.startswith("I: ") and line != last:
                    last = line
                    say(line[3:])
        if done:
            return
        time.sleep(0.5)
