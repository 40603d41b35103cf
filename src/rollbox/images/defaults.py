"""The default images: ``debian:bookworm`` (debootstrap) and ``python:3.11`` (base + a layer
built by running commands in a sandbox and capturing its writable upper — the same mechanism
that later becomes ``pack_diff``)."""
from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import InfraError
from rollbox.images.build import layer_from_upper
from rollbox.images.store import ImageStore
from rollbox.models import Resources

PYTHON_IMAGE = "python:3.11"
BASE_IMAGE = "debian:bookworm"
PYTHON_PACKAGES = ["python3", "python3-pip", "python3-venv", "python3-pytest", "git",
                   "ca-certificates"]
PYTHON_COMMANDS = [
    "apt-get update -q",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
    + " ".join(PYTHON_PACKAGES),
    "ln -sf /usr/bin/python3 /usr/local/bin/python",
    "apt-get clean",
]


async def build_layer_with_commands(store: ImageStore, base: str, commands: list[str],
                                    name: str, *, settings: Settings | None = None,
                                    network: str = "host", log: Callable[[str], None] = print,
                                    log_file: Path | None = None) -> str:
    """Run commands in a sandbox over ``base``; its scrubbed writable upper becomes a new
    layer and ``name`` is tagged as base + that layer. Returns the new layer's digest."""
    from rollbox.backends.container.protocol import ExecRequest
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.images.mounts import LayerMounts
    from rollbox.isolation.userns import UidSlots

    settings = settings or Settings()
    image = store.resolve(base)
    # Build sandboxes use uid ranges above the edge's, so a running edge never shares one.
    slots = UidSlots(settings.uid_base + settings.uid_slots * 65536, 16)
    backend = ContainerBackend(settings, LayerMounts(store), slots)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8"}
    env.update(image.config.get("env", {}))
    box = await backend.create(f"build-{secrets.token_hex(5)}", list(image.layers),
                               Resources(cpus=2, memory_mib=4096, pids=4096, disk_mib=8192,
                                         inodes=1_000_000), env, network=network)
    if log_file:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else None
    try:
        if network == "host":
            box.fs.write("/etc/resolv.conf", Path("/etc/resolv.conf").read_bytes(), 0o644)
        for cmd in commands:
            log(f"$ {cmd}")
            cg_name, cg_fd = box.new_session_cgroup()
            try:
                session = await box.channel.exec(ExecRequest(
                    argv=["/bin/sh", "-c", cmd], env=[f"{k}={v}" for k, v in env.items()],
                    timeout_ms=30 * 60 * 1000), cg_fd)
            finally:
                os.close(cg_fd)
            tail = b""
            async for kind, payload in session.events():
                if kind in ("stdout", "stderr"):
                    tail = (tail + payload)[-4000:]
                    if out:
                        out.write(payload)
                elif kind == "exited":
                    if payload.exit_code != 0:
                        raise InfraError(f"image build step failed ({payload.exit_code}): {cmd}\n"
                                         + tail.decode(errors="replace"))
            box.drop_session_cgroup(cg_name)
        box.fs.write("/etc/resolv.conf", b"# rollbox: no network by default\n", 0o644)
        digest = await asyncio.to_thread(
            layer_from_upper, store, box.rootfs.upper, source=f"commands over {base}",
            id_shift=box.host_uid)
    finally:
        if out:
            out.close()
        await backend.destroy(box)
        backend.release_node_resources()
        slots.close()
    config = dict(image.config)
    store.tag(name, list(image.layers) + [digest], config)
    return digest


def ensure_python_image(store: ImageStore, log: Callable[[str], None] = print) -> None:
    try:
        store.resolve(PYTHON_IMAGE)
        return
    except Exception:  # noqa: BLE001 - missing: build it
        pass
    log(f"building {PYTHON_IMAGE} over {BASE_IMAGE} (apt-get in a build sandbox)")
    asyncio.run(build_layer_with_commands(
        store, BASE_IMAGE, PYTHON_COMMANDS, PYTHON_IMAGE, log=log,
        log_file=store.root / "build-python.log"))
