"""What a QEMU process is allowed, read from the host's /proc (red team F41): its ids,
capabilities, seccomp mode, no_new_privs, which namespaces it shares with the host, its cgroup,
and the files its mount namespace shows. Owns only reading and judging; starts nothing."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Namespaces a jailed QEMU must not share with the host (this process's: the edge's).
JAIL_NAMESPACES = ("mnt", "pid", "net")


@dataclass
class JailReport:
    pid: int
    uids: tuple[int, ...]  # real, effective, saved, fs
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    cap_eff: int
    cap_bnd: int
    seccomp: int  # 0 none, 1 strict, 2 filter
    no_new_privs: int
    shared_ns: tuple[str, ...]  # of JAIL_NAMESPACES, those that are the host's
    cgroup: str


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def inspect(pid: int) -> JailReport:
    st = status(pid)
    shared = tuple(ns for ns in JAIL_NAMESPACES
                   if os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}"))
    return JailReport(
        pid=pid, uids=tuple(int(x) for x in st["Uid"].split()),
        gids=tuple(int(x) for x in st["Gid"].split()),
        groups=tuple(int(x) for x in st.get("Groups", "").split()),
        cap_eff=int(st["CapEff"], 16), cap_bnd=int(st["CapBnd"], 16),
        seccomp=int(st.get("Seccomp", "0")), no_new_privs=int(st.get("NoNewPrivs", "0")),
        shared_ns=shared, cgroup=Path(f"/proc/{pid}/cgroup").read_text())


def problems(r: JailReport, sandbox_id: str | None = None) -> list[str]:
    """Every way ``r`` falls short of the jail (empty: jailed)."""
    out = []
    if 0 in r.uids or 0 in r.gids or 0 in r.groups:
        out.append(f"runs with host uid/gid 0 (uids {r.uids}, gids {r.gids}, groups {r.groups})")
    if r.cap_eff:
        out.append(f"has capabilities {r.cap_eff:#x}")
    if r.seccomp != 2:
        out.append(f"seccomp mode {r.seccomp} (no -sandbox filter)")
    if r.no_new_privs != 1:
        out.append("no_new_privs not set")
    if r.shared_ns:
        out.append(f"shares the host's {', '.join(r.shared_ns)} namespace(s)")
    if sandbox_id is not None and sandbox_id not in r.cgroup:
        out.append(f"not in a cgroup of its sandbox: {r.cgroup!r}")
    return out


def visible_files(pid: int, top: str = "/", limit: int = 2000) -> list[str]:
    """Paths the process's mount namespace shows below ``top`` (through /proc/<pid>/root;
    /proc, /sys and /dev not walked), at most ``limit``."""
    root = Path(f"/proc/{pid}/root")
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root / top.lstrip("/")):
        rel = "/" + os.path.relpath(dirpath, root).lstrip(".")
        dirnames[:] = [d for d in dirnames
                       if not (rel == "/" and d in ("proc", "sys", "dev"))]
        for name in dirnames + filenames:
            out.append(os.path.join(rel, name).replace("//", "/"))
            if len(out) >= limit:
                return out
    return out


def qemu_pids_of(sandbox_id: str) -> list[int]:
    """QEMU processes in a cgroup whose path names the sandbox (how the jail puts them)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not (d / "comm").read_text().startswith("qemu-system"):
                continue
            if sandbox_id in (d / "cgroup").read_text():
                out.append(int(d.name))
        except OSError:
            continue
    return out
