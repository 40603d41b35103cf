"""MicroVM templates: boot a VM once per key, save it to a file, create sandboxes by restoring it.

A template is a VM the backend booted cold with no user process (the agent up, the layers and
the writable disk mounted), then stopped and saved with QMP ``migrate`` to a file the edge
opened (``getfd``; QEMU's ``spawn=deny`` forbids ``exec:``), plus its writable disk *as saved*:
the build VM's subvolume is snapshotted once QEMU has stopped (a stop flushes the block layer),
and every restored sandbox gets a copy-on-write snapshot of that (``VmDisks.clone_rw``), never
a fresh disk under a guest that had one mounted. A restore starts a fresh jailed QEMU with the
*same* argv plus ``-incoming defer`` (every per-sandbox file is at a fixed jail path, so the
saved device state fits any sandbox), passes the saved state by ``getfd`` to
``migrate-incoming``, ``cont``s, and makes the guest unique before it takes a command
(:func:`make_unique`: kernel RNG reseeded with host entropy, new machine-id, hostname, clock;
this guest kernel has no VMGENID driver, so no ``vmgenid`` device is added).

Shared RAM (where QEMU maps a read-only file private, >= 8.2; ``vm_template_shared_ram``):
the build VM's RAM is the file ``ram`` (``qemu.RAM_SHARED``), saved with ``x-ignore-shared``
so ``state`` holds the devices only; once its QEMU exited the file is root's, 0444 and
fsync'd, and restores map it copy-on-write from a read-only fd on a read-only bind
(``qemu.RAM_CLONE``): the pages no clone wrote are one copy in the host page cache. Such
templates and their clones have no free-page reporting (QEMU can not discard a read-only
file's RAM). With an older QEMU a restore copies the saved RAM, as before.

Page map (copy templates): after the save, the build VM's stopped QEMU is asked which pages of
its guest RAM hold data (``ram.data_pages``), kept as ``pages``; spare QEMUs fault those in
before a restore loads the state into them (``spares.py``, ``ram.py``). A hint only: a missing
or wrong map makes a restore slower or a spare bigger, never another guest.

Key (:class:`TemplateKey`): the layer digests, the disk size, the guest artifacts' digest
(kernel, initramfs: file contents, and ``manifest.json`` when there is one), QEMU's version and
the exact QEMU argv (vCPUs, memory, accelerator, TSC rate, kernel command line, devices). Any
change gives another key, so a stale template is never restored; the image *name* is not in
the key: two images with the same layers boot the same guest and share a template. Nothing of
a template comes from a sandbox: it is built from the platform's artifacts and the image's
read-only layers before any user command, so a template is shared only by sandboxes that would
boot the very same guest.

Cache (:class:`TemplateCache`): ``<data dir>/vm-templates/<key digest>/`` holds ``meta.json``
(written last: a dir without it is an unfinished build, removed), ``state`` and ``pages``
(copy templates); the disk is
subvolume ``tpl-<digest>`` of the disk pool. Bounded by count and bytes (state + the disk's
allocated bytes), least recently used first out; a template in use by a restore under way is
never evicted (it goes when the last user is done). Concurrent creates of one key wait for one
build. A build that fails is not retried for ``vm_template_retry_s`` (those creates boot cold);
a template that fails to load (truncated/corrupt state, QEMU refuses it, the guest never
answers) is dropped, logged, and the create falls back to a cold boot.

Owns the template files, the cache policy and the save/restore sequence; does not own the jail,
the disks or the QEMU argv (``jail.py``, ``disks.py``, ``qemu.py``), nor when the backend uses
a template (``backend.py``).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollbox.agent.protocol import ExecRequest
from rollbox.backends.base import ResolvedSpec
from rollbox.backends.cancellation import teardown_after, to_the_end
from rollbox.backends.container.disk import CACHE_PREFIX, MACHINE_SNAPSHOT_PREFIX
from rollbox.backends.microvm import qemu, qmp
from rollbox.backends.microvm import ram as ram_mod
from rollbox.backends.microvm.jail import Jail
from rollbox.backends.microvm.steps import Steps
from rollbox.errors import InfraError

if TYPE_CHECKING:
    from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend

log = logging.getLogger(__name__)

STATE_NAME = "state"
RAM_NAME = "ram"              # the guest's RAM as saved (templates with shared RAM only)
PAGES_NAME = "pages"          # which pages of the saved RAM hold data (copy templates: ram.py)
META_NAME = "meta.json"
DISK_PREFIX = CACHE_PREFIX    # pool subvolumes of templates: the pool's cache (see disk.py)
BUILD_PREFIX = "tplb-"        # sandbox ids of build VMs (jail dirs, cleaned at start)
SPARE_PREFIX = "tplp-"        # ids of spare QEMUs (spares.py; jail dirs and disks cleaned at start)
META_VERSION = 1
MIGRATION_POLL_S = 0.005
ENTROPY_BYTES = 256
PLACEHOLDER_MACHINE_ID = "0" * 32  # a template's; every restore writes its own
# Read into a template's page cache before its save (VmTemplates._warm), within
# WARM_TIMEOUT_S (an image's FIFO or huge file there only delays its own template).
WARM_FILES = ("/bin/sh", "/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6",
              "/usr/lib/x86_64-linux-gnu/libc.so.6")
WARM_TIMEOUT_S = 10.0


class TemplateLoadError(InfraError):
    """A saved template could not be restored (the caller drops it and boots cold)."""


# ---- the key ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TemplateKey:
    layers: tuple[str, ...]
    disk_mib: int
    guest_digest: str
    qemu_version: str
    argv: tuple[str, ...]       # QEMU's full argv without ``-incoming``

    @property
    def digest(self) -> str:
        doc = json.dumps({"v": META_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "layers": list(self.layers), "argv": list(self.argv)}

    @classmethod
    def from_json(cls, doc: Any) -> TemplateKey:
        if not isinstance(doc, dict):
            raise ValueError("template key is not an object")
        layers, argv = doc["layers"], doc["argv"]
        if not (isinstance(layers, list) and all(isinstance(x, str) for x in layers)
                and isinstance(argv, list) and all(isinstance(x, str) for x in argv)):
            raise ValueError("template key has malformed lists")
        return cls(layers=tuple(layers), disk_mib=int(doc["disk_mib"]),
                   guest_digest=str(doc["guest_digest"]),
                   qemu_version=str(doc["qemu_version"]), argv=tuple(argv))


_file_digests: dict[tuple[str, int, int, int, int], str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's content, remembered per (inode, size, mtime): a rebuilt kernel or
    initramfs gets a new digest without hashing ~50 MB on every create."""
    st = os.stat(path)
    ident = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    digest = _file_digests.get(ident)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = _file_digests[ident] = h.hexdigest()
    return digest


