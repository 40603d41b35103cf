"""Layer sources: a directory, OCI/docker archives, debootstrap, an overlayfs upper, busybox.

Everything is staged under ``store.tmp_dir`` (same filesystem as the layers) in overlayfs
whiteout format: a deleted path is a 0:0 character device, an opaque directory carries
``trusted.overlay.opaque=y``. mkfs.erofs keeps both, so the layers stack under overlayfs as is.
"""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rollbox.errors import BadRequest, InfraError
from rollbox.images import git
from rollbox.images.store import Image, ImageStore, Progress, validate_name
from rollbox.models import GitRepoFacts

OPAQUE_XATTR = "trusted.overlay.opaque"
# Consecutive layers smaller than this (extracted) are merged into one EROFS layer.
SMALL_LAYER_BYTES = 16 * 2**20
DEBIAN_CONFIG: dict[str, Any] = {
    "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8"},
    "cwd": "/",
    "user": "root",
}
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Caches dropped by layer_from_upper; "/..." patterns match the whole path, others a basename.
UPPER_CACHE_EXCLUDES = ["/var/cache/apt/archives/*.deb", "/var/lib/apt/lists/*", "/root/.cache",
                        "/tmp/*"]
# Bytecode policy. Layers the image builder makes from trusted sources (--run commands,
# --from-dir) keep the ``__pycache__`` of the standard library and of installed packages: a cold
# `import pytest` is ~4x slower without it. Everywhere else (a workspace, a task's tests, which
# sandboxes may hide) ``__pycache__`` is dropped, and so is what pytest compiled (its
# assertion-rewritten modules) wherever it is: no layer keeps bytecode of a hidden path next to
# it. Snapshots and uploaded layers drop every ``__pycache__`` (their sources are untrusted).
BYTECODE_KEPT_UNDER = ("/usr/lib/python3*/*", "/usr/local/lib/python3*/*")
PYTEST_BYTECODE = "*-pytest-*.pyc"


def bytecode_dropped(rel: str, name: str, *, keep_library: bool = True) -> bool:
    """Whether the entry ``name`` at ``rel`` (its absolute path in the image) is bytecode a
    layer leaves out (see BYTECODE_KEPT_UNDER)."""
    if name == "__pycache__":
        return not keep_library or not any(fnmatch.fnmatchcase(rel, p)
                                           for p in BYTECODE_KEPT_UNDER)
    return fnmatch.fnmatchcase(name, PYTEST_BYTECODE)


