"""Node-wide settings: every ``ROLLBOX_*`` variable of a node, read here and nowhere else.

Every host resource a sandbox uses is named so a leak can be found: data under ``data_dir``,
cgroups under the ``rollbox`` parent, network namespaces ``rollbox-<id>``, the working state of
live sandboxes (mount points, bundles, sockets, runc state) under ``run_dir``. Each of them
belongs to one edge (node): several edges on one host get disjoint ones from
:meth:`Settings.for_node`, and an edge claims its own when it starts
(``rollbox.isolation.hostclaims``; docs/cluster.md, host resources).

Each setting is one field of :class:`Settings`, declared with :func:`setting`: its variable, its
group (the component that uses it) and what it means. ``Settings()`` reads the environment when
it is made, never at import; code gets a Settings (or the values it needs) from its caller. A
variable that is unset or blank leaves the default; a flag is ``1``/``0`` (or true/false,
yes/no, on/off); a value that does not parse is a :class:`SettingError` naming the variable.
:func:`describe` says where each effective value came from (``rollbox config``); the settings
page of the docs is generated from the same declarations (``rollbox config --markdown``) and a
test keeps it equal. The one other reader of ``ROLLBOX_*`` is the SDK, for its client's own
defaults (``ROLLBOX_URL``, ``ROLLBOX_API_KEY``: see ``rollbox.sdk._env``).
"""
from __future__ import annotations

import copy
import hashlib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# The groups, in the order ``rollbox config`` and the docs show them: name -> what uses them.
GROUPS: dict[str, str] = {
    "node": "The node: its data, working state and the host names of its sandboxes",
    "container": "Container backend (rollbox.backends.container)",
    "disk": "Disk pool of the writable layers (rollbox.backends.container.disk)",
    "microvm": "microVM backend (rollbox.backends.microvm) and its guest (rollbox.guest)",
    "vm": "Full-VM backend (rollbox.backends.vm: computer use) and its guest "
          "(rollbox.guest.vmbuild)",
    "templates": "microVM templates (rollbox.backends.microvm.template)",
    "admission": "Admission of creates (rollbox.edge.admission)",
    "pool": "Warm pools of container sandboxes (rollbox.edge.pool)",
    "images": "Image store, layer storage and chunk stores (rollbox.images, rollbox.edge.storage)",
    "lazy": "Lazy loading of layers (rollbox.images.lazy)",
    "network": "Sandbox networks (rollbox.netpolicy)",
    "mirrors": "Package mirrors (rollbox.netpolicy.mirror, docs/mirrors.md)",
    "watcher": "The watcher's probes of the edges and its health thresholds (rollbox.watcher)",
    "cluster": "Cluster mode (rollbox.cluster: Ray nodes, edge actors, api replicas)",
    "burst": "Cloud bursting (rollbox.placement.burst, rollbox.cluster.burst, docs/cluster.md)",
    "placement": "Choice of a node for a new sandbox (rollbox.placement)",
    "e2b": "The E2B front door (rollbox.compat.e2b)",
    "ports": "Exposed ports: the api's proxy to services in sandboxes (rollbox.api.ports)",
}


class SettingError(ValueError):
    """A ``ROLLBOX_*`` variable whose value does not parse."""


@dataclass(frozen=True)
class Var:
    """How one setting is read: its variable, group, default, parser and meaning."""
    env: str
    group: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    secret: bool = False  # shown as set/unset, never printed

    def read(self, environ: Mapping[str, str]) -> Any:
        raw = environ.get(self.env, "").strip()
        if not raw:
            return copy.copy(self.default)
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingError(f"{self.env}={raw!r}: {exc}") from None


def setting(env: str, group: str, default: T, parse: Callable[[str], T], doc: str, *,
            secret: bool = False) -> T:
    """A field of Settings read from ``env`` when a Settings is made."""
    assert group in GROUPS, group
    var = Var(env, group, default, parse, doc, secret)
    return field(default_factory=lambda: var.read(os.environ), metadata={"var": var})


# ---- parsers: text of a variable (not blank) -> value ---------------------------------------

def full_templates(raw: str) -> str:
    if raw not in ("off", "disk", "all"):
        raise ValueError("one of off, disk, all")
    return raw