def guest_digest(kernel: Path, initrd: Path, manifest: Path | None = None) -> str:
    """One digest of the guest the VM boots: kernel and initramfs contents, and the guest
    build's manifest (kernel version, agent digest) when there is one."""
    parts = [file_digest(kernel), file_digest(initrd)]
    if manifest is not None and manifest.is_file():
        parts.append(file_digest(manifest))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# ---- uniqueness -------------------------------------------------------------------------------
class UniqueChannel(Protocol):
    """The agent commands a restored guest is made unique with (``rollbox.agent.channel``)."""

    async def reseed(self, entropy: bytes, timeout: float = ...) -> None: ...
    async def set_machine_id(self, machine_id: str, timeout: float = ...) -> None: ...
    async def set_hostname(self, hostname: str, timeout: float = ...) -> None: ...
    async def set_clock(self, unix_ns: int | None = None, timeout: float = ...) -> None: ...


async def make_unique(channel: UniqueChannel, hostname: str) -> str:
    """Before a restored guest takes a command: its CRNG reseeded with host entropy (so two
    clones of one saved RNG state diverge: /dev/urandom, getrandom, Python's seed), a new
    machine-id, the sandbox's hostname, the clock stepped to the host's (it stood still since
    the save). Returns the machine-id."""
    machine_id = secrets.token_hex(16)
    # Sent back to back (one round trip under TCG, not four); the agent serves them in this
    # order, and all are answered before the create returns, so before any command.
    await asyncio.gather(channel.reseed(os.urandom(ENTROPY_BYTES)),
                         channel.set_clock(time.time_ns()),
                         channel.set_machine_id(machine_id),
                         channel.set_hostname(hostname[:63]))
    return machine_id


