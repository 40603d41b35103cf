"""The container backend as the sandbox of image builds: implements
:class:`rollbox.images.sources.commands.BuildSandboxes`, and
:func:`build_layer_with_commands` runs that source on it.

A build sandbox is a container of its own backend (uid slots above the edge's, so a running
edge never shares one; the node's layer mounts, lazy layers included), the host network only
when the operator's commands ask for it. Its writable layer is taken like a snapshot's
(``capture_writable``: frozen, descriptor-based), with the builder's content.

Owns this adapter. Not: what a build does with the sandbox (``images.sources.commands``).
"""
from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from rollbox.backends.container.sandbox import ContainerBackend, ContainerSandbox
from rollbox.config import Settings
from rollbox.images.lazy.mounts import LayerMounts
from rollbox.images.scrub import UPPER_CACHE_EXCLUDES
from rollbox.images.snapshot import BUILD_MAX_BYTES, BUILD_MAX_ENTRIES, CaptureOptions
from rollbox.images.sources import commands
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources

BUILD_RESOURCES = Resources(cpus=2, memory_mib=4096, pids=4096, disk_mib=8192,
                            inodes=1_000_000)
BUILD_SLOTS = 16


class _BuildSandbox:
    def __init__(self, backend: ContainerBackend, box: ContainerSandbox) -> None:
        self.backend = backend
        self.box = box

    async def write_file(self, path: str, data: bytes, mode: int) -> None:
        await self.box.files.write(path, data, mode)

    async def run_shell(self, cmd: str, env: dict[str, str], timeout_s: float,
                        on_output: Callable[[bytes], object] | None) -> tuple[int, bytes]:
        return await self.box.run_shell(cmd, env, timeout_s, on_output=on_output)

    async def capture(self, dest: Path, *, keep_git_history: bool) -> None:
        await self.backend.capture_writable(self.box, dest, CaptureOptions(
            pause=True, scrub=list(UPPER_CACHE_EXCLUDES), exclude=[],
            max_bytes=BUILD_MAX_BYTES, max_entries=BUILD_MAX_ENTRIES,
            complete_repos=not keep_git_history, content="build"))


class ContainerBuildSandboxes:
    """Build sandboxes over the layers of ``store`` (see the module docstring)."""

    def __init__(self, store: ImageStore, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()

    @asynccontextmanager
    async def sandbox(self, layers: list[str], env: dict[str, str],
                      network: str) -> AsyncIterator[_BuildSandbox]:
        settings = self.settings
        slots = UidSlots(settings.uid_base + settings.uid_slots * 65536, BUILD_SLOTS)
        backend = ContainerBackend(settings, LayerMounts(self.store, settings), slots)
        box = None
        try:
            box = await backend.create(f"build-{secrets.token_hex(5)}", layers,
                                       BUILD_RESOURCES, env, network=network)
            yield _BuildSandbox(backend, box)
        finally:
            if box is not None:
                await backend.destroy(box)
            backend.release_node_resources()
            slots.close()


async def build_layer_with_commands(store: ImageStore, base: str, cmds: list[str], name: str,
                                    *, settings: Settings | None = None,
                                    network: str = "host", log: Callable[[str], None] = print,
                                    log_file: Path | None = None,
                                    keep_git_history: bool = False,
                                    image_env: dict[str, str] | None = None) -> str:
    """:func:`rollbox.images.sources.commands.build_layer_with_commands` in a container
    build sandbox of this node."""
    return await commands.build_layer_with_commands(
        store, base, cmds, name, sandboxes=ContainerBuildSandboxes(store, settings),
        network=network, log=log, log_file=log_file, keep_git_history=keep_git_history,
        image_env=image_env)