def dropped_bytecode(root: Path, *, keep_library: bool = True) -> list[str]:
    """Paths below ``root`` (relative, for ``add_layer_from_dir(exclude=...)``) of the bytecode
    its layer leaves out; links are not followed."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = "/" + os.path.relpath(dirpath, root).removeprefix(".").lstrip("/")
        for name in list(dirnames) + filenames:
            rel = rel_dir.rstrip("/") + "/" + name
            if bytecode_dropped(rel, name, keep_library=keep_library):
                out.append(rel.lstrip("/"))
                if name in dirnames:
                    dirnames.remove(name)
    return out


# Overlay xattrs that only make sense inside the upper's own overlay mount.
_DROPPED_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
_REFUSED_OVERLAY_XATTRS = {"trusted.overlay.redirect", "trusted.overlay.metacopy",
                           "user.overlay.redirect", "user.overlay.metacopy"}


def _noop(_msg: str) -> None:
    pass


# ---- whiteout helpers ----------------------------------------------------------------------

def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def make_whiteout(path: Path | str) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def is_opaque(path: Path | str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def set_opaque(path: Path | str) -> None:
    os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)


def _clear_opaque(path: Path | str) -> None:
    try:
        os.removexattr(path, OPAQUE_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise


def _remove(path: Path) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _lstat(path: Path | str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


# ---- tar extraction ------------------------------------------------------------------------

def safe_member_parts(name: str) -> list[str]:
    """Components of a tar member name; BadRequest for absolute paths and ``..``."""
    if "\x00" in name:
        raise BadRequest(f"tar member name contains NUL: {name!r}")
    if name.startswith("/"):
        raise BadRequest(f"tar member has an absolute path: {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise BadRequest(f"tar member escapes the layer with '..': {name!r}")
    return parts


def _dir_beneath(root: Path, parts: list[str], *, create: bool) -> Path:
    """``root/parts`` as a real directory, never passing through a symlink.

    Missing components are created when ``create``; a whiteout in the way (same layer) is
    replaced by an opaque directory.
    """
    cur = root
    for part in parts:
        nxt = cur / part
        st = _lstat(nxt)
        if st is None:
            if not create:
                raise BadRequest(f"tar member refers to missing directory {nxt.relative_to(root)}")
            os.mkdir(nxt, 0o755)
        elif stat.S_ISLNK(st.st_mode):
            raise BadRequest(f"tar member would write through symlink "
                             f"{nxt.relative_to(root)}")
        elif is_whiteout(st) and create:
            os.unlink(nxt)
            os.mkdir(nxt, 0o755)
            set_opaque(nxt)
        elif not stat.S_ISDIR(st.st_mode):
            raise BadRequest(f"tar member needs {nxt.relative_to(root)} to be a directory")
        cur = nxt
    return cur


def _apply_xattrs(path: Path, member: tarfile.TarInfo) -> None:
    for key, value in member.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        xname = key[len("SCHILY.xattr."):]
        # trusted.* (overlay metadata among it) and security labels are the host's business.
        if not (xname.startswith("user.") or xname == "security.capability"):
            continue
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
        try:
            os.setxattr(path, xname, raw, follow_symlinks=False)
        except OSError:
            pass  # the staging filesystem may not support it; the image still works


def extract_layer_tar(fileobj: IO[bytes], dest: Path) -> int:
    """Extract one layer tar stream into empty ``dest`` in overlayfs format.

    OCI whiteouts become overlay whiteouts; members may not escape ``dest`` (absolute names,
    ``..``, parents that are symlinks, hard links outside). Device nodes are skipped.
    Returns the bytes of regular files written.
    """
    total = 0
    dir_times: list[tuple[Path, int]] = []
    try:
        tf = tarfile.open(fileobj=fileobj, mode="r|*")
    except tarfile.ReadError as exc:
        raise BadRequest(f"layer is not a (gzip/bzip2/xz) tar stream: {exc}") from exc
    with tf:
        for member in tf:
            parts = safe_member_parts(member.name)
            if not parts:  # "./": the layer root
                if member.isdir():
                    os.chown(dest, member.uid, member.gid)
                    os.chmod(dest, member.mode & 0o7777)
                    dir_times.append((dest, int(member.mtime)))
                continue
            base = parts[-1]
            if base == ".wh..wh..opq":
                set_opaque(_dir_beneath(dest, parts[:-1], create=True))
                continue
            if base.startswith(".wh."):
                hidden = base[len(".wh."):]
                if hidden in ("", ".", ".."):
                    raise BadRequest(f"invalid whiteout member {member.name!r}")
                target = _dir_beneath(dest, parts[:-1], create=True) / hidden
                if _lstat(target) is None:  # same-layer entries win over its own whiteouts
                    make_whiteout(target)
                continue
            parent = _dir_beneath(dest, parts[:-1], create=True)
            target = parent / base
            existing = _lstat(target)
            if member.isdir():
                if existing is not None and not stat.S_ISDIR(existing.st_mode):
                    os.unlink(target)
                    os.mkdir(target, 0o755)
                    set_opaque(target)
                elif existing is None:
                    os.mkdir(target, 0o755)
                dir_times.append((target, int(member.mtime)))
            else:
                if existing is not None:
                    _remove(target)
                if member.isreg():
                    src = tf.extractfile(member)
                    assert src is not None
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                    with os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                    total += member.size
                elif member.issym():
                    os.symlink(member.linkname, target)
                elif member.islnk():
                    lparts = safe_member_parts(member.linkname)
                    if not lparts:
                        raise BadRequest(f"hard link {member.name!r} to the layer root")
                    src_path = _dir_beneath(dest, lparts[:-1], create=False) / lparts[-1]
                    sst = _lstat(src_path)
                    if sst is None or stat.S_ISDIR(sst.st_mode):
                        raise BadRequest(f"hard link {member.name!r} -> {member.linkname!r}: "
                                         "target missing from this layer")
                    os.link(src_path, target, follow_symlinks=False)
                    continue  # shares the target's inode and metadata
                elif member.isfifo():
                    os.mkfifo(target, 0o600)
                else:
                    continue  # char/block devices: the runtime provides /dev
            os.chown(target, member.uid, member.gid, follow_symlinks=False)
            if not member.issym():
                # chmod after chown: chown clears setuid bits.
                os.chmod(target, member.mode & 0o7777)
                _apply_xattrs(target, member)
            if not member.isdir():
                os.utime(target, ns=(int(member.mtime * 1e9),) * 2, follow_symlinks=False)
    for path, mtime in reversed(dir_times):
        os.utime(path, (mtime, mtime), follow_symlinks=False)
    return total


# ---- merging layers ------------------------------------------------------------------------

def _copy_dir_meta(src: Path, dst: Path) -> None:
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name == OPAQUE_XATTR:
            continue
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                    follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def merge_layer_dir(group: Path, layer: Path, *, keep_whiteouts: bool) -> None:
    """Apply overlay-format ``layer`` on top of ``group`` (both staging dirs), consuming it.

    ``keep_whiteouts``: other layers lie below ``group``, so its whiteouts and opaque markers
    must survive the merge to keep hiding their files.
    """
    for name in os.listdir(layer):
        src, dst = layer / name, group / name
        sst, dst_st = os.lstat(src), _lstat(dst)
        if is_whiteout(sst):
            if dst_st is not None:
                _remove(dst)
            if keep_whiteouts:
                os.rename(src, dst)
            continue
        if stat.S_ISDIR(sst.st_mode):
            opaque = is_opaque(src)
            if dst_st is not None and stat.S_ISDIR(dst_st.st_mode) and not opaque:
                merge_layer_dir(dst, src, keep_whiteouts=keep_whiteouts)
                _copy_dir_meta(src, dst)
                continue
            if dst_st is not None:
                _remove(dst)
            os.rename(src, dst)
            if keep_whiteouts and dst_st is not None and not stat.S_ISDIR(dst_st.st_mode):
                # The group's file or whiteout hid everything below at this path: so must
                # the directory that replaces it.
                set_opaque(dst)
            elif not keep_whiteouts:
                _clear_opaque(dst)
            continue
        if dst_st is not None:
            _remove(dst)
        os.rename(src, dst)


def strip_overlay_markers(root: Path) -> None:
    """Drop whiteouts and opaque markers from a bottom layer (nothing below to hide)."""
    for dirpath, dirnames, filenames in os.walk(root):
        _clear_opaque(dirpath)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if is_whiteout(os.lstat(path)):
                os.unlink(path)


# ---- OCI / docker archives -----------------------------------------------------------------

class _Archive:
    """An image archive open for reading; a context manager (closes the tar on any outcome)."""

    def __init__(self, path: Path) -> None:
        try:
            self.tar = tarfile.open(path, "r:*")
        except (tarfile.ReadError, OSError) as exc:
            raise BadRequest(f"{path} is not a readable tar archive: {exc}") from exc
        try:
            self.members: dict[str, tarfile.TarInfo] = {
                self._key(m.name): m for m in self.tar.getmembers()}
        except (tarfile.TarError, OSError) as exc:
            self.tar.close()
            raise BadRequest(f"{path} is not a readable tar archive: {exc}") from exc
        self.verified: set[str] = set()

    def __enter__(self) -> _Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tar.close()

    @staticmethod
    def _key(name: str) -> str:
        return "/".join(p for p in name.split("/") if p not in ("", "."))

    def open(self, name: str) -> IO[bytes]:
        member = self.members.get(self._key(name))
        for _ in range(8):  # docker save dedups identical layers by hard link
            if member is None or not member.islnk():
                break
            member = self.members.get(self._key(member.linkname))
        if member is None or not member.isfile():
            raise BadRequest(f"archive has no file {name!r}")
        f = self.tar.extractfile(member)
        assert f is not None
        return f

    def has(self, name: str) -> bool:
        return name in self.members

    def json(self, name: str) -> Any:
        try:
            return json.load(self.open(name))
        except ValueError as exc:
            raise BadRequest(f"archive file {name!r} is not valid JSON") from exc

    def blob_path(self, digest: str) -> str:
        """Path of a content-addressed blob, after checking its sha256 matches ``digest``."""
        alg, _, hexd = str(digest).partition(":")
        if alg != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
            raise BadRequest(f"unsupported or invalid blob digest {digest!r}")
        path = f"blobs/{alg}/{hexd}"
        if path not in self.verified:
            h = hashlib.sha256()
            f = self.open(path)
            while chunk := f.read(1 << 20):
                h.update(chunk)
            if h.hexdigest() != hexd:
                raise BadRequest(f"blob {digest} is corrupt (content hash differs)")
            self.verified.add(path)
        return path


_INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json"}


def _pick_manifest(arc: _Archive, index: dict[str, Any]) -> dict[str, Any]:
    manifests = index.get("manifests") or []
    if not manifests:
        raise BadRequest("OCI index lists no manifests")

    def score(m: dict[str, Any]) -> int:
        plat = m.get("platform") or {}
        if plat.get("os") == "unknown":  # attestation manifests from buildkit
            return -1
        if plat.get("os") in (None, "linux") and plat.get("architecture") in (None, "amd64"):
            return 1
        return 0

    best = max(manifests, key=score)
    doc = arc.json(arc.blob_path(best["digest"]))
    if best.get("mediaType") in _INDEX_TYPES or doc.get("mediaType") in _INDEX_TYPES:
        return _pick_manifest(arc, doc)
    return doc


def _config_from_oci(cfg: dict[str, Any]) -> dict[str, Any]:
    c = cfg.get("config") or cfg.get("Config") or {}
    env: dict[str, str] = {}
    for item in c.get("Env") or []:
        key, sep, value = str(item).partition("=")
        if sep:
            env[key] = value
    out: dict[str, Any] = {"env": env or dict(DEBIAN_CONFIG["env"]),
                           "cwd": c.get("WorkingDir") or "/", "user": c.get("User") or "root"}
    if c.get("Entrypoint"):
        out["entrypoint"] = list(c["Entrypoint"])
    if c.get("Cmd"):
        out["cmd"] = list(c["Cmd"])
    return out


def import_oci_archive(store: ImageStore, tar_path: Path, name: str, *,
                       progress: Progress | None = None,
                       keep_git_history: bool = False) -> Image:
    """Import a ``docker save`` tarball or an OCI image-layout archive as image ``name``.
    Its git repositories keep only what HEAD reaches unless ``keep_git_history``."""
    validate_name(name)
    with _Archive(Path(tar_path)) as arc:
        return _import_archive(store, arc, Path(tar_path), name, progress, keep_git_history)


def _import_archive(store: ImageStore, arc: _Archive, tar_path: Path, name: str,
                    progress: Progress | None, keep_git_history: bool) -> Image:
    say = progress or _noop
    layer_names: list[str]
    if arc.has("manifest.json"):
        manifest = arc.json("manifest.json")
        if not isinstance(manifest, list) or not manifest:
            raise BadRequest("docker manifest.json must be a non-empty list")
        entry = manifest[0]
        layer_names = []
        for lname in entry.get("Layers") or []:
            m = re.fullmatch(r"(?:\./)?blobs/sha256/([0-9a-f]{64})", str(lname))
            # docker >= 25 saves layers as OCI blobs: check them like the OCI path does
            layer_names.append(arc.blob_path(f"sha256:{m.group(1)}") if m else str(lname))
        config = arc.json(entry["Config"]) if entry.get("Config") else {}
    elif arc.has("index.json"):
        if not arc.has("oci-layout"):
            raise BadRequest("OCI archive lacks the oci-layout file")
        doc = _pick_manifest(arc, arc.json("index.json"))
        layer_names = []
        for layer in doc.get("layers") or []:
            if "zstd" in str(layer.get("mediaType", "")):
                raise BadRequest("zstd-compressed layers are not supported; use gzip or plain")
            layer_names.append(arc.blob_path(layer["digest"]))
        config = arc.json(arc.blob_path(doc["config"]["digest"])) if doc.get("config") else {}
    else:
        raise BadRequest(f"{tar_path} has neither manifest.json (docker save) "
                         "nor index.json (OCI layout)")
    if not layer_names:
        raise BadRequest("image has no layers")
    staging = store.staging_dir("import")
    try:
        extracted: list[tuple[Path, int]] = []
        for i, lname in enumerate(layer_names):
            say(f"extracting layer {i + 1}/{len(layer_names)}")
            dest = staging / f"l{i}"
            dest.mkdir()
            extracted.append((dest, extract_layer_tar(arc.open(lname), dest)))
        # Group consecutive small layers; a big layer stays alone (rebuilt independently).
        groups: list[list[Path]] = []
        small_run = False
        for dest, size in extracted:
            small = size < SMALL_LAYER_BYTES
            if small and small_run:
                groups[-1].append(dest)
            else:
                groups.append([dest])
            small_run = small
        digests = []
        scratch = staging / "git"
        scratch.mkdir()
        repos = _LayeredRepos(scratch)
        for gi, group in enumerate(groups):
            base = group[0]
            for upper in group[1:]:
                merge_layer_dir(base, upper, keep_whiteouts=gi > 0)
            if gi == 0:
                strip_overlay_markers(base)
            facts = (git.process_tree(base, keep_history=True, scratch=scratch)
                     if keep_git_history else repos.scrub_layer(base, bottom=gi == 0))
            say(f"building layer {gi + 1}/{len(groups)} ({len(group)} source layers)")
            digests.append(store.add_layer_from_dir(
                base, source=f"oci:{Path(tar_path).name}#{gi}", progress=progress,
                git_repos=facts))
        say("tagging")
        return store.tag(name, digests, _config_from_oci(config))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- directories ---------------------------------------------------------------------------

def build_from_directory(store: ImageStore, src_dir: Path, name: str,
                         config: dict[str, Any] | None = None, *,
                         progress: Progress | None = None,
                         keep_git_history: bool = False) -> Image:
    """One-layer image from a directory tree (taken as is, ownership included, bytecode as
    BYTECODE_KEPT_UNDER says). Its git repositories keep only what HEAD reaches (a staging copy
    is scrubbed; ``src_dir`` is never changed) unless ``keep_git_history``."""
    validate_name(name)
    src = Path(src_dir)
    source = f"dir:{src.resolve()}"
    if keep_git_history or next(git.git_dirs(src), None) is None:
        repos = git.process_tree(src, keep_history=True, scratch=store.tmp_dir)
        digest = store.add_layer_from_dir(src, source=source, progress=progress,
                                          git_repos=repos,
                                          exclude=dropped_bytecode(src))
        return store.tag(name, [digest], config)
    staging = store.staging_dir("dir")
    try:
        root = staging / "rootfs"
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(src), str(root)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise InfraError(f"copying {src} for its git scrub failed: {proc.stderr[-300:]}")
        if progress:
            progress("keeping only what HEAD reaches in its git repositories")
        repos = git.process_tree(root, keep_history=False, scratch=staging)
        digest = store.add_layer_from_dir(root, source=source, progress=progress,
                                          git_repos=repos,
                                          exclude=dropped_bytecode(root))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return store.tag(name, [digest], config)


class _LayeredRepos:
    """Git repositories across the layers of an archive, lowest first. A repository a later
    layer changes (a commit, a checkout, a fetch on top of a clone) is scrubbed as a whole: the
    unscrubbed union of its layers so far is kept aside, and the layer gets that union,
    scrubbed, as an opaque directory (the lower layers' copy, scrubbed at their own HEAD, stays
    hidden below it)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.union: dict[str, Path] = {}  # repository dir in the layer -> union so far

    def _copy(self, src: Path, dst: Path) -> None:
        proc = subprocess.run(["cp", "-a", "--", str(src), str(dst)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise InfraError(f"copying git repository {src} failed: {proc.stderr[-300:]}")

    def scrub_layer(self, base: Path, *, bottom: bool) -> list[GitRepoFacts]:
        for rel in list(self.union):
            here = base
            for part in rel.strip("/").split("/"):
                st = _lstat(here / part)
                if st is None or not stat.S_ISDIR(st.st_mode) or is_whiteout(st):
                    if st is not None:  # replaced or deleted in this layer
                        del self.union[rel]
                    here = None
                    break
                here = here / part
            if here is None:
                continue
            if is_opaque(here):
                shutil.rmtree(self.union[rel])
                os.rename(here, self.union[rel])
                here.mkdir()
            else:
                merge_layer_dir(self.union[rel], here, keep_whiteouts=False)
            shutil.rmtree(here)
            self._copy(self.union[rel], here)
            if not bottom:
                set_opaque(here)
        for gitdir in git.git_dirs(base):
            rel = str(gitdir.relative_to(base))
            if rel not in self.union:
                self.union[rel] = self.scratch / f"repo{len(self.union)}-{os.getpid()}"
                self._copy(gitdir, self.union[rel])
        return git.process_tree(base, keep_history=False, scratch=self.scratch)


BUSYBOX_RECIPE = "busybox-every-applet-1"


def build_busybox_image(store: ImageStore, name: str = "busybox:test", *,
                        busybox: Path = Path("/bin/busybox")) -> Image:
    """A tiny static image for fast tests: /bin/busybox plus a /bin symlink for every applet
    (as the busybox image has; command strings run under the platform's bash, which finds
    only the applets that are linked)."""
    if not busybox.is_file():
        raise InfraError(f"{busybox} not found: install busybox-static (make deps)")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    staging = store.staging_dir("busybox")
    try:
        root = staging / "rootfs"
        for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root"):
            (root / d).mkdir(parents=True)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root / "root", 0o700)
        shutil.copy2(busybox, root / "bin" / "busybox")
        os.chmod(root / "bin" / "busybox", 0o755)
        for applet in applets:
            if applet != "busybox" and "/" not in applet:
                os.symlink("busybox", root / "bin" / applet)
        (root / "etc" / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        # Fixed owner and times: rebuilding from the same busybox gives the same digest.
        mtime = int(busybox.stat().st_mtime)
        for p in sorted(root.rglob("*"), reverse=True) + [root]:
            os.chown(p, 0, 0, follow_symlinks=False)
            os.utime(p, (mtime, mtime), follow_symlinks=False)
        config = {"env": {"PATH": "/bin", "HOME": "/root"}, "cwd": "/", "user": "root",
                  "recipe": BUSYBOX_RECIPE}
        digest = store.add_layer_from_dir(root, source=f"busybox:{busybox}")
        return store.tag(name, [digest], config)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def busybox_image_current(store: ImageStore, name: str = "busybox:test") -> bool:
    """Whether ``name`` exists and was built by this recipe (an older one linked 20 applets,
    which a command string, run by the platform's bash, does not find beyond)."""
    try:
        return store.resolve(name).config.get("recipe") == BUSYBOX_RECIPE
    except Exception:  # noqa: BLE001 - missing or unreadable: (re)build it
        return False


# ---- overlay upper -> layer ----------------------------------------------------------------

def _excluded(rel: str, name: str, patterns: list[str]) -> bool:
    for pat in patterns:
        if pat.startswith("/"):
            if fnmatch.fnmatchcase(rel, pat.rstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pat):
            return True
    return False


def _map_id(value: int, shift: int) -> int:
    if shift <= 0:
        return value
    if shift <= value < shift + 65536:
        return value - shift
    return 65534  # not an id of the sandbox: nobody


def _copy_xattrs_from_upper(src: str, dst: str, rel: str) -> None:
    for xname in os.listxattr(src, follow_symlinks=False):
        if xname in _REFUSED_OVERLAY_XATTRS:
            raise BadRequest(
                f"{rel} carries {xname}: the overlay was mounted with redirect_dir/metacopy; "
                "its upper is not a self-contained layer (mount with redirect_dir=off,"
                "metacopy=off)")
        if xname == OPAQUE_XATTR or xname == "user.overlay.opaque":
            if os.getxattr(src, xname, follow_symlinks=False) == b"y":
                set_opaque(dst)
            continue
        if xname.startswith(_DROPPED_OVERLAY_XATTRS):
            continue
        try:
            os.setxattr(dst, xname, os.getxattr(src, xname, follow_symlinks=False),
                        follow_symlinks=False)
        except OSError:
            pass


def layer_from_upper(store: ImageStore, upper_dir: Path, *, exclude: list[str] | None = None,
                     source: str, id_shift: int = 0,
                     progress: Progress | None = None, keep_git_history: bool = False,
                     merged: Path | None = None) -> str:
    """Turn an overlayfs upper directory into a layer (the sandbox's changes, scrubbed).

    Copies the upper (it may belong to a live sandbox) minus caches and ``exclude`` patterns
    (``/abs/glob`` on the path, ``name`` on a basename); whiteouts always survive. Overlay
    private xattrs are dropped except the opaque marker; redirect/metacopy uppers are refused.
    ``id_shift``: host uid/gid of the sandbox's root, mapped back to 0 in the layer. Git
    repositories made in the sandbox keep only what HEAD reaches unless ``keep_git_history``;
    with ``merged`` (the stopped sandbox's overlay view), a repository of a lower layer that the
    commands changed is taken whole from it and scrubbed too (snapshot.complete_repos).
    """
    upper_dir = Path(upper_dir)
    if not upper_dir.is_dir():
        raise BadRequest(f"upper dir {upper_dir} is not a directory")
    patterns = UPPER_CACHE_EXCLUDES + list(exclude or [])
    staging = store.staging_dir("upper")
    root = staging / "rootfs"
    inodes: dict[tuple[int, int], str] = {}
    dir_meta: list[tuple[str, os.stat_result]] = []

    def copy_meta(src: str, dst: str, st: os.stat_result, rel: str) -> None:
        os.chown(dst, _map_id(st.st_uid, id_shift), _map_id(st.st_gid, id_shift),
                 follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            _copy_xattrs_from_upper(src, dst, rel)
        if stat.S_ISDIR(st.st_mode):
            dir_meta.append((dst, st))
        else:
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    def walk(src_dir: str, dst_dir: str, rel_dir: str) -> None:
        with os.scandir(src_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            src, dst, rel = entry.path, os.path.join(dst_dir, entry.name), \
                rel_dir.rstrip("/") + "/" + entry.name
            st = entry.stat(follow_symlinks=False)
            if is_whiteout(st):
                make_whiteout(dst)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
                continue
            if _excluded(rel, entry.name, patterns) or bytecode_dropped(rel, entry.name):
                continue
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                os.mkdir(dst, 0o700)
                walk(src, dst, rel)
            elif stat.S_ISREG(mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in inodes:
                    os.link(inodes[key], dst)
                    continue
                shutil.copyfile(src, dst, follow_symlinks=False)
                inodes[key] = dst
            elif stat.S_ISLNK(mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(dst, 0o600)
            else:
                continue  # sockets, device nodes: runtime state, not image content
            copy_meta(src, dst, st, rel)

    try:
        if progress:
            progress(f"copying {upper_dir}")
        os.mkdir(root, 0o755)
        walk(str(upper_dir), str(root), "/")
        copy_meta(str(upper_dir), str(root), os.lstat(upper_dir), "/")
        for path, st in reversed(dir_meta):
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
        if merged is not None and not keep_git_history:
            from rollbox.images.snapshot import complete_repos  # snapshot imports this module

            complete_repos(merged, root, id_shift=id_shift)
        repos = git.process_tree(root, keep_history=keep_git_history, scratch=staging)
        return store.add_layer_from_dir(root, source=source, progress=progress,
                                        git_repos=repos)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- debootstrap ---------------------------------------------------------------------------

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
            _remove(path)
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
