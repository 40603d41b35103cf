"""Node-wide settings: where rollbox keeps its data and which host resources carry its name.

Every host resource a sandbox uses is named so a leak can be found: data under ``data_dir``,
cgroups under the ``rollbox`` parent, network namespaces ``rollbox-<id>``, the working state of
live sandboxes (mount points, bundles, sockets, runc state) under ``run_dir``. Environment variables (``ROLLBOX_*``) override the defaults.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env_path(name: str, default: str | Path) -> Path:
    return Path(os.environ.get(name, str(default)))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


def _env_opt_int(name: str) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default


def _env_mirrors() -> dict[str, str]:
    """``ROLLBOX_MIRRORS="pypi=http://10.0.0.1:3141/simple/,npm=http://10.0.0.1:4873/"``."""
    out: dict[str, str] = {}
    for item in os.environ.get("ROLLBOX_MIRRORS", "").split(","):
        name, sep, url = item.strip().partition("=")
        if sep and name.strip() and url.strip():
            out[name.strip()] = url.strip()
    return out


@dataclass
class Settings:
    data_dir: Path = field(default_factory=lambda: _env_path("ROLLBOX_DATA", "/var/lib/rollbox"))
    # Working state of live sandboxes: mount points, OCI bundles, agent sockets, runc --root.
    # It must be on a tmpfs: it dies with the host anyway, and creating and removing its inodes
    # on a disk filesystem cost ~7 ms of CPU per sandbox on this ext4 host (inode allocation,
    # journal), a sixth of a create/exec/destroy cycle. With run_tmpfs the container backend
    # mounts a tmpfs there when the directory is on disk (hosts whose /run is not a tmpfs).
    run_dir: Path = field(default_factory=lambda: _env_path("ROLLBOX_RUN", "/run/rollbox"))
    run_tmpfs: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_RUN_TMPFS", "1") not in ("", "0"))
    # Disk pool of the writable layers (backends/container/disk.py): a btrfs partition to use
    # (formatted by the operator), else a sparse file below the data dir of this many GiB
    # (0: 80% of the free space of its filesystem when it is first made).
    disk_pool_device: Path | None = field(
        default_factory=lambda: Path(os.environ["ROLLBOX_DISK_DEVICE"])
        if os.environ.get("ROLLBOX_DISK_DEVICE") else None)
    disk_pool_gib: int = field(
        default_factory=lambda: int(os.environ.get("ROLLBOX_DISK_POOL_GIB", "0")))
    agent_binary: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_AGENT", REPO_ROOT / "build" / "rollbox-agent")
    )
    # bash-static: interprets command strings in sandboxes (agent/platform_shell.py)
    platform_shell: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_PLATFORM_SHELL", "/bin/bash-static"))
    # busybox-static: the platform's own tools in a microVM guest (rollbox.guest.build)
    platform_busybox: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_PLATFORM_BUSYBOX", "/bin/busybox"))
    # The microVM guest's kernel package: `make guest` unpacks the kernel this Debian meta
    # package depends on (rollbox.guest.build); vm_kernel/vm_initrd below are its outputs.
    vm_kernel_package: str = field(
        default_factory=lambda: os.environ.get("ROLLBOX_VM_KERNEL_PKG",
                                               "linux-image-cloud-amd64"))
    runtime: str = field(default_factory=lambda: os.environ.get("ROLLBOX_RUNTIME", "runc"))
    # microVM backend (backends/microvm): QEMU, the jailer it runs under, the guest kernel and
    # initramfs (`make guest`), the accelerator ("auto": KVM if a probe boot reaches the agent,
    # else TCG), how long a guest may take to answer, QEMU's memory on top of the guest's.
    qemu_binary: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_QEMU", "/usr/bin/qemu-system-x86_64"))
    vm_jailer: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_JAILER",
                                          REPO_ROOT / "build" / "rollbox-jailer"))
    vm_kernel: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_VM_KERNEL",
                                          REPO_ROOT / "build" / "guest" / "vmlinux"))
    vm_initrd: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_VM_INITRD",
                                          REPO_ROOT / "build" / "guest" / "initramfs.cpio"))
    # Kernel version and digests of vm_kernel/vm_initrd (part of a template's key); the deb
    # and its unpacked tree are cached in a `cache` directory beside it.
    vm_guest_manifest: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_VM_GUEST_MANIFEST",
                                          REPO_ROOT / "build" / "guest" / "manifest.json"))
    vm_accel: str = field(default_factory=lambda: os.environ.get("ROLLBOX_VM_ACCEL", "auto"))
    # Probe results per (kernel, QEMU, /dev/kvm): a node start re-probes only when one changes.
    vm_accel_cache: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_VM_ACCEL_CACHE", "/run/rollbox-accel"))
    vm_boot_timeout_s: float = field(
        default_factory=lambda: _env_float("ROLLBOX_VM_BOOT_TIMEOUT", 60.0))
    vm_overhead_mib: int = field(default_factory=lambda: _env_int("ROLLBOX_VM_OVERHEAD_MIB", 256))
    vm_tb_size_mib: int = field(default_factory=lambda: _env_int("ROLLBOX_VM_TB_MIB", 64))
    # A microVM with no command running and none started for this long is squeezed (balloon
    # to its floor) until its next command; 0: never.
    vm_idle_squeeze_s: float = field(
        default_factory=lambda: _env_float("ROLLBOX_VM_IDLE_SQUEEZE_S", 60.0))
    # The balloon's free-page reporting (pages the guest frees go back to the host); off only
    # to measure what it saves (`rollbox bench microvm`).
    vm_free_page_reporting: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_VM_FREE_PAGE_REPORTING", "1")
        not in ("", "0"))
    # Host page merging of microVM guest RAM (backends/microvm/ksm.py): on, the node starts
    # the host's ksmd scanning at least this many pages per 20 ms (clones of a template share
    # their identical pages); off, its VMs get mem-merge=off. Off by default: merging is a
    # cross-tenant side channel (docs/security.md), an opt-in for single-tenant nodes.
    vm_ksm: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_VM_KSM", "0") not in ("", "0"))
    vm_ksm_pages_to_scan: int = field(
        default_factory=lambda: _env_int("ROLLBOX_VM_KSM_PAGES", 1000))
    vm_ksm_sysfs: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_VM_KSM_SYSFS", "/sys/kernel/mm/ksm"))
    # microVM templates (backends/microvm/template.py): creates restore a VM saved once per
    # key instead of booting; the node keeps at most this many templates and bytes (saved
    # state + disk), least recently used out first; a failed build is retried after retry_s.
    vm_templates: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_VM_TEMPLATES", "1") not in ("", "0"))
    vm_template_max_count: int = field(
        default_factory=lambda: _env_int("ROLLBOX_VM_TEMPLATE_MAX", 16))
    vm_template_max_bytes: int = field(
        default_factory=lambda: _env_int("ROLLBOX_VM_TEMPLATE_MAX_BYTES", 8 << 30))
    vm_template_retry_s: float = field(
        default_factory=lambda: _env_float("ROLLBOX_VM_TEMPLATE_RETRY_S", 60.0))
    # A template's RAM as a file its restored VMs map copy-on-write (one copy of what they
    # have not written, backends/microvm/qemu.py), where QEMU can map it read-only (>= 8.2);
    # off (or an older QEMU): every restore copies the saved RAM into its own memory.
    vm_template_shared_ram: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_VM_TEMPLATE_SHARED_RAM", "1")
        not in ("", "0"))
    # One JSON line per microVM create with its step timings (backends/microvm/steps.py;
    # `rollbox bench microvm` sets it for its server); unset: none written.
    vm_step_log: Path | None = field(
        default_factory=lambda: Path(p) if (p := os.environ.get("ROLLBOX_VM_STEP_LOG")) else None)
    cgroup_parent: str = field(default_factory=lambda: os.environ.get("ROLLBOX_CGROUP", "rollbox"))
    node_id: str = field(default_factory=lambda: os.environ.get("ROLLBOX_NODE", "n0"))
    # First host uid of the sandbox uid ranges; each sandbox slot gets 65536 ids above it.
    uid_base: int = field(default_factory=lambda: int(os.environ.get(
        "ROLLBOX_UID_BASE", str(1_000_000_000 // 65536 * 65536))))
    uid_slots: int = field(default_factory=lambda: int(os.environ.get("ROLLBOX_UID_SLOTS",
                                                                      "8192")))
    # Image store; defaults to <data_dir>/images (tests share the node's built images).
    images_root: Path | None = field(
        default_factory=lambda: Path(os.environ["ROLLBOX_IMAGES"]) if "ROLLBOX_IMAGES" in os.environ
        else None)

    # Admission (rollbox.edge.admission). Requests set a sandbox's limits, not reservations:
    # their sums may exceed the host this many times; live use decides the rest.
    max_sandboxes: int = field(default_factory=lambda: _env_int("ROLLBOX_MAX_SANDBOXES", 4096))
    memory_overcommit: float = field(
        default_factory=lambda: _env_float("ROLLBOX_MEMORY_OVERCOMMIT", 160.0))
    # CPUs are a CFS quota (throttled, never killed): 3,200 one-CPU sandboxes on 2 cores.
    cpu_overcommit: float = field(
        default_factory=lambda: _env_float("ROLLBOX_CPU_OVERCOMMIT", 2000.0))
    # Host memory creates never eat into; None = max(2 GiB, 10% of RAM).
    memory_reserve_mib: int | None = field(
        default_factory=lambda: _env_opt_int("ROLLBOX_MEMORY_RESERVE_MIB"))
    # Limit of the parent memory cgroup of all sandboxes; None = RAM minus the reserve.
    sandboxes_memory_max_mib: int | None = field(
        default_factory=lambda: _env_opt_int("ROLLBOX_SANDBOXES_MEMORY_MAX_MIB"))
    # Share of every budget (count, requests, free memory) only grades and fncall workers use.
    reserved_share: float = field(
        default_factory=lambda: _env_float("ROLLBOX_RESERVED_SHARE", 0.10))
    # Memory PSI ("some", avg10, %) above which new creates are refused.
    memory_psi_max: float = field(
        default_factory=lambda: _env_float("ROLLBOX_MEMORY_PSI_MAX", 20.0))

    # Package mirrors (docs/mirrors.md). Permission name (pypi, npm, debian, go) -> the mirror's
    # base URL as a sandbox sees it; netpolicy allows that address instead of the registry.
    mirrors: dict[str, str] = field(default_factory=_env_mirrors)
    # The built-in caching PyPI proxy (rollbox.netpolicy.mirror); run in-process by the api
    # only when enabled, else by `rollbox mirror serve`. Never fetches from other hosts.
    pypi_mirror_enabled: bool = field(
        default_factory=lambda: os.environ.get("ROLLBOX_PYPI_MIRROR", "0") not in ("", "0"))
    pypi_mirror_host: str = field(
        default_factory=lambda: os.environ.get("ROLLBOX_PYPI_MIRROR_HOST", "127.0.0.1"))
    pypi_mirror_port: int = field(
        default_factory=lambda: int(os.environ.get("ROLLBOX_PYPI_MIRROR_PORT", "3141")))
    pypi_mirror_index_upstream: str = field(
        default_factory=lambda: os.environ.get("ROLLBOX_PYPI_UPSTREAM", "https://pypi.org/simple/"))
    pypi_mirror_file_upstreams: tuple[str, ...] = field(
        default_factory=lambda: tuple(u.strip() for u in os.environ.get(
            "ROLLBOX_PYPI_FILE_UPSTREAMS", "https://files.pythonhosted.org").split(",")
            if u.strip()))
    pypi_mirror_max_bytes: int = field(
        default_factory=lambda: int(os.environ.get("ROLLBOX_PYPI_MIRROR_MAX_BYTES",
                                                   str(20 << 30))))
    pypi_mirror_index_ttl: float = field(
        default_factory=lambda: float(os.environ.get("ROLLBOX_PYPI_MIRROR_INDEX_TTL", "300")))

    # Layer storage (rollbox.edge.storage): snapshots and uploaded images are refused while
    # the image store's filesystem has less free space than the reserve (None: max(5 GiB, 5%
    # of the filesystem)); each project's layers (of the images it owns) are capped at
    # project_layer_mib unless its quota says otherwise; one image upload (bytes of its files)
    # at image_upload_max_bytes.
    image_store_reserve_bytes: int | None = field(
        default_factory=lambda: int(os.environ["ROLLBOX_IMAGE_STORE_RESERVE"])
        if "ROLLBOX_IMAGE_STORE_RESERVE" in os.environ else None)
    project_layer_mib: int = field(
        default_factory=lambda: int(os.environ.get("ROLLBOX_PROJECT_LAYER_MIB", str(50 << 10))))
    image_upload_max_bytes: int = field(
        default_factory=lambda: int(os.environ.get("ROLLBOX_IMAGE_UPLOAD_MAX", str(8 << 30))))

    @classmethod
    def scratch(cls, root: Path, images: Path | None = None) -> Settings:
        """Settings of a short-lived node below ``root`` (tests, benchmarks): its data and run
        dirs there, with no tmpfs mounted over the run dir (it goes with ``root``); layers from
        ``images``, by default the node's own store (used read-only)."""
        s = cls()
        s.images_root = images or s.images_dir
        s.data_dir, s.run_dir = root / "data", root / "run"
        s.run_tmpfs = False
        return s

    def environ(self) -> dict[str, str]:
        """The ``ROLLBOX_*`` variables that give a child process (``rollbox serve``) this
        node's data, run dir, cgroup parent, node id, uid range and image store."""
        env = {
            "ROLLBOX_DATA": str(self.data_dir), "ROLLBOX_RUN": str(self.run_dir),
            "ROLLBOX_RUN_TMPFS": "1" if self.run_tmpfs else "0",
            "ROLLBOX_AGENT": str(self.agent_binary), "ROLLBOX_RUNTIME": self.runtime,
            "ROLLBOX_CGROUP": self.cgroup_parent, "ROLLBOX_NODE": self.node_id,
            "ROLLBOX_UID_BASE": str(self.uid_base), "ROLLBOX_UID_SLOTS": str(self.uid_slots),
            "ROLLBOX_JAILER": str(self.vm_jailer), "ROLLBOX_VM_KERNEL": str(self.vm_kernel),
            "ROLLBOX_VM_INITRD": str(self.vm_initrd), "ROLLBOX_VM_ACCEL": self.vm_accel,
            "ROLLBOX_VM_GUEST_MANIFEST": str(self.vm_guest_manifest),
            "ROLLBOX_VM_TEMPLATES": "1" if self.vm_templates else "0",
        }
        if self.images_root is not None:
            env["ROLLBOX_IMAGES"] = str(self.images_root)
        return env

    def mirror_url(self, name: str) -> str | None:
        """The mirror a sandbox with permission ``name`` uses, or None (no mirror configured).
        ``pypi`` falls back on the built-in proxy's listen address when it is enabled."""
        if name in self.mirrors:
            return self.mirrors[name]
        if name == "pypi" and self.pypi_mirror_enabled:
            return f"http://{self.pypi_mirror_host}:{self.pypi_mirror_port}/simple/"
        return None

    @property
    def mirror_dir(self) -> Path:
        return self.data_dir / "mirror"

    @property
    def images_dir(self) -> Path:
        return self.images_root or self.data_dir / "images"

    @property
    def sandboxes_dir(self) -> Path:
        """Per sandbox: its rootfs mount points and OCI bundle (``Rootfs``)."""
        return self.run_dir / "roots"

    @property
    def admin_key_path(self) -> Path:
        """The node's admin API key, root-only (``rollbox serve`` writes it; the SDK's and the
        operator CLI's default on this host)."""
        return self.data_dir / "admin.key"

    @property
    def disk_pool_dir(self) -> Path:
        """The disk pool's file, mount point and lock (``DiskPool``)."""
        return self.data_dir / "disk"

    @property
    def vm_template_dir(self) -> Path:
        """Saved microVM templates (``TemplateCache``); their disks are in the disk pool."""
        return self.data_dir / "vm-templates"

    @property
    def state_db(self) -> Path:
        return self.data_dir / "state.db"


def get_settings() -> Settings:
    return Settings()
