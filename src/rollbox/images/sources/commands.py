"""Image source: commands run in a sandbox over a base image; its writable layer, scrubbed,
becomes one new layer over the base's (the mechanism of ``rollbox image build --base --run``
and of the default images).

The sandbox is the caller's (:class:`BuildSandboxes`, e.g. the container backend's in
``rollbox.backends.container.build``): this module never makes one. Its writable layer comes
back through the snapshots' path (:mod:`rollbox.images.snapshot`: the descriptor-based capture
of the stopped commands' upper, the builder's content, then :func:`~rollbox.images.snapshot.
layer_from_capture`).
"""
from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

from rollbox.errors import InfraError
from rollbox.images.snapshot import layer_from_capture
from rollbox.images.store import ImageStore

BUILD_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": "/root", "LANG": "C.UTF-8"}
STEP_TIMEOUT_S = 30 * 60


class BuildSandbox(Protocol):
    """One sandbox of an image build, over the base's layers."""

    async def write_file(self, path: str, data: bytes, mode: int) -> None: ...

    async def run_shell(self, cmd: str, env: dict[str, str], timeout_s: float,
                        on_output: Callable[[bytes], object] | None) -> tuple[int, bytes]:
        """(exit code, tail of the output)."""
        ...

    async def capture(self, dest: Path, *, keep_git_history: bool) -> None:
        """Its writable layer as the staging tree ``dest`` (a new directory): the snapshots'
        capture with the builder's content; with ``keep_git_history`` False, repositories of
        lower layers the commands changed are taken whole (``complete_repos``)."""
        ...


class BuildSandboxes(Protocol):
    def sandbox(self, layers: list[str], env: dict[str, str],
                network: str) -> AbstractAsyncContextManager[BuildSandbox]:
        """A sandbox over ``layers`` (lowest first), ``network`` "host" or "none"; gone when
        the context ends."""
        ...


async def build_layer_with_commands(store: ImageStore, base: str, commands: list[str],
                                    name: str, *, sandboxes: BuildSandboxes,
                                    network: str = "host", log: Callable[[str], None] = print,
                                    log_file: Path | None = None,
                                    keep_git_history: bool = False,
                                    image_env: dict[str, str] | None = None) -> str:
    """Run commands in a sandbox over ``base``; its scrubbed writable upper becomes a new
    layer and ``name`` is tagged as base + that layer (its config: base's, plus ``image_env``
    in its environment). Returns the new layer's digest."""
    image = store.resolve(base)
    env = dict(BUILD_ENV)
    env.update(image.config.get("env", {}))
    staging = store.staging_dir("commands")
    if log_file:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed below
    try:
        async with sandboxes.sandbox(list(image.layers), env, network) as box:
            if network == "host":
                await box.write_file("/etc/resolv.conf", Path("/etc/resolv.conf").read_bytes(),
                                     0o644)
            for cmd in commands:
                log(f"$ {cmd}")
                code, tail = await box.run_shell(cmd, env, STEP_TIMEOUT_S,
                                                 out.write if out else None)
                if code != 0:
                    raise InfraError(f"image build step failed ({code}): {cmd}\n"
                                     + tail.decode(errors="replace"))
            await box.write_file("/etc/resolv.conf", b"# rollbox: no network by default\n", 0o644)
            await box.capture(staging / "rootfs", keep_git_history=keep_git_history)
        digest, _repos = await asyncio.to_thread(
            layer_from_capture, store, staging / "rootfs", source=f"commands over {base}",
            scratch=staging, keep_git_history=keep_git_history)
    finally:
        if out:
            out.close()
        await asyncio.to_thread(shutil.rmtree, staging, True)
    config = dict(image.config)
    config["env"] = {**config.get("env", {}), **(image_env or {})}
    store.tag(name, list(image.layers) + [digest], config)
    return digest
