"""Node-wide settings: where rollbox keeps its data and which host resources carry its name.

Every host resource a sandbox uses is named so a leak can be found: data under ``data_dir``,
cgroups under the ``rollbox`` parent, network namespaces ``rollbox-<id>``, runc state under
``run_dir``. Environment variables (``ROLLBOX_*``) override the defaults.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env_path(name: str, default: str | Path) -> Path:
    return Path(os.environ.get(name, str(default)))


@dataclass
class Settings:
    data_dir: Path = field(default_factory=lambda: _env_path("ROLLBOX_DATA", "/var/lib/rollbox"))
    # runc --root; tmpfs-backed so a host reboot forgets stale container state.
    run_dir: Path = field(default_factory=lambda: _env_path("ROLLBOX_RUN", "/run/rollbox"))
    agent_binary: Path = field(
        default_factory=lambda: _env_path("ROLLBOX_AGENT", REPO_ROOT / "build" / "rollbox-agent")
    )
    runtime: str = field(default_factory=lambda: os.environ.get("ROLLBOX_RUNTIME", "runc"))
    cgroup_parent: str = field(default_factory=lambda: os.environ.get("ROLLBOX_CGROUP", "rollbox"))
    node_id: str = field(default_factory=lambda: os.environ.get("ROLLBOX_NODE", "n0"))
    # First host uid of the sandbox uid ranges; each sandbox slot gets 65536 ids above it.
    uid_base: int = 1_000_000_000 // 65536 * 65536
    uid_slots: int = 8192
    # Image store; defaults to <data_dir>/images (tests share the node's built images).
    images_root: Path | None = field(
        default_factory=lambda: Path(os.environ["ROLLBOX_IMAGES"]) if "ROLLBOX_IMAGES" in os.environ
        else None)

    @property
    def images_dir(self) -> Path:
        return self.images_root or self.data_dir / "images"

    @property
    def sandboxes_dir(self) -> Path:
        return self.data_dir / "sandboxes"

    @property
    def state_db(self) -> Path:
        return self.data_dir / "state.db"


def get_settings() -> Settings:
    return Settings()
