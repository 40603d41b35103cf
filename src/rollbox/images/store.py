"""Content-addressed store of EROFS layers and named images (refs).

Layout under ``root``::

    layers/<digest>.erofs   digest = "sha256-<hex of the .erofs file>"
    layers/<digest>.json    {"digest", "size", "created", "source", "files"}
    refs/<quoted name>.json {"name", "layers": [lowest, ..., top], "created", "config"}
    mnt/<digest>            read-only mount point (mountpoints.py, mounts.py)
    tmp/                    staging on the same filesystem, so renames are atomic

Every file that readers see is written to a temp file and renamed into place, so concurrent
readers never observe a half-written layer or ref.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbox.config import Settings
from rollbox.errors import BadRequest, InfraError, NotFound
from rollbox.images.lazy.paths import LazyPaths, read_record
from rollbox.images.mountpoints import LayerMountPoints
from rollbox.images.names import is_digest, validate_digest, validate_name
from rollbox.models import GitRepoFacts

Progress = Callable[[str], None]

EROFS_MAGIC = 0xE0F5E1E2
EROFS_SB_OFFSET = 1024
# Fixed filesystem UUID: with SOURCE_DATE_EPOCH this makes mkfs.erofs output a pure function of
# the tree, so rebuilding an unchanged directory yields the same digest.
EROFS_UUID = "00000000-0000-0000-0000-000000000000"
# A layer added moments ago may not be tagged yet; gc leaves it alone for this long.
GC_GRACE_SECONDS = 600.0

DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
DEFAULT_CONFIG: dict[str, Any] = {"env": DEFAULT_ENV, "cwd": "/", "user": "root"}


def normalize_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """Fill in env/cwd/user defaults; env values must be strings."""
    out = copy.deepcopy(DEFAULT_CONFIG)
    if config:
        for key, value in config.items():
            if key == "env":
                if not isinstance(value, dict):
                    raise BadRequest("image config env must be a mapping")
                out["env"] = {str(k): str(v) for k, v in value.items()}
            else:
                out[key] = copy.deepcopy(value)
    if not isinstance(out.get("cwd"), str) or not out["cwd"].startswith("/"):
        raise BadRequest("image config cwd must be an absolute path")
    if not isinstance(out.get("user"), str) or not out["user"]:
        raise BadRequest("image config user must be a non-empty string")
    return out


SUDO_LABEL = "rollbox.sudo"


def sudo_uids(config: dict[str, Any]) -> list[int]:
    """The uids an image lets raise privileges through the agent (its config label
    ``rollbox.sudo``: comma-separated uids, at most 16); [] if it declares none (then its
    sandboxes have no sudo socket at all)."""
    labels = config.get("labels")
    if not isinstance(labels, dict) or SUDO_LABEL not in labels:
        return []
    raw = str(labels[SUDO_LABEL])
    try:
        uids = [int(part) for part in raw.split(",")]
    except ValueError:
        raise BadRequest(f"image label {SUDO_LABEL}={raw!r}: comma-separated uids") from None
    if not 1 <= len(uids) <= 16 or any(not 0 <= u < 2**32 - 1 for u in uids):
        raise BadRequest(f"image label {SUDO_LABEL}={raw!r}: 1 to 16 uids, each 0..2**32-2")
    return uids


@dataclass
class Image:
    name: str
    layers: list[str]
    config: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEFAULT_CONFIG))
    created: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers), "created": self.created,
                "config": copy.deepcopy(self.config)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Image:
        return cls(name=str(data["name"]), layers=[str(x) for x in data["layers"]],
                   config=normalize_config(data.get("config")),
                   created=float(data.get("created", 0.0)))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256-" + h.hexdigest()


def scan_tree(src: Path, exclude: Iterable[str] = ()) -> tuple[int, int, int]:
    """(entries, bytes of regular files, newest mtime in whole seconds rounded up), leaving
    out the ``exclude`` paths (relative to ``src``) and what is below them."""
    files = 0
    size = 0
    newest = int(math.ceil(os.lstat(src).st_mtime))
    skip = {os.path.join(src, p) for p in exclude}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        for name in dirnames + filenames:
            if os.path.join(dirpath, name) in skip:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
            newest = max(newest, int(math.ceil(st.st_mtime)))
    return files, size, newest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ImageStore:
    """Layers and refs under ``root``; safe for concurrent readers (all writes are renames)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else Settings().images_dir
        self.layers_dir = self.root / "layers"
        self.refs_dir = self.root / "refs"
        self.mnt_dir = self.root / "mnt"
        self.tmp_dir = self.root / "tmp"
        self.logs_dir = self.root / "logs"
        for d in (self.layers_dir, self.refs_dir, self.mnt_dir, self.tmp_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.tmp_dir, 0o700)

    # ---- layers -------------------------------------------------------------------------

    def layer_path(self, digest: str) -> Path:
        """Path of the layer's EROFS file; NotFound if the store lacks it.

        A lazy layer (no local file, a lazy record: see rollbox.images.lazy) maps to the file
        the lazy-loading daemon serves; mounting it goes through the loader (mounts.py)."""
        path = self.layers_dir / f"{validate_digest(digest)}.erofs"
        if not path.is_file():
            if self.is_lazy(digest):
                return LazyPaths(self.root).served_path(digest)
            raise NotFound(f"layer {digest} is not in the image store", digest=digest)
        return path

    def has_layer(self, digest: str) -> bool:
        """The layer's whole file is local (lazy layers are not)."""
        return is_digest(digest) and (self.layers_dir / f"{digest}.erofs").is_file()

    def is_lazy(self, digest: str) -> bool:
        """Served lazily: a lazy record and no local file (a full pull wins)."""
        return (is_digest(digest) and not (self.layers_dir / f"{digest}.erofs").is_file()
                and read_record(self.root, digest) is not None)

    def layer_meta(self, digest: str) -> dict[str, Any]:
        if self.is_lazy(digest):
            record = read_record(self.root, digest) or {}
            return {"digest": digest, "size": int(record.get("size", 0)),
                    "created": record.get("created"), "source": f"lazy:{record.get('store')}",
                    "lazy": {"store": record.get("store")}}
        self.layer_path(digest)
        try:
            return json.loads((self.layers_dir / f"{digest}.json").read_text())
        except (FileNotFoundError, ValueError):
            size = (self.layers_dir / f"{digest}.erofs").stat().st_size
            return {"digest": digest, "size": size, "created": None, "source": "unknown"}

    def list_layers(self) -> list[str]:
        return sorted(p.name[: -len(".erofs")] for p in self.layers_dir.glob("sha256-*.erofs")
                      if is_digest(p.name[: -len(".erofs")]))

    def staging_dir(self, prefix: str) -> Path:
        """A fresh private directory on the store's filesystem (caller removes it)."""
        return Path(tempfile.mkdtemp(dir=self.tmp_dir, prefix=f"{prefix}-{os.getpid()}-"))

    def add_layer_from_dir(self, src: Path, *, source: str,
                           progress: Progress | None = None,
                           git_repos: list[GitRepoFacts] | None = None,
                           exclude: Iterable[str] = ()) -> str:
        """Build an EROFS layer from directory ``src``; returns its digest (idempotent).
        ``git_repos``: what images.git found in ``src`` (recorded in the layer's metadata);
        ``exclude``: paths relative to ``src`` left out of the layer (``src`` is not changed)."""
        src = Path(src)
        if not src.is_dir() or src.is_symlink():
            raise BadRequest(f"layer source {src} is not a directory")
        if progress:
            progress(f"scanning {src}")
        exclude = list(exclude)
        files, size, newest = scan_tree(src, exclude)
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp_dir, prefix=f"layer-{os.getpid()}-",
                                        suffix=".erofs")
        os.close(fd)
        tmp = Path(tmp_name)
        os.unlink(tmp)  # mkfs.erofs wants to create the file itself
        try:
            if progress:
                progress(f"mkfs.erofs: {files} entries, {size / 2**20:.1f} MiB")
            env = dict(os.environ)
            # Clamp at the newest mtime: no mtime changes, but the superblock build time is
            # deterministic (see EROFS_UUID).
            env["SOURCE_DATE_EPOCH"] = str(newest)
            cmd = ["mkfs.erofs", "--quiet", "--preserve-mtime", f"-U{EROFS_UUID}",
                   *(f"--exclude-path={p}" for p in exclude), str(tmp), str(src)]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            except FileNotFoundError as exc:
                raise InfraError("mkfs.erofs not found: install erofs-utils (make deps)") from exc
            if proc.returncode != 0:
                raise InfraError(f"mkfs.erofs failed for {src}: "
                                 f"{(proc.stderr or proc.stdout).strip()[-500:]}")
            return self._commit_layer(tmp, source=source, files=files, progress=progress,
                                      git_repos=git_repos)
        finally:
            tmp.unlink(missing_ok=True)

    def add_layer_file(self, path: Path, *, source: str | None = None) -> str:
        """Copy an existing EROFS image file into the store; returns its digest (idempotent)."""
        path = Path(path)
        with open(path, "rb") as f:
            f.seek(EROFS_SB_OFFSET)
            magic = f.read(4)
        if len(magic) != 4 or int.from_bytes(magic, "little") != EROFS_MAGIC:
            raise BadRequest(f"{path} is not an EROFS image (bad superblock magic)")
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp_dir, prefix=f"layer-{os.getpid()}-",
                                        suffix=".erofs")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            shutil.copyfile(path, tmp)
            return self._commit_layer(tmp, source=source or f"file:{path}", files=None)
        finally:
            tmp.unlink(missing_ok=True)

    def _commit_layer(self, tmp: Path, *, source: str, files: int | None,
                      progress: Progress | None = None,
                      git_repos: list[GitRepoFacts] | None = None) -> str:
        if progress:
            progress("hashing layer")
        digest = _sha256_file(tmp)
        size = tmp.stat().st_size
        self._install(tmp, digest, source=source, files=files, git_repos=git_repos)
        if progress:
            progress(f"layer {digest[:19]} ({size / 2**20:.1f} MiB)")
        return digest

    def install_verified_layer(self, tmp: Path, digest: str, *, source: str) -> None:
        """Rename ``tmp``, a layer file on the store's filesystem whose SHA-256 the caller
        checked is ``digest`` (a pulled layer), into the store (idempotent; ``tmp`` is gone
        after)."""
        validate_digest(digest)
        self._install(tmp, digest, source=source)
        tmp.unlink(missing_ok=True)

    def _install(self, tmp: Path, digest: str, *, source: str, files: int | None = None,
                 git_repos: list[GitRepoFacts] | None = None) -> None:
        final = self.layers_dir / f"{digest}.erofs"
        meta_path = self.layers_dir / f"{digest}.json"
        size = tmp.stat().st_size
        if not final.exists():
            os.chmod(tmp, 0o644)
            os.rename(tmp, final)
        else:
            # Already present: refresh its mtime so a concurrent gc sees it as fresh.
            os.utime(final)
        if not meta_path.exists():
            meta: dict[str, Any] = {"digest": digest, "size": size, "created": time.time(),
                                    "source": source}
            if files is not None:
                meta["files"] = files
            if git_repos is not None:
                meta["git_repos"] = [r.model_dump() for r in git_repos]
            _write_atomic(meta_path, json.dumps(meta, indent=1).encode())

    # ---- refs ---------------------------------------------------------------------------

    def _ref_path(self, name: str) -> Path:
        return self.refs_dir / (urllib.parse.quote(validate_name(name), safe="") + ".json")

    def tag(self, name: str, layers: list[str], config: dict[str, Any] | None = None) -> Image:
        """Point ``name`` at ``layers`` (lowest first); replaces an existing ref atomically."""
        validate_name(name)
        if not layers:
            raise BadRequest("an image needs at least one layer")
        for digest in layers:
            self.layer_path(digest)
        image = Image(name=name, layers=list(layers), config=normalize_config(config),
                      created=time.time())
        _write_atomic(self._ref_path(name), json.dumps(image.to_dict(), indent=1).encode())
        return image

    def _read_ref(self, name: str) -> Image | None:
        try:
            return Image.from_dict(json.loads(self._ref_path(name).read_text()))
        except FileNotFoundError:
            return None

    def resolve(self, name_or_digest: str) -> Image:
        """A named image, or a single-layer image for a bare layer digest."""
        if isinstance(name_or_digest, str) and name_or_digest.startswith("sha256-"):
            validate_digest(name_or_digest)
            path = self.layer_path(name_or_digest)
            return Image(name=name_or_digest, layers=[name_or_digest],
                         created=path.stat().st_mtime)
        validate_name(name_or_digest)
        image = self._read_ref(name_or_digest)
        if image is None and ":" not in name_or_digest:
            image = self._read_ref(name_or_digest + ":latest")
        if image is None:
            # Neither the store's host path nor other images: this message may reach any
            # project (the edge adds the names its caller may see).
            raise NotFound(f"image {name_or_digest!r} not found", image=name_or_digest)
        return image

    def exists(self, name: str) -> bool:
        try:
            self.resolve(name)
            return True
        except NotFound:
            return False

    def list(self) -> list[Image]:
        images = []
        for path in sorted(self.refs_dir.glob("*.json")):
            try:
                images.append(Image.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, BadRequest):
                continue  # a ref being replaced or a corrupt file: not an image
        return sorted(images, key=lambda i: i.name)

    def remove(self, name: str) -> None:
        """Remove the ref; its layers stay until :meth:`gc`."""
        try:
            self._ref_path(name).unlink()
        except FileNotFoundError:
            raise NotFound(f"image {name!r} not found in {self.root}", image=name) from None

    def inspect(self, name: str) -> dict[str, Any]:
        image = self.resolve(name)
        layers = [self.layer_meta(d) for d in image.layers]
        out = image.to_dict()
        out["layer_details"] = layers
        out["size"] = sum(int(m.get("size", 0)) for m in layers)
        # Red-team E36: repositories whose objects HEAD does not all reach (history kept at
        # build time); layers built before this was recorded say "unknown".
        out["git_history"] = [
            {"layer": m["digest"], **repo} for m in layers for repo in m.get("git_repos", [])
            if repo.get("unreachable")]
        out["git_history_unknown_layers"] = [m["digest"] for m in layers
                                             if "git_repos" not in m]
        return out

    def remove_layer_if_unused(self, digest: str) -> bool:
        """Delete one layer that no ref uses and nothing mounts at once (a layer built for an
        image that was then refused); returns whether it was removed."""
        validate_digest(digest)
        if any(digest in image.layers for image in self.list()):
            return False
        return self._drop_layer(digest, self.mount_points())

    def mount_points(self) -> LayerMountPoints:
        """The layers' mount points (``mnt/``) as the kernel has them."""
        return LayerMountPoints(self.mnt_dir, self.root)

    def _drop_layer(self, digest: str, mounts: LayerMountPoints) -> bool:
        try:
            if mounts.users(digest):
                return False
            mounts.unmount(digest)
        except FileNotFoundError:
            return False
        except InfraError:
            return False  # in use by a running sandbox
        (self.layers_dir / f"{digest}.erofs").unlink(missing_ok=True)
        (self.layers_dir / f"{digest}.json").unlink(missing_ok=True)
        return True

    def gc(self, *, grace_seconds: float = GC_GRACE_SECONDS,
           keep: Iterable[str] = ()) -> list[str]:
        """Delete layers no ref uses (older than ``grace_seconds``), unmounting them first.

        Kept as well: ``keep`` (e.g. the layers of the node's live sandboxes) and layers that
        another mount of this mount namespace names (an overlay stacked on them).
        Returns the removed digests.
        """
        used = {d for image in self.list() for d in image.layers} | set(keep)
        mounts = self.mount_points()
        now = time.time()
        removed = []
        for digest in self.list_layers():
            if digest in used:
                continue
            try:
                if now - (self.layers_dir / f"{digest}.erofs").stat().st_mtime < grace_seconds:
                    continue
            except FileNotFoundError:
                continue
            if self._drop_layer(digest, mounts):
                removed.append(digest)
        for leftover in self.tmp_dir.iterdir():
            # Staging left by a crashed build: its name carries the builder's pid.
            m = re.match(r"[a-z]+-(\d+)-", leftover.name)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        return removed