# ---- the cache --------------------------------------------------------------------------------
@dataclass
class Template:
    key: TemplateKey
    dir: Path
    disk_id: str               # the disk pool subvolume holding the disk as saved
    state_bytes: int
    disk_bytes: int            # allocated bytes of the disk file when saved
    created: float
    last_used: float
    ram_bytes: int = 0         # allocated bytes of the RAM file (shared RAM)
    shared_ram: bool = False   # RAM in ``ram`` (restores map it copy-on-write), not in state
    users: int = 0
    dropped: bool = False

    @property
    def digest(self) -> str:
        return self.key.digest

    @property
    def state_path(self) -> Path:
        return self.dir / STATE_NAME

    @property
    def ram_path(self) -> Path:
        return self.dir / RAM_NAME

    @property
    def pages_path(self) -> Path:
        return self.dir / PAGES_NAME

    @property
    def size(self) -> int:
        return self.state_bytes + self.disk_bytes + self.ram_bytes


@dataclass
class Built:
    """What a build made in its staging dir (``state``, and ``ram`` with shared RAM, written
    there) and the disk's id."""
    disk_id: str
    disk_bytes: int
    ram_bytes: int = 0
    shared_ram: bool = False


# (key, staging dir, disk id to snapshot the saved disk as) -> what was built
Builder = Callable[[TemplateKey, Path, str], Awaitable[Built]]