def flag(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a flag (1 or 0)")


def pairs(raw: str) -> dict[str, str]:
    """``"a=x,b=y"`` -> ``{"a": "x", "b": "y"}``; items without a name or a value are ignored."""
    out: dict[str, str] = {}
    for item in raw.split(","):
        name, sep, value = item.strip().partition("=")
        if sep and name.strip() and value.strip():
            out[name.strip()] = value.strip()
    return out


def items(raw: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")`` (blank items dropped)."""
    return tuple(u.strip() for u in raw.split(",") if u.strip())


NODE_ID_RE = re.compile(r"[A-Za-z0-9_.]{1,32}")
# Host uid ranges of 65536 ids above an edge's uid_slots kept for its image builds
# (backends/container/build.py takes 16): part of the edge's band, never another edge's.
UID_BAND_EXTRA = 64
UID_RANGE = 65536
UID_LIMIT = 1 << 32  # host uids are 32-bit (and 2**32-1 is "no uid")


def node_name(raw: str) -> str:
    """A node id: 1-32 letters, digits, ``_`` or ``.``; no ``-``, which ends it in a sandbox
    id (``<node>-<hex>``): with one, node ``a``'s clean-up of ``a-*`` would take node
    ``a-b``'s sandboxes for its own."""
    if not NODE_ID_RE.fullmatch(raw):
        raise ValueError("a node id is 1-32 of A-Z a-z 0-9 _ . (no '-')")
    return raw


def share(raw: str) -> float:
    value = float(raw)
    if not 0 < value <= 1:
        raise ValueError("a share is a number in (0, 1]")
    return value


LOG_FORMATS = ("json", "text")


def log_format(raw: str) -> str:
    if raw not in LOG_FORMATS:
        raise ValueError(f"a log format is one of {', '.join(LOG_FORMATS)}")
    return raw


def ports(raw: str) -> tuple[int, ...]:
    """``"8080,9000,7440-7443"`` -> ``(8080, 9000, 7440, 7441, 7442, 7443)``; items that are
    not numbers or ranges of numbers are ignored."""
    out: list[int] = []
    for p in items(raw):
        lo, sep, hi = p.partition("-")
        if p.isdigit():
            out.append(int(p))
        elif sep and lo.strip().isdigit() and hi.strip().isdigit():
            out.extend(range(int(lo), int(hi) + 1))
    return tuple(out)


@dataclass
class Settings:
    # ---- node ----------------------------------------------------------------------------
    data_dir: Path = setting(
        "ROLLBOX_DATA", "node", Path("/var/lib/rollbox"), Path,
        "Where the node keeps its data: images, state database, admin key, disk pool, chunks.")
    run_dir: Path = setting(
        "ROLLBOX_RUN", "node", Path("/run/rollbox"), Path,
        "Working state of live sandboxes: mount points, OCI bundles, agent sockets, runc "
        "--root. It must be on a tmpfs: it dies with the host anyway, and creating and "
        "removing its inodes on a disk filesystem cost ~7 ms of CPU per sandbox on an ext4 "
        "host (inode allocation, journal), a sixth of a create/exec/destroy cycle.")
    run_tmpfs: bool = setting(
        "ROLLBOX_RUN_TMPFS", "node", True, flag,
        "The container backend mounts a tmpfs on the run dir when it is on disk (hosts whose "
        "/run is not a tmpfs).")
    node_id: str = setting(
        "ROLLBOX_NODE", "node", "n0", node_name,
        "This node's id (in sandbox ids and cgroup names): 1-32 of A-Z a-z 0-9 _ . (no `-`). "
        "Two live edges on one host never have the same one (the second does not start: "
        "HostResourceConflict).")
    cgroup_parent: str = setting(
        "ROLLBOX_CGROUP", "node", "rollbox", str,
        "Parent cgroup of every sandbox's cgroup (in every v1 controller and the v2 "
        "hierarchy); one edge's own: no other live edge on the host has it, or one inside "
        "or around it.")
    cgroup_favordynmods: bool = setting(
        "ROLLBOX_CGROUP_FAVORDYNMODS", "node", True, flag,
        "At start the container backend turns on the kernel's `favordynmods` option of the "
        "cgroup2 mount (host-wide; on kernel 6.18 it stays on until reboot): placing a "
        "sandbox's init in its cgroups then does not wait for an RCU grace period (9.4 ms "
        "at load ~20 here, 0.27 ms with it), at a slightly dearer fork and exit. Off: the "
        "mount is left as it is.")
    cpu_qos: bool = setting(
        "ROLLBOX_CPU_QOS", "node", True, flag,
        "Sandboxes of qos `batch` run in the idle CPU class (cpu.idle=1, lowest weight, "
        "SCHED_IDLE: only on CPU time nothing else wants; isolation/qos.py); off, every "
        "sandbox runs in the normal class as `latency` ones do (placement still uses qos). "
        "Off for nodes whose batch work must not wait for the host's other processes.")
    uid_base: int = setting(
        "ROLLBOX_UID_BASE", "node", 1_000_000_000 // 65536 * 65536, int,
        "First host uid of the node's sandbox uid ranges; each sandbox slot gets 65536 ids "
        "above it. The node's band is uid_slots + 64 ranges from here (the 64 for its image "
        "builds); no other live edge on the host has a uid in it.")
    uid_slots: int = setting("ROLLBOX_UID_SLOTS", "node", 8192, int,
                             "Number of sandbox uid ranges (slots).")
    host_dir: Path = setting(
        "ROLLBOX_HOST_DIR", "node", Path("/run/rollbox-host"), Path,
        "Host-wide, shared by every edge of the host (a tmpfs): each live edge's claim of its "
        "host resources (node id, data and run dirs, cgroup parent, uid band, sandbox "
        "subnet), a file it holds locked (rollbox.isolation.hostclaims). The same for all "
        "edges of a host.")
    host_auto: bool = setting(
        "ROLLBOX_HOST_AUTO", "node", False, flag,
        "At start the edge takes the first uid band (from uid_base up, in steps of its band) "
        "and the first sandbox subnet (net_pool's size, within net_host_range) no live edge "
        "holds, instead of exactly uid_base and net_pool; what it took is kept in its data "
        "dir and asked for again at its restarts (test nodes, throw-away edges).")
    agent_binary: Path = setting(
        "ROLLBOX_AGENT", "node", REPO_ROOT / "build" / "rollbox-agent", Path,
        "The in-sandbox agent (`make native`), init of containers and of microVM guests.")
    log_format: str = setting(
        "ROLLBOX_LOG_FORMAT", "node", "json", log_format,
        "How platform processes (`rollbox serve`, edges, cluster replicas) log: `json` (one "
        "object a line: ts, level, logger, msg, request_id, sandbox_id, exec_id, exc; every "
        "control and non-ASCII character escaped) or `text` (escaped lines).")
    metrics: bool = setting(
        "ROLLBOX_METRICS", "node", True, flag,
        "Prometheus metrics of platform processes (`/metrics` of the api and the edges; "
        "docs/operations.md). Off: nothing is recorded and `/metrics` is empty.")
    metrics_projects: tuple[str, ...] = setting(
        "ROLLBOX_METRICS_PROJECTS", "node", (), items,
        "Top-level projects named in metric labels (`project`); every other is `other`. "
        "Empty: the first 50 seen (rollbox.metrics.MAX_PROJECTS).")
    platform_shell: Path = setting(
        "ROLLBOX_PLATFORM_SHELL", "node", Path("/bin/bash-static"), Path,
        "bash-static: interprets command strings in sandboxes (agent/platform_shell.py).")

    # ---- container backend ---------------------------------------------------------------
    runtime: str = setting("ROLLBOX_RUNTIME", "container", "native", str,
                           "What starts containers: `native` (rollbox's own launcher, "
                           "ROLLBOX_LAUNCHER; hybrid cgroup hosts) or the name of an OCI "
                           "runtime binary (`runc`: also pure cgroup v2 hosts).")
    launcher_binary: Path = setting(
        "ROLLBOX_LAUNCHER", "container", REPO_ROOT / "build" / "rollbox-launcher", Path,
        "The native runtime's launcher (`make native`; ROLLBOX_RUNTIME=native).")
    unhardened_for_bench: bool = setting(
        "ROLLBOX_UNHARDENED_FOR_BENCH", "container", False, flag,
        "Benchmark only: every container sandbox is the unhardened twin of the red-team tests "
        "(`rollbox bench container` starts a second server with it to measure what hardening "
        "costs). Never on a node that runs real work.")

    # ---- disk pool -----------------------------------------------------------------------
    disk_pool_device: Path | None = setting(
        "ROLLBOX_DISK_DEVICE", "disk", None, Path,
        "A btrfs partition (formatted by the operator) for the writable layers; unset: a "
        "sparse file below the data dir.")
    disk_pool_gib: int = setting(
        "ROLLBOX_DISK_POOL_GIB", "disk", 0, int,
        "Size of that sparse file in GiB (0: 80% of the free space of its filesystem when it "
        "is first made).")

    # ---- microVM backend -----------------------------------------------------------------
    qemu_binary: Path = setting("ROLLBOX_QEMU", "microvm",
                                Path("/usr/bin/qemu-system-x86_64"), Path, "QEMU.")
    vm_jailer: Path = setting("ROLLBOX_JAILER", "microvm", REPO_ROOT / "build" / "rollbox-jailer",
                              Path, "The jailer QEMU runs under (`make native`).")
    vm_kernel_package: str = setting(
        "ROLLBOX_VM_KERNEL_PKG", "microvm", "linux-image-cloud-amd64", str,
        "The guest's kernel package: `make guest` unpacks the kernel this Debian meta package "
        "depends on (rollbox.guest.build); the kernel and initramfs below are its outputs.")
    platform_busybox: Path = setting(
        "ROLLBOX_PLATFORM_BUSYBOX", "microvm", Path("/bin/busybox"), Path,
        "busybox-static: the platform's own tools in a microVM guest (rollbox.guest.build).")
    vm_kernel: Path = setting("ROLLBOX_VM_KERNEL", "microvm",
                              REPO_ROOT / "build" / "guest" / "vmlinux", Path,
                              "The guest kernel (`make guest`).")
    vm_initrd: Path = setting("ROLLBOX_VM_INITRD", "microvm",
                              REPO_ROOT / "build" / "guest" / "initramfs.cpio", Path,
                              "The guest initramfs, the agent as its /init (`make guest`).")
    vm_guest_manifest: Path = setting(
        "ROLLBOX_VM_GUEST_MANIFEST", "microvm", REPO_ROOT / "build" / "guest" / "manifest.json",
        Path, "Kernel version and digests of the guest kernel and initramfs (part of a "
        "template's key); the deb and its unpacked tree are cached in a `cache` directory "
        "beside it.")
    vm_accel: str = setting(
        "ROLLBOX_VM_ACCEL", "microvm", "auto", str,
        "The accelerator: kvm, tcg, or auto (KVM if a probe boot reaches the agent, else TCG).")
    vm_accel_cache: Path = setting(
        "ROLLBOX_VM_ACCEL_CACHE", "microvm", Path("/run/rollbox-accel"), Path,
        "Probe results per (kernel, QEMU, /dev/kvm): a node start re-probes only when one "
        "changes.")
    vm_boot_timeout_s: float = setting("ROLLBOX_VM_BOOT_TIMEOUT", "microvm", 60.0, float,
                                       "Seconds a guest may take to answer.")
    vm_overhead_mib: int = setting("ROLLBOX_VM_OVERHEAD_MIB", "microvm", 256, int,
                                   "QEMU's memory (MiB) on top of the guest's.")
    vm_tb_size_mib: int = setting("ROLLBOX_VM_TB_MIB", "microvm", 64, int,
                                  "TCG's translation cache (MiB) per VM.")
    vm_idle_squeeze_s: float = setting(
        "ROLLBOX_VM_IDLE_SQUEEZE_S", "microvm", 60.0, float,
        "A microVM with no command running and none started for this many seconds is "
        "squeezed (balloon to its floor) until its next command; 0: never.")
    vm_free_page_reporting: bool = setting(
        "ROLLBOX_VM_FREE_PAGE_REPORTING", "microvm", True, flag,
        "The balloon's free-page reporting (pages the guest frees go back to the host); off "
        "only to measure what it saves (`rollbox bench microvm`).")
    vm_ksm: bool = setting(
        "ROLLBOX_VM_KSM", "microvm", False, flag,
        "Host page merging of guest RAM (backends/microvm/ksm.py): on, the node starts the "
        "host's ksmd (clones of a template share their identical pages); off, VMs get "
        "mem-merge=off. Off by default: merging is a cross-tenant side channel "
        "(docs/security.md), an opt-in for single-tenant nodes.")
    vm_ksm_pages_to_scan: int = setting("ROLLBOX_VM_KSM_PAGES", "microvm", 1000, int,
                                        "With KSM on: pages ksmd scans at least per 20 ms.")
    vm_ksm_sysfs: Path = setting("ROLLBOX_VM_KSM_SYSFS", "microvm", Path("/sys/kernel/mm/ksm"),
                                 Path, "The host's KSM controls.")
    vm_step_log: Path | None = setting(
        "ROLLBOX_VM_STEP_LOG", "microvm", None, Path,
        "A file that gets one JSON line per microVM create with its step timings "
        "(backends/microvm/steps.py; `rollbox bench microvm` sets it); unset: none written.")

    # ---- full-VM backend (backends/vm; the rest of its settings are the microVM's) --------
    vm_full_kernel_package: str = setting(
        "ROLLBOX_VMFULL_KERNEL_PKG", "vm", "linux-image-amd64", str,
        "The full VM's kernel package: `make vmguest` unpacks the bzImage this Debian meta "
        "package depends on (it has DRM for the VGA device and USB HID; the cloud kernel not).")
    vm_full_kernel: Path = setting("ROLLBOX_VMFULL_KERNEL", "vm",
                                   REPO_ROOT / "build" / "vmguest" / "bzImage", Path,
                                   "The full VM's kernel, booted by SeaBIOS (`make vmguest`).")
    vm_full_initrd: Path = setting(
        "ROLLBOX_VMFULL_INITRD", "vm", REPO_ROOT / "build" / "vmguest" / "initramfs.cpio", Path,
        "The full VM's initramfs, the agent as its /init (`make vmguest`).")
    vm_full_guest_manifest: Path = setting(
        "ROLLBOX_VMFULL_GUEST_MANIFEST", "vm",
        REPO_ROOT / "build" / "vmguest" / "manifest.json", Path,
        "Kernel version and digests of the full VM's kernel and initramfs; the deb cache is "
        "beside it.")
    vm_screenshot_max_bytes: int = setting(
        "ROLLBOX_VM_SCREENSHOT_MAX_BYTES", "vm", 16 << 20, int,
        "The most bytes of one screenshot QEMU may write (larger: an error, never read on).")
    vm_type_max_chars: int = setting(
        "ROLLBOX_VM_TYPE_MAX_CHARS", "vm", 4096, int,
        "The most characters one keyboard.type call may send.")
    vm_full_templates: str = setting(
        "ROLLBOX_VM_FULL_TEMPLATES", "vm", "disk", full_templates,
        "Which `vm` creates restore a machine template (booted once per key, saved once its "
        "screen settled: backends/vm/templates.py) instead of booting: 'disk' (the default: "
        "disk-image guests, the desktop), 'all' (layered images too) or 'off' (every create "
        "boots).")
    vm_full_template_settle_s: float = setting(
        "ROLLBOX_VM_FULL_TEMPLATE_SETTLE_S", "vm", 600.0, float,
        "How long a `vm` template's build VM may take after its agent answered until its "
        "screen settles (a desktop drawn); past it the create boots cold.")
    view_token_ttl_s: float = setting(
        "ROLLBOX_VIEW_TOKEN_TTL", "vm", 900.0, float,
        "Seconds a live view's cookie lives unless its request asks for less (at most "
        "`view_token_max_ttl_s`); the view's WebSocket ends with it.")
    view_token_max_ttl_s: float = setting(
        "ROLLBOX_VIEW_TOKEN_MAX_TTL", "vm", 4 * 3600.0, float,
        "The longest life a live view's cookie may be asked for.")
    view_code_ttl_s: float = setting(
        "ROLLBOX_VIEW_CODE_TTL", "vm", 60.0, float,
        "Seconds a live view's one-time login code (its URL) may wait to be used.")
    view_novnc_dir: Path = setting(
        "ROLLBOX_VIEW_NOVNC_DIR", "vm", REPO_ROOT / "build" / "novnc", Path,
        "noVNC's files the live view page serves (`make novnc`, part of `make setup`: the "
        "pinned npm package, its sha512 checked).")
    # ---- microVM templates ---------------------------------------------------------------
    vm_templates: bool = setting(
        "ROLLBOX_VM_TEMPLATES", "templates", True, flag,
        "Creates restore a VM saved once per key instead of booting.")
    vm_template_max_count: int = setting("ROLLBOX_VM_TEMPLATE_MAX", "templates", 16, int,
                                         "Templates the node keeps at most (LRU).")
    vm_template_max_bytes: int = setting(
        "ROLLBOX_VM_TEMPLATE_MAX_BYTES", "templates", 8 << 30, int,
        "Bytes of templates (saved state + disk) the node keeps at most (LRU; 8 GiB).")
    vm_template_retry_s: float = setting("ROLLBOX_VM_TEMPLATE_RETRY_S", "templates", 60.0,
                                         float, "Seconds before a failed build is retried.")
    vm_template_spares: int = setting(
        "ROLLBOX_VM_TEMPLATE_SPARES", "templates", 1, int,
        "Spare QEMUs kept per template creates restore from (backends/microvm/spares.py: "
        "started ahead under -incoming defer, RAM faulted in; a restore loads its state into "
        "one); 0: none, every restore starts its own QEMU.")
    vm_template_spares_max: int = setting(
        "ROLLBOX_VM_TEMPLATE_SPARES_MAX", "templates", 4, int,
        "Spare QEMUs the node keeps at most over all templates (most recently used first).")
    vm_template_spare_idle_s: float = setting(
        "ROLLBOX_VM_TEMPLATE_SPARE_IDLE_S", "templates", 600.0, float,
        "A template's spares stop when no create restored from it for this many seconds.")
    vm_fork_spares: int = setting(
        "ROLLBOX_VM_FORK_SPARES", "templates", 8, int,
        "Spare QEMUs a microVM fork's children may take, and kept for a template once a VM "
        "restored from it was forked, until no restore used it for "
        "ROLLBOX_VM_TEMPLATE_SPARE_IDLE_S (backends/microvm/spares.py; also raises "
        "ROLLBOX_VM_TEMPLATE_SPARES_MAX to it): a child restored into a spare skips QEMU's "
        "start and its RAM faults (fork(8) under TCG: ready 0.54x, CPU 0.74x of no spares). "
        "Each holds about the template's saved RAM (8 of a 256 MiB python:3.11 guest 584 MiB); "
        "a node that never forks keeps none; 0: forks take none, every child starts its own "
        "QEMU.")
    vm_fork_warm: bool = setting(
        "ROLLBOX_VM_FORK_WARM", "templates", False, flag,
        "With more children than cores, a microVM fork runs the platform shell's `true` in "
        "each child once it is made unique, while later children still restore "
        "(backends/microvm/backend.py fork: TCG then translates the guest's exec path before "
        "the child is handed out). Off by default: on this 2-core host it measured 0.84x, "
        "1.89x and 1.29x of off (`rollbox bench fork`, docs/benchmarks.md).")
    vm_template_shared_ram: bool = setting(
        "ROLLBOX_VM_TEMPLATE_SHARED_RAM", "templates", True, flag,
        "A template's RAM as a file its restored VMs map copy-on-write (one copy of what they "
        "have not written, backends/microvm/qemu.py), where QEMU can map it read-only "
        "(>= 8.2); off (or an older QEMU): every restore copies the saved RAM.")

    # ---- admission -----------------------------------------------------------------------
    # Requests set a sandbox's limits, not reservations: their sums may exceed the host many
    # times; live use decides the rest.
    max_sandboxes: int = setting("ROLLBOX_MAX_SANDBOXES", "admission", 4096, int,
                                 "Sandboxes the node holds at most.")
    paused_ttl_s: float = setting(
        "ROLLBOX_PAUSED_TTL_S", "admission", 24 * 3600.0, float,
        "How long a sandbox paused at its TTL's end (on_expiry \"pause\"; E2B's auto-pause) "
        "or through the E2B API lives on paused before it is deleted.")
    usage_sample_s: float = setting(
        "ROLLBOX_USAGE_SAMPLE_S", "admission", 5.0, float,
        "How often the edge samples each live sandbox's CPU, memory and disk use for its usage "
        "history (GET /v1/sandboxes/{id}/usage; E2B's metrics).")
    usage_samples: int = setting(
        "ROLLBOX_USAGE_SAMPLES", "admission", 720, int,
        "Samples of usage history kept per sandbox (the oldest go first; 720 at 5 s: an "
        "hour). Gone with the sandbox.")
    fork_max_children: int = setting(
        "ROLLBOX_FORK_MAX", "admission", 64, int,
        "Children one fork makes at most on this node (at most 100, the API's bound, "
        "rollbox.models.MAX_FORK_CHILDREN); more is refused with bad_request.")
    memory_overcommit: float = setting(
        "ROLLBOX_MEMORY_OVERCOMMIT", "admission", 160.0, float,
        "How many times the memory requests may add up to the host's memory.")
    cpu_overcommit: float = setting(
        "ROLLBOX_CPU_OVERCOMMIT", "admission", 2000.0, float,
        "How many times the CPU requests may add up to the host's CPUs (a CFS quota: "
        "throttled, never killed; 3,200 one-CPU sandboxes on 2 cores).")
    memory_reserve_mib: int | None = setting(
        "ROLLBOX_MEMORY_RESERVE_MIB", "admission", None, int,
        "Host memory (MiB) creates never eat into; unset: max(2 GiB, 10% of RAM).")
    sandboxes_memory_max_mib: int | None = setting(
        "ROLLBOX_SANDBOXES_MEMORY_MAX_MIB", "admission", None, int,
        "Limit (MiB) of the parent memory cgroup of all sandboxes; unset: RAM minus the "
        "reserve.")
    reserved_share: float = setting(
        "ROLLBOX_RESERVED_SHARE", "admission", 0.10, float,
        "Share of every budget (count, requests, free memory) only grades and fncall workers "
        "use.")
    memory_psi_max: float = setting(
        "ROLLBOX_MEMORY_PSI_MAX", "admission", 20.0, float,
        "Memory PSI (\"some\", avg10, %) above which new creates are refused.")
    node_share: float = setting(
        "ROLLBOX_NODE_SHARE", "admission", 1.0, share,
        "This node's share of the host's CPUs and memory, in (0, 1] (several edges on one "
        "host: Settings.for_node(..., nodes=N) gives each 1/N): admission, overcommit, the "
        "memory reserve and the sandboxes' parent memory cgroup go by the share, not the "
        "whole host.")
    node_cpus: float | None = setting(
        "ROLLBOX_NODE_CPUS", "admission", None, float,
        "CPUs this node's admission counts (unset: the host's times node_share).")
    node_memory_mib: int | None = setting(
        "ROLLBOX_NODE_MEMORY_MIB", "admission", None, int,
        "Memory (MiB) this node's admission counts (unset: the host's times node_share).")

    # ---- warm pools ------------------------------------------------------------------------
    pool: bool = setting(
        "ROLLBOX_POOL", "pool", False, flag,
        "Warm pools of container sandboxes: sandboxes made ahead per set-up key (image, "
        "layers, resources, network, hidden paths, disk tier, qos, runtime) sized by recent "
        "demand and handed out at create (docs/operations.md, warm pools). Off by default: a "
        "pooled sandbox is a live sandbox (cgroup, uid slot, memory) nobody asked for yet; "
        "on for RL nodes whose episodes create the same few keys over and over.")
    pool_max_per_key: int = setting(
        "ROLLBOX_POOL_MAX_PER_KEY", "pool", 8, int,
        "Pooled sandboxes of one key at most.")
    pool_min_per_key: int = setting(
        "ROLLBOX_POOL_MIN_PER_KEY", "pool", 1, int,
        "Pooled sandboxes a key keeps while it is still asked for (its demand above 1/2).")
    pool_max_total: int = setting(
        "ROLLBOX_POOL_MAX_TOTAL", "pool", 32, int,
        "Pooled sandboxes of all keys at most; above the node's capacity (sandboxes or memory "
        "for new creates) the edge does not start.")
    pool_window_s: float = setting(
        "ROLLBOX_POOL_WINDOW_S", "pool", 60.0, float,
        "Time constant (s) of a key's demand: an exponentially weighted count of its creates; "
        "a key not asked for decays to 0 and its pooled sandboxes are destroyed.")

    # ---- images and layer storage --------------------------------------------------------
    images_root: Path | None = setting(
        "ROLLBOX_IMAGES", "images", None, Path,
        "The image store; unset: <data dir>/images.")
    vm_disks_root: Path | None = setting(
        "ROLLBOX_VM_DISKS", "images", None, Path,
        "The vm backend's disk images (rollbox.images.vmdisk: one directory per name with "
        "disk.img and disk.json); unset: <data dir>/vm-disks.")
    image_store_reserve_bytes: int | None = setting(
        "ROLLBOX_IMAGE_STORE_RESERVE", "images", None, int,
        "Snapshots and uploaded images are refused while the image store's filesystem has "
        "less free space (bytes); unset: max(5 GiB, 5% of the filesystem).")
    project_layer_mib: int = setting(
        "ROLLBOX_PROJECT_LAYER_MIB", "images", 50 << 10, int,
        "Each project's layers (of the images it owns) are capped at this many MiB unless its "
        "quota says otherwise (50 GiB).")
    image_upload_max_bytes: int = setting(
        "ROLLBOX_IMAGE_UPLOAD_MAX", "images", 8 << 30, int,
        "Bytes of the files of one image upload at most (8 GiB).")
    chunk_store: str | None = setting(
        "ROLLBOX_CHUNK_STORE", "images", None, str,
        "The node's chunk store (dir://, posix://, s3://... URL, rollbox.images.stores): "
        "where pushes go and lazy layers come from by default; unset: dir://<data dir>/chunks.")
    snapshot_push_stores: tuple[str, ...] = setting(
        "ROLLBOX_SNAPSHOT_PUSH_STORES", "images", (), items,
        "Chunk stores (comma-separated URLs) a snapshot may be pushed to besides the node's "
        "own; any other push target is refused.")

    # ---- lazy loading --------------------------------------------------------------------
    lazy_cache_bytes: int = setting(
        "ROLLBOX_LAZY_CACHE_BYTES", "lazy", 64 << 30, int,
        "The node's cache of fetched chunks, bytes at most (64 GiB).")
    lazy_readahead: int = setting(
        "ROLLBOX_LAZY_READAHEAD", "lazy", 4, int,
        "Chunks the daemon fetches ahead of a sequential read.")
    lazy_read_ahead_kb: int | None = setting(
        "ROLLBOX_LAZY_READ_AHEAD_KB", "lazy", None, int,
        "Kernel readahead on the FUSE files (their bdi), KiB; 0: the kernel's; unset: the "
        "daemon's (1 MiB).")
    lazy_max_readahead: int | None = setting(
        "ROLLBOX_LAZY_MAX_READAHEAD", "lazy", None, int,
        "FUSE max_readahead of the mount, bytes; unset: the kernel's.")
    lazy_store_traces: bool = setting(
        "ROLLBOX_LAZY_STORE_TRACES", "lazy", True, flag,
        "Share chunk-read traces through the chunk store (replay another node's, put ours if "
        "the store has none); off: node-local traces only.")

    # ---- sandbox networks ----------------------------------------------------------------
    net_pool: ipaddress.IPv4Network = setting(
        "ROLLBOX_NET_POOL", "network", ipaddress.IPv4Network("10.213.0.0/18"),
        ipaddress.IPv4Network,
        "This node's sandbox subnet: the addresses of its sandboxes' links (a /30 each). "
        "Inside net_host_range; no other live edge on the host has an address of it.")
    net_host_range: ipaddress.IPv4Network = setting(
        "ROLLBOX_NET_HOST_RANGE", "network", ipaddress.IPv4Network("10.213.0.0/16"),
        ipaddress.IPv4Network,
        "The range the edges of this host take their sandbox subnets from (nftables table "
        "`ip rollbox` for this default, one per other range): no sandbox reaches another "
        "sandbox or gate in it, of its own edge or another.")
    platform_ports: tuple[int, ...] = setting(
        "ROLLBOX_PLATFORM_PORTS", "network", (), ports,
        "Ports of the platform's own services on this host besides the api's 7420 "
        "(comma-separated, ranges as `LOW-HIGH`): no rule opens them on a host address. A "
        "cluster's edges get the cluster's whole port range here.")
    edge_port: int = setting(
        "ROLLBOX_EDGE_PORT", "network", 7421, int,
        "The port of this node's edge service in a cluster (edge.service: the api replicas' "
        "data path); one of the platform's ports, so no rule opens it on a host address.")
    dns_upstream: str | None = setting(
        "ROLLBOX_DNS_UPSTREAM", "network", None, str,
        "The DNS server (host[:port]) the sandboxes' DNS gates ask; unset: the host's first "
        "resolv.conf nameserver.")
    net_forward: bool = setting(
        "ROLLBOX_NET_FORWARD", "network", False, flag,
        "Set the host's net.ipv4.ip_forward=1 when the node's nftables table is made (the "
        "operator's choice; sandboxes' traffic leaves through it).")

    # ---- package mirrors -----------------------------------------------------------------
    mirrors: dict[str, str] = setting(
        "ROLLBOX_MIRRORS", "mirrors", {}, pairs,
        "Permission name (pypi, npm, debian, go) -> the mirror's base URL as a sandbox sees "
        "it, e.g. `pypi=http://10.0.0.1:3141/simple/,npm=http://10.0.0.1:4873/`; netpolicy "
        "allows that address instead of the registry.")
    pypi_mirror_enabled: bool = setting(
        "ROLLBOX_PYPI_MIRROR", "mirrors", False, flag,
        "Run the built-in caching PyPI proxy in the api process (else `rollbox mirror "
        "serve` runs it). It never fetches from hosts other than its upstreams.")
    pypi_mirror_host: str = setting("ROLLBOX_PYPI_MIRROR_HOST", "mirrors", "127.0.0.1", str,
                                    "Where the PyPI proxy listens.")
    pypi_mirror_port: int = setting("ROLLBOX_PYPI_MIRROR_PORT", "mirrors", 3141, int,
                                    "The PyPI proxy's port.")
    pypi_mirror_index_upstream: str = setting(
        "ROLLBOX_PYPI_UPSTREAM", "mirrors", "https://pypi.org/simple/", str,
        "The index the PyPI proxy fetches from.")
    pypi_mirror_file_upstreams: tuple[str, ...] = setting(
        "ROLLBOX_PYPI_FILE_UPSTREAMS", "mirrors", ("https://files.pythonhosted.org",), items,
        "Origins (comma-separated) the PyPI proxy fetches files from, the only others.")
    pypi_mirror_max_bytes: int = setting("ROLLBOX_PYPI_MIRROR_MAX_BYTES", "mirrors", 20 << 30,
                                         int, "The PyPI proxy's file cache bound (LRU; 20 GiB).")
    pypi_mirror_index_ttl: float = setting("ROLLBOX_PYPI_MIRROR_INDEX_TTL", "mirrors", 300.0,
                                           float, "Seconds an index page stays fresh.")

    # ---- watcher ---------------------------------------------------------------------------
    # A node that stops answering is dead, and its sandboxes reported node_lost, at most
    # watch_dead_s + watch_interval_s after its last answer (the contract: within 10 s).
    watch_interval_s: float = setting(
        "ROLLBOX_WATCH_INTERVAL", "watcher", 1.0, float,
        "Seconds between two probes of every edge.")
    watch_probe_timeout_s: float = setting(
        "ROLLBOX_WATCH_PROBE_TIMEOUT", "watcher", 2.0, float,
        "A probe not answered within this many seconds failed (one slow edge never holds "
        "the probes of the others).")
    watch_suspect_s: float = setting(
        "ROLLBOX_WATCH_SUSPECT", "watcher", 3.0, float,
        "A node whose last answered probe is older than this is suspect: placement skips it.")
    watch_dead_s: float = setting(
        "ROLLBOX_WATCH_DEAD", "watcher", 7.0, float,
        "A node whose last answered probe is older than this is dead: its sandboxes are "
        "reported dead (node_lost), and are torn down when it comes back.")
    watch_fence: bool = setting(
        "ROLLBOX_WATCH_FENCE", "watcher", True, flag,
        "Probes arm the edge's fence: an edge no probe reached for the dead threshold tears "
        "its sandboxes down itself (node_lost), and a restart after such a gap does not "
        "re-adopt them (docs/watcher.md).")
    watch_reconcile_s: float = setting(
        "ROLLBOX_WATCH_RECONCILE", "watcher", 5.0, float,
        "Seconds between two reconciliations of the quota ledger with the edges' live sets.")
    watch_report_max_sandboxes: int = setting(
        "ROLLBOX_WATCH_REPORT_MAX", "watcher", 10000, int,
        "Live sandboxes one probe lists at most (a node with more is counted, not listed, and "
        "not reconciled).")
    # ---- cluster mode ----------------------------------------------------------------------
    cluster_dir: Path = setting(
        "ROLLBOX_CLUSTER_DIR", "cluster", Path("/var/lib/rollbox-cluster"), Path,
        "State of the cluster run from this host (`rollbox cluster up|join`): its token "
        "(root-only), its state file, the PostgreSQL data, each node's data dir.")
    cluster_port_base: int = setting(
        "ROLLBOX_CLUSTER_PORT_BASE", "cluster", 7440, int,
        "First port of the cluster's fixed range on this host: Ray's GCS, dashboard, "
        "PostgreSQL, the api's shared port and replica ports, then 20 per node (raylet, object "
        "manager, agents, the edge, Ray workers); the whole range is a platform port range "
        "for the cluster's sandboxes.")
    cluster_address: str = setting(
        "ROLLBOX_CLUSTER_ADDRESS", "cluster", "127.0.0.1", str,
        "The address this host's Ray node and edge advertise to the cluster (loopback for a "
        "cluster on one host; the host's cluster-network address when nodes join from other "
        "hosts).")
    cluster_object_store_mib: int = setting(
        "ROLLBOX_CLUSTER_OBJECT_STORE_MIB", "cluster", 256, int,
        "Object store of each Ray node, MiB (the data path never goes through Ray).")
    # ---- cloud bursting -------------------------------------------------------------------
    burst_threshold: float = setting(
        "ROLLBOX_BURST_THRESHOLD", "burst", 0.80, float,
        "Cluster use (the tightest of sandboxes, CPUs and memory over the alive non-burst "
        "nodes, from the watcher's view) at or above which eligible sandboxes (qos batch, "
        "container backend, every layer in the shared chunk store) may go to burst nodes and "
        "burst nodes are requested from Ray's autoscaler.")
    burst_idle_s: float = setting(
        "ROLLBOX_BURST_IDLE", "burst", 120.0, float,
        "A burst node with no sandbox and no create for this many seconds, while the cluster "
        "is below the threshold, is drained (refuses creates), its edge stopped and its Ray "
        "node given back to the autoscaler (which ends it after its own idle timeout).")
    burst_nodes: int = setting(
        "ROLLBOX_BURST_NODES", "burst", 0, int,
        "Burst node slots `rollbox cluster up` gives Ray's autoscaler (one node type each, "
        "at most one node of it) and the most burst nodes the scaler asks for at once; 0: "
        "bursting off (no autoscaler config, no scaler). `cluster up --burst-nodes N`.")
    burst_autoscaler_config: Path | None = setting(
        "ROLLBOX_BURST_AUTOSCALER_CONFIG", "burst", None, Path,
        "An operator's Ray autoscaler YAML for a real cloud (its provider, auth, head and "
        "worker commands); `cluster up` merges the burst node types into its "
        "available_node_types. Unset: burst nodes are Ray nodes on this host (Ray's fake "
        "multi-node provider). `cluster up --autoscaler-config FILE`.")
    burst_layers_ttl_s: float = setting(
        "ROLLBOX_BURST_LAYERS_TTL", "burst", 30.0, float,
        "Seconds an image's 'every layer in the shared chunk store' answer is cached.")
    node_burst: bool = setting(
        "ROLLBOX_NODE_BURST", "burst", False, flag,
        "This node is a burst node (started by the autoscaler): its reports say so and "
        "placement sends it only sandboxes that may burst.")

    # ---- placement -----------------------------------------------------------------------
    placement_k: int = setting(
        "ROLLBOX_PLACEMENT_K", "placement", 2, int,
        "Power-of-k choices: how many fitting nodes a `batch` create compares (the one with "
        "the most room left wins).")
    placement_k_latency: int = setting(
        "ROLLBOX_PLACEMENT_K_LATENCY", "placement", 4, int,
        "Nodes a `latency` create (graders, fncall workers, sandboxes asking for it) "
        "compares: more than `batch`, so it lands with more headroom on average.")
    placement_max_attempts: int = setting(
        "ROLLBOX_PLACEMENT_MAX_ATTEMPTS", "placement", 4, int,
        "Nodes one create is sent to at most: a node that refuses (full, infrastructure "
        "error) is skipped and the next choice tried, this many in all.")
    placement_max_starts: int = setting(
        "ROLLBOX_PLACEMENT_MAX_STARTS", "placement", 32, int,
        "Creates in progress on one node at most (this replica's own plus those the "
        "watcher's last probe saw); a create finding every fitting node at it waits.")
    placement_start_wait_s: float = setting(
        "ROLLBOX_PLACEMENT_START_WAIT_S", "placement", 5.0, float,
        "How long a create waits for a node under the starts cap before it is refused "
        "(capacity, retryable).")
    placement_layer_bonus: float = setting(
        "ROLLBOX_PLACEMENT_LAYER_BONUS", "placement", 0.05, float,
        "The most a node's cache of the image's layers adds to its score, as a share of the "
        "node's capacity (0.05: a node with every layer wins over one with up to 5% more "
        "room left).")

    # ---- the E2B front door --------------------------------------------------------------
    e2b_templates: dict[str, str] = setting(
        "ROLLBOX_E2B_TEMPLATES", "e2b", {}, pairs,
        "E2B template -> rollbox image, e.g. `base=debian:bookworm,py=python:3.11`, on top "
        "of `base`, the default base image.")
    e2b_secret: str | None = setting(
        "ROLLBOX_E2B_SECRET", "e2b", None, str,
        "Key of the envd access tokens; unset: a root-only file in the data dir "
        "(e2b-token.key, tokens stay valid across restarts), else a per-process random key.",
        secret=True)

    # ---- exposed ports ---------------------------------------------------------------------
    port_domain: str | None = setting(
        "ROLLBOX_PORT_DOMAIN", "ports", None, str,
        "Parent domain of the per-sandbox origins `{port}-{id}.<domain>` the api routes by "
        "Host header (point a wildcard DNS record at the api; a domain of its own, not a "
        "parent of the api's); unset: only the path form `/v1/sandboxes/{id}/ports/{port}/`. "
        "Also the E2B `domain` (get_host).")
    port_token_secret: str | None = setting(
        "ROLLBOX_PORT_TOKEN_SECRET", "ports", None, str,
        "HMAC key of the port tokens (every api replica of a cluster needs the same); unset: "
        "a root-only file in the data dir (port-token.key, made once).", secret=True)
    port_token_ttl_s: float = setting(
        "ROLLBOX_PORT_TOKEN_TTL", "ports", 3600.0, float,
        "Seconds a port token lives unless its request asks for less or more (at most 7 "
        "days).")

    @classmethod
    def scratch(cls, root: Path, images: Path | None = None) -> Settings:
        """Settings of a short-lived node below ``root`` (tests, benchmarks): its data and run
        dirs there, with no tmpfs mounted over the run dir (it goes with ``root``); layers from
        ``images``, by default the node's own store (used read-only); a cgroup parent of its
        own and, with ``host_auto``, a free uid band and sandbox subnet taken at start."""
        s = cls()
        s.images_root = images or s.images_dir
        s.vm_disks_root = s.vm_disks_dir  # the node's built VM disks, read-only like layers
        s.data_dir, s.run_dir = root / "data", root / "run"
        s.run_tmpfs = False
        # Its own cgroup parent; the first free uid band and /20 of the host range when its
        # edge starts (host_auto): scratch nodes run beside the host's edges and each other.
        digest = hashlib.sha1(os.path.realpath(root).encode()).hexdigest()[:8]
        s.cgroup_parent = f"rollbox-s{digest}"
        s.uid_base = s.uid_band[1]  # above the default node's band and subnet
        s.net_pool = next(n for n in s.net_host_range.subnets(
            new_prefix=max(20, s.net_host_range.prefixlen)) if not n.overlaps(s.net_pool))
        s.host_auto = True
        return s

    @classmethod
    def for_node(cls, base: Settings, node_id: str, index: int, *, nodes: int | None = None,
                 uid_slots: int | None = None) -> Settings:
        """Settings of one of several edges on this host (tests, demos, ``rollbox cluster`` on
        one machine): a copy of ``base`` whose every host resource is the node's own and
        none is base's, so an edge may run on ``base`` beside them. ``index`` (0, 1, ...)
        numbers the co-hosted nodes; ``nodes``: how many share the host (each gets
        ``base.node_share / nodes`` of its CPUs and memory for admission); ``uid_slots``:
        the node's sandbox uid ranges (default base's).

        - node id ``node_id`` (not base's); data dir ``<base data>-<node_id>`` and run dir
          ``<base run>-<node_id>`` (siblings of base's); cgroup parent
          ``<base parent>-<node_id>``; netns ``rollbox-<node_id>-*`` (by its sandbox ids);
        - host uid band ``index + 1`` above base's (bands of base's uid_slots + 64 ranges);
        - sandbox subnet: the ``index``-th /20 of ``base.net_host_range`` that does not
          overlap ``base.net_pool``;
        - the image store, the VM disks and the chunk store stay base's (shared by design).

        SettingError when the band or subnet does not fit (past uid 2**32, or the range)."""
        if not NODE_ID_RE.fullmatch(node_id) or node_id == base.node_id:
            raise SettingError(f"node id {node_id!r}: 1-32 of A-Z a-z 0-9 _ ., not the base "
                               f"node's ({base.node_id!r})")
        if index < 0 or (nodes is not None and not 0 <= index < nodes):
            raise SettingError(f"node index {index} out of range (nodes={nodes})")
        s = copy.deepcopy(base)
        s.node_id = node_id
        s.data_dir = base.data_dir.with_name(f"{base.data_dir.name}-{node_id}")
        s.run_dir = base.run_dir.with_name(f"{base.run_dir.name}-{node_id}")
        s.images_root = base.images_dir
        s.vm_disks_root = base.vm_disks_dir
        s.chunk_store = base.chunk_store or f"dir://{base.data_dir / 'chunks'}"
        s.cgroup_parent = f"{base.cgroup_parent}-{node_id}"
        s.uid_slots = uid_slots or base.uid_slots
        s.uid_base = base.uid_band[1] + index * (s.uid_slots + UID_BAND_EXTRA) * UID_RANGE
        if s.uid_band[1] > UID_LIMIT - 1:
            raise SettingError(f"node {node_id}: uid band {s.uid_band} is past 2**32; give "
                               "fewer uid_slots")
        prefix = max(20, base.net_host_range.prefixlen)
        subnets = (n for n in base.net_host_range.subnets(new_prefix=prefix)
                   if not n.overlaps(base.net_pool))
        s.net_pool = next((n for k, n in enumerate(subnets) if k == index), None)  # type: ignore[assignment]
        if s.net_pool is None:
            raise SettingError(f"node index {index}: no /{prefix} of {base.net_host_range} "
                               f"left beside {base.net_pool}")
        s.host_auto = False
        if nodes is not None:
            s.node_share = base.node_share / nodes
        return s

    @property
    def uid_band(self) -> tuple[int, int]:
        """``[first, end)`` host uids of this node: its sandbox slots and its builds'."""
        return self.uid_base, self.uid_base + (self.uid_slots + UID_BAND_EXTRA) * UID_RANGE

    @property
    def sandbox_id_prefix(self) -> str:
        """Every sandbox id of this node starts with it (and no other node's does)."""
        return f"{self.node_id}-"

    @property
    def netns_prefix(self) -> str:
        """The names of this node's sandboxes' network namespaces start with it
        (``rollbox.isolation.netns``: ``rollbox-<sandbox id>``)."""
        return f"rollbox-{self.sandbox_id_prefix}"

    def environ(self) -> dict[str, str]:
        """The ``ROLLBOX_*`` variables that give a child process (``rollbox serve``) this
        node's data, run dir, cgroup parent, node id, uid band, subnet, share and image
        store."""
        names = ["data_dir", "run_dir", "run_tmpfs", "agent_binary", "runtime",
                 "launcher_binary", "cgroup_parent",
                 "node_id", "uid_base", "uid_slots", "host_dir", "host_auto", "net_pool",
                 "net_host_range", "node_share", "node_cpus", "node_memory_mib", "vm_jailer",
                 "vm_kernel", "vm_initrd", "vm_accel", "vm_guest_manifest", "vm_templates",
                 "vm_full_kernel", "vm_full_initrd", "vm_full_guest_manifest"]
        if self.images_root is not None:
            names.append("images_root")
        if self.vm_disks_root is not None:
            names.append("vm_disks_root")
        if self.chunk_store is not None:
            names.append("chunk_store")
        return {VARS[n].env: env_text(getattr(self, n)) for n in names}

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
    def vm_disks_dir(self) -> Path:
        """The vm backend's disk images (``rollbox.images.vmdisk``)."""
        return self.vm_disks_root or self.data_dir / "vm-disks"

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


# Field name -> how it is read, in declaration order.
VARS: dict[str, Var] = {f.name: f.metadata["var"] for f in fields(Settings)}


def env_text(value: object) -> str:
    """A value as its variable's text (what the parsers read back)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Effective:
    """One setting as it is: its value and where that came from."""
    name: str
    var: Var
    value: Any
    source: str  # "default", the variable's name, or "program" (set by the code that made it)


def source(settings: Settings, name: str, environ: Mapping[str, str] | None = None) -> str:
    """Where setting ``name`` of ``settings`` came from: its variable when that is set in
    ``environ`` (default: this process's) and gave the value, else ``default`` when it is the
    default, else ``program`` (set by the code that made the settings)."""
    var, value = VARS[name], getattr(settings, name)
    env = os.environ if environ is None else environ
    if env.get(var.env, "").strip() and var.read(env) == value:
        return var.env
    return "default" if value == var.default else "program"


def describe(settings: Settings, environ: Mapping[str, str] | None = None) -> list[Effective]:
    """Every setting of ``settings`` with its :func:`source`, grouped (:data:`GROUPS` order)."""
    out = [Effective(name, var, getattr(settings, name), source(settings, name, environ))
           for name, var in VARS.items()]
    order = list(GROUPS)
    return sorted(out, key=lambda e: order.index(e.var.group))


def get_settings() -> Settings:
    return Settings()
