"""Image source: a ``docker save`` tarball or an OCI image-layout archive.

Each layer tar is extracted under ``store.tmp_dir`` (same filesystem as the layers) in overlayfs
format (:mod:`rollbox.images.overlay`): OCI whiteouts become overlay whiteouts, members never
escape the layer; consecutive small layers are merged into one EROFS layer. Git repositories
keep only what HEAD reaches, scrubbed across the layers that change them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import IO, Any

from rollbox.errors import BadRequest, InfraError
from rollbox.images import git
from rollbox.images.names import validate_name
from rollbox.images.overlay import (
    SMALL_LAYER_BYTES,
    is_opaque,
    is_whiteout,
    lstat_or_none,
    make_whiteout,
    merge_layer_dir,
    remove_entry,
    set_opaque,
    strip_overlay_markers,
)
from rollbox.images.sources.debootstrap import DEBIAN_CONFIG
from rollbox.images.store import Image, ImageStore, Progress
from rollbox.models import GitRepoFacts


def _noop(_msg: str) -> None:
    pass


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
        st = lstat_or_none(nxt)
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
                if lstat_or_none(target) is None:  # same-layer entries win over its own whiteouts
                    make_whiteout(target)
                continue
            parent = _dir_beneath(dest, parts[:-1], create=True)
            target = parent / base
            existing = lstat_or_none(target)
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
                    remove_entry(target)
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
                    sst = lstat_or_none(src_path)
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
                st = lstat_or_none(here / part)
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