class TemplateCache:
    """The node's templates: on disk under ``root``, bounded by ``max_count`` and
    ``max_bytes``, least recently used evicted first. ``remove_disk(disk_id)`` deletes a
    template's disk subvolume (returns what is left); ``on_drop(tpl)`` hears of every template
    dropped (evicted, bad, cleared)."""

    def __init__(self, root: Path, max_count: int, max_bytes: int,
                 remove_disk: Callable[[str], list[str]], retry_s: float = 60.0,
                 on_drop: Callable[[Template], None] | None = None) -> None:
        self.root = root
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.retry_s = retry_s
        self._remove_disk = remove_disk
        self._on_drop = on_drop  # a template is forgotten (its spares go: spares.py)
        self._templates: dict[str, Template] = {}
        self._building: dict[str, asyncio.Future[Template | None]] = {}
        self._failed: dict[str, float] = {}   # digest -> monotonic time of the failed build
        self._loaded = False

    # ---- on disk ------------------------------------------------------------------------
    def load(self, disk_ids: set[str] | None = None) -> None:
        """Read the templates a previous edge left; remove unfinished builds, unreadable
        dirs and (given the pool's ``disk_ids``) template disks no template owns."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._templates.clear()
        for d in sorted(self.root.iterdir()):
            tpl = self._read(d)
            if tpl is None:
                log.info("vm template %s incomplete or unreadable: removed", d.name)
                self._remove_files(d)
                continue
            self._templates[tpl.digest] = tpl
        if disk_ids is not None:
            owned = {t.disk_id for t in self._templates.values()}
            for disk_id in disk_ids:
                if disk_id.startswith(DISK_PREFIX) and disk_id not in owned \
                        and not disk_id.startswith(MACHINE_SNAPSHOT_PREFIX):  # a vm snapshot's
                    log.info("vm template disk %s has no template: removed", disk_id)
                    self._remove_disk(disk_id)
        self._loaded = True
        self._evict()

    def _read(self, d: Path) -> Template | None:
        if d.name.startswith(".") or not d.is_dir():
            return None
        try:
            meta = json.loads((d / META_NAME).read_text())
            key = TemplateKey.from_json(meta["key"])
            if meta.get("version") != META_VERSION or key.digest != d.name \
                    or meta["disk_id"] != self.disk_id_for(key):
                return None  # (a disk id is deleted with its template: only our own names)
            state_bytes = (d / STATE_NAME).stat().st_size
            if state_bytes != int(meta["state_bytes"]):
                return None  # truncated after the save
            shared_ram = bool(meta.get("shared_ram", False))
            if shared_ram:
                st = (d / RAM_NAME).stat()
                if st.st_size != int(meta["ram_size"]) or st.st_uid != 0 or st.st_mode & 0o222:
                    return None  # cut, or writable by someone: never mapped into a VM
            mtime = (d / META_NAME).stat().st_mtime
            return Template(key=key, dir=d, disk_id=str(meta["disk_id"]),
                            state_bytes=state_bytes, disk_bytes=int(meta["disk_bytes"]),
                            created=float(meta["created"]), last_used=mtime,
                            ram_bytes=int(meta.get("ram_bytes", 0)), shared_ram=shared_ram)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def _remove_files(d: Path) -> None:
        shutil.rmtree(d, ignore_errors=True)

    def _write_meta(self, staging: Path, key: TemplateKey, built: Built) -> None:
        meta: dict[str, Any] = {
            "version": META_VERSION, "key": key.to_json(), "disk_id": built.disk_id,
            "state_bytes": (staging / STATE_NAME).stat().st_size,
            "disk_bytes": built.disk_bytes, "created": time.time()}
        if built.shared_ram:
            meta.update(shared_ram=True, ram_bytes=built.ram_bytes,
                        ram_size=(staging / RAM_NAME).stat().st_size)
        tmp = staging / (META_NAME + ".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, staging / META_NAME)

    # ---- lookup and build ---------------------------------------------------------------
    def templates(self) -> list[Template]:
        return sorted(self._templates.values(), key=lambda t: t.last_used)

    def total_bytes(self) -> int:
        return sum(t.size for t in self._templates.values())

    def disk_id_for(self, key: TemplateKey) -> str:
        return DISK_PREFIX + key.digest[:32]

    async def acquire(self, key: TemplateKey, build: Builder) -> Template | None:
        """The template of ``key``, built if there is none (one build per key however many
        creates ask at once); None when there is none to use (the build failed now or
        recently, or the template alone is above the byte bound): boot cold. The caller
        :meth:`release`\\ s it after the restore (until then it is never evicted)."""
        if not self._loaded:
            self.load()
        digest = key.digest
        tpl = self._templates.get(digest)
        if tpl is None:
            fut = self._building.get(digest)
            if fut is None:
                failed = self._failed.get(digest)
                if failed is not None and time.monotonic() - failed < self.retry_s:
                    return None
                fut = asyncio.get_running_loop().create_future()
                self._building[digest] = fut
                try:
                    fut.set_result(await self._build(key, build))
                except BaseException as exc:  # cancelled: the waiters must not hang
                    fut.set_result(None)
                    if not isinstance(exc, Exception):
                        raise
                finally:
                    del self._building[digest]
            tpl = await asyncio.shield(fut)
            if tpl is None or tpl.dropped:
                return None
        tpl.users += 1
        tpl.last_used = time.time()
        try:
            os.utime(tpl.dir / META_NAME)  # the LRU order survives a restart
        except OSError:
            pass
        return tpl

    def release(self, tpl: Template) -> None:
        tpl.users -= 1
        if tpl.dropped and tpl.users <= 0:
            self._delete(tpl)

    async def _build(self, key: TemplateKey, build: Builder) -> Template | None:
        digest = key.digest
        staging = self.root / f".build-{digest[:16]}-{secrets.token_hex(4)}"
        disk_id = self.disk_id_for(key)
        t0 = time.monotonic()
        try:
            staging.mkdir(mode=0o700)
            self._remove_disk(disk_id)  # a leftover of a crashed build of this key
            built = await build(key, staging, disk_id)
            await asyncio.to_thread(self._write_meta, staging, key, built)
            final = self.root / digest
            os.replace(staging, final)
        except Exception as exc:  # noqa: BLE001  any failure: boot cold, retry later
            log.warning("vm template %s not built (%s): creates boot cold for %.0f s",
                        digest[:12], exc, self.retry_s)
            self._failed[digest] = time.monotonic()
            self._remove_files(staging)
            self._remove_disk(disk_id)
            return None
        except BaseException:
            self._remove_files(staging)
            self._remove_disk(disk_id)
            raise
        tpl = self._read(final)
        if tpl is None:
            self._remove_files(final)
            self._remove_disk(disk_id)
            self._failed[digest] = time.monotonic()
            return None
        self._failed.pop(digest, None)
        self._templates[digest] = tpl
        log.info("vm template %s built in %.2f s (%d MiB state, %d MiB disk)", digest[:12],
                 time.monotonic() - t0, tpl.state_bytes >> 20, tpl.disk_bytes >> 20)
        self._evict(keep=digest)
        if tpl.size > self.max_bytes:
            log.warning("vm template %s (%d MiB) is above the cache's %d MiB: not kept",
                        digest[:12], tpl.size >> 20, self.max_bytes >> 20)
            self.drop(tpl, "above the cache's byte bound")
            return None
        return tpl

    # ---- eviction -----------------------------------------------------------------------
    def drop(self, tpl: Template, why: str, bad: bool = True) -> None:
        """Forget a template (bad, or evicted); its files go once no restore uses it."""
        if self._templates.get(tpl.digest) is tpl:
            del self._templates[tpl.digest]
        if not tpl.dropped:
            log.log(logging.WARNING if bad else logging.INFO, "vm template %s dropped: %s",
                    tpl.digest[:12], why)
            if self._on_drop is not None:
                self._on_drop(tpl)
        tpl.dropped = True
        if tpl.users <= 0:
            self._delete(tpl)

    def _delete(self, tpl: Template) -> None:
        self._remove_files(tpl.dir)
        left = self._remove_disk(tpl.disk_id)
        if left:
            log.error("vm template %s: disk not removed: %s", tpl.digest[:12], left)

    def _evict(self, keep: str | None = None) -> None:
        """Least recently used first, until within both bounds (``keep`` and templates in
        use stay)."""
        for tpl in self.templates():
            if len(self._templates) <= self.max_count and self.total_bytes() <= self.max_bytes:
                return
            if tpl.digest == keep or tpl.users > 0:
                continue
            self.drop(tpl, "evicted (least recently used)", bad=False)

    def clear(self) -> None:
        """Drop every template (node teardown, tests)."""
        for tpl in list(self._templates.values()):
            self.drop(tpl, "cache cleared", bad=False)


# ---- save and restore -------------------------------------------------------------------------
async def wait_migration(q: qmp.QMP, timeout_s: float) -> dict[str, Any]:
    """Poll ``query-migrate`` until the migration completed; InfraError if it failed or the
    wait ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = await q.query_migrate()
        status = st.get("status")
        if status == "completed":
            return st
        if status in ("failed", "cancelled"):
            raise InfraError(f"migration {status}: {str(st.get('error-desc', ''))[:300]}")
        if time.monotonic() > deadline:
            raise InfraError(f"migration not done in {timeout_s:.0f} s (status {status})")
        await asyncio.sleep(MIGRATION_POLL_S)


class VmTemplates:
    """The backend's templates: the key of a create and the build (cold boot, stop, save,
    keep the disk as saved); a restore's load step is :func:`load_state` (also a fork's and a
    ``vm`` snapshot's)."""

    def __init__(self, backend: MicroVMBackend) -> None:
        s = backend.settings
        self.backend = backend
        self.cache = TemplateCache(s.vm_template_dir, s.vm_template_max_count,
                                   s.vm_template_max_bytes, backend.disks.remove_rw,
                                   retry_s=s.vm_template_retry_s,
                                   on_drop=lambda tpl: backend.spares.forget(tpl.digest))

    def recover(self) -> None:
        """Node start: templates of a previous edge are kept (their disks checked), build VMs
        it left are cleaned by the backend (``host_sandbox_ids`` lists them: :data:`BUILD_PREFIX`
        ids are never the edge's)."""
        disks = self.backend.disks
        ids = disks.pool.ids() if disks.pool.exists() else set()
        for disk_id in ids:
            # a build VM's or spare's disk whose jail was gone (no spare runs yet)
            if disk_id.startswith((BUILD_PREFIX, SPARE_PREFIX)):
                disks.remove_rw(disk_id)
        self.cache.load(ids)

    @property
    def shared_ram(self) -> bool:
        """Whether new templates keep their RAM in a file restores map copy-on-write."""
        s = self.backend.settings
        return s.vm_template_shared_ram and qemu.private_file_ram(str(s.qemu_binary))

    def build_machine(self, machine: qemu.MachineSpec) -> qemu.MachineSpec:
        """The build VM's machine (its argv is the key's): with shared RAM, RAM in a file and
        no free-page reporting (see :meth:`restore_machine`)."""
        if not self.shared_ram:
            return replace(machine, incoming=False)
        return replace(machine, incoming=False, ram=qemu.RAM_SHARED, free_page_reporting=False)

    @staticmethod
    def restore_machine(tpl: Template, machine: qemu.MachineSpec) -> qemu.MachineSpec:
        """A restored VM's machine: the template's RAM file mapped copy-on-write, if it has
        one. Such a clone has no free-page reporting: QEMU refuses to discard RAM of a file
        it opened read-only (it would punch the hole in the shared file), so a report would
        free nothing (and log an error each time); the balloon device's features must be
        the saved ones, so the build VM has none either."""
        if not tpl.shared_ram:
            return machine
        return replace(machine, ram=qemu.RAM_CLONE, free_page_reporting=False)

    def key_for(self, spec: ResolvedSpec, machine: qemu.MachineSpec) -> TemplateKey:
        s = self.backend.settings
        argv = qemu.argv(self.build_machine(machine), str(s.qemu_binary))
        return TemplateKey(layers=tuple(spec.layers), disk_mib=spec.resources.disk_mib,
                           guest_digest=guest_digest(s.vm_kernel, s.vm_initrd,
                                                     s.vm_guest_manifest),
                           qemu_version=qemu.version(str(s.qemu_binary)), argv=tuple(argv))

    async def acquire(self, spec: ResolvedSpec, machine: qemu.MachineSpec,
                      timeout_s: float) -> Template | None:
        """The template for this create (built now if needed), or None: boot cold."""
        try:
            key = await asyncio.to_thread(self.key_for, spec, machine)
        except OSError as exc:
            log.warning("vm template key not computed (%s): booting cold", exc)
            return None

        async def build(k: TemplateKey, staging: Path, disk_id: str) -> Built:
            return await self._build(spec, machine, k, staging, disk_id, timeout_s)

        return await self.cache.acquire(key, build)

    async def _build(self, spec: ResolvedSpec, machine: qemu.MachineSpec, key: TemplateKey,
                     staging: Path, disk_id: str, timeout_s: float) -> Built:
        build_id = f"{BUILD_PREFIX}{key.digest[:12]}{secrets.token_hex(3)}"
        # Nothing of the first creator's own spec goes into the saved guest: no hidden-path
        # masks (each restore masks its own), no allow-list (a NIC denies all until restored).
        bare = replace(spec, hidden_paths=(),
                       network_rules=None if spec.network_rules is None else ())
        build = self.build_machine(machine)
        ram = None
        if build.ram:
            ram = staging / RAM_NAME
            await asyncio.to_thread(self._new_ram_file, ram, build.memory_mib << 20)
        vm = await self.backend.boot(build_id, bare, build, timeout_s, ram_file=ram)
        try:
            await self._warm(vm, timeout_s)
            if ram is None:  # its free pages zero pages in the state: no restore loads them
                await self.backend.zero_free_memory(vm)  # (a shared RAM file: no copy to save)
            state = staging / STATE_NAME
            async with qmp.session(vm.qmp_path, timeout_s) as q:
                await q.stop()  # flushes the block layer: the disk file is as saved
                if ram is not None:  # the RAM is the file: the state holds the devices
                    await q.ignore_shared_ram()
                fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    await q.getfd(fd, "template")
                finally:
                    os.close(fd)
                await q.migrate("fd:template")
                await wait_migration(q, timeout_s)
            if ram is None:  # QEMU stopped: its guest RAM is the saved RAM
                pages = await asyncio.to_thread(ram_mod.data_pages, vm.pid,
                                                build.memory_mib << 20)
                if pages is not None:
                    await asyncio.to_thread(ram_mod.write_page_map, staging / PAGES_NAME, pages)
                else:
                    log.info("vm template %s: no page map (guest RAM not found)", key.digest[:12])
            # to its end: a clone made after the cache removed the template's disk would stay
            disk_bytes = await to_the_end(asyncio.to_thread(self._keep_disk, build_id, disk_id))
        except BaseException as exc:
            # a failed teardown of the build VM never turns a cancellation into a failed
            # build (the create would boot cold and finish)
            await teardown_after(exc, self.backend.destroy(vm))
            raise
        await self.backend.destroy(vm)
        if ram is None:
            return Built(disk_id=disk_id, disk_bytes=disk_bytes)
        # QEMU (the only writer) is gone: the file is sealed, root's and read-only
        ram_bytes = await asyncio.to_thread(self._seal_ram_file, ram)
        return Built(disk_id=disk_id, disk_bytes=disk_bytes, ram_bytes=ram_bytes,
                     shared_ram=True)

    @staticmethod
    def _new_ram_file(path: Path, size: int) -> None:
        """The build VM's RAM file: sparse, ``size`` bytes (its owner is set by the boot)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def _seal_ram_file(path: Path) -> int:
        """Once the build VM's QEMU has exited: the RAM file root-owned, mode 0444, on disk
        (fsync'd before the meta says the template exists); returns its allocated bytes."""
        os.chown(path, 0, 0)
        os.chmod(path, 0o444)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            return os.fstat(fd).st_blocks * 512
        finally:
            os.close(fd)

    @staticmethod
    async def _platform_tool(vm: MicroVM, argv: list[str], timeout_s: float) -> int | None:
        """Run a platform busybox applet in the guest (its own session, exited before the
        save: no process is left); its exit code (None: none came)."""
        session = await vm.channel.exec(ExecRequest(argv=argv, env=[], platform_tool=True,
                                                    timeout_ms=int(timeout_s * 1000)), None)
        code = None
        async for kind, payload in session.events():
            if kind == "exited":
                code = payload.exit_code
        return code

    async def _warm(self, vm: MicroVM, timeout_s: float) -> None:
        """Before the save, through the agent: the platform's busybox ``true`` (the guest's
        first fork/exec/session-cgroup paths and the pages they read are then in the saved
        memory); the first pages of what nearly every first command loads from the image's
        layers (its ``/bin/sh``, ELF loader and libc: :data:`WARM_FILES`, read by the
        platform's ``md5sum`` in the tools' view, time-bounded; nothing of the image runs), so a
        restored VM does not read them through virtio-blk under TCG; and a placeholder
        machine-id, so /etc is copied up into the overlay's upper and a restore's own
        machine-id is a rewrite in place (make_unique)."""
        code = await self._platform_tool(vm, ["true"], timeout_s)
        if code != 0:
            raise InfraError(f"warm-up command of the template exited {code}")
        # md5sum: reads each file whole and prints one line (no output to carry); missing
        # files (an image without a libc) are fine: it goes on and exits 1
        await self._platform_tool(vm, ["md5sum", *WARM_FILES], min(timeout_s, WARM_TIMEOUT_S))
        await vm.channel.set_machine_id(PLACEHOLDER_MACHINE_ID)

    def _keep_disk(self, build_id: str, disk_id: str) -> int:
        """Snapshot the stopped build VM's disk subvolume as the template's (root-owned:
        no QEMU uid keeps access to it); returns its allocated bytes."""
        disks = self.backend.disks
        disks.pool.clone(build_id, disk_id)
        path = disks.rw_path(disk_id)
        os.chown(path, 0, 0)
        return os.stat(path).st_blocks * 512


# ---- restore ---------------------------------------------------------------------------------
async def load_state(tpl: Template, jail: Jail, timeout_s: float,
                     steps: Steps | None = None, monitor: qmp.QMP | None = None) -> None:
    """Restore step of a QEMU started with ``-incoming defer``: the saved state through an
    fd, then run. TemplateLoadError if QEMU refuses or dies (it exits on a bad stream).
    ``monitor``: QEMU's QMP, connected already (a spare's; closed here)."""
    try:
        fd = os.open(tpl.state_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if monitor is not None:
            monitor.close()
        raise TemplateLoadError(f"template state unreadable: {exc}") from exc
    try:
        steps = steps or Steps()
        async with qmp.connected(monitor) if monitor is not None \
                else qmp.session(jail.socket_path("qmp"), timeout_s) as q:
            if monitor is None:
                steps.lap("qmp_connect")
            if tpl.shared_ram:
                await q.ignore_shared_ram()
            try:
                await q.getfd(fd, "template")
            finally:
                os.close(fd)
                fd = -1
            await q.migrate_incoming("fd:template")
            await wait_migration(q, timeout_s)
            steps.lap("state_load")
            if await q.status() != "running":
                await q.cont()
            steps.lap("cont")
    except (InfraError, OSError, asyncio.TimeoutError) as exc:  # QEMU exited: reset
        raise TemplateLoadError(f"template {tpl.digest[:12]} not loaded: {exc!r}") from exc
    finally:
        if fd >= 0:
            os.close(fd)
