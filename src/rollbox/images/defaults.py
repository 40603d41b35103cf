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
# A sandbox is thrown away after its episode: Debian's PEP 668 marker (EXTERNALLY-MANAGED)
# would only make the README's `pip install -e .` fail, so pip may install as root into
# /usr/local (pip's own choice there) without a venv, quietly and without a version check.
PYTHON_ENV = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore",
              "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


async def build_layer_with_commands(store: ImageStore, base: str, commands: list[str],
                                    name: str, *, settings: Settings | None = None,
                                    network: str = "host", log: Callable[[str], None] = print,
                                    log_file: Path | None = None,
                                    keep_git_history: bool = False,
                                    image_env: dict[str, str] | None = None) -> str:
    """Run commands in a sandbox over ``base``; its scrubbed writable upper becomes a new
    layer and ``name`` is tagged as base + that layer (its config: base's, plus ``image_env``
    in its environment). Returns the new layer's digest."""
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.images.lazy.mounts import LayerMounts
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
            code, tail = await box.run_shell(cmd, env, 30 * 60,
                                             on_output=out.write if out else None)
            if code != 0:
                raise InfraError(f"image build step failed ({code}): {cmd}\n"
                                 + tail.decode(errors="replace"))
        box.fs.write("/etc/resolv.conf", b"# rollbox: no network by default\n", 0o644)
        digest = await asyncio.to_thread(
            layer_from_upper, store, box.rootfs.upper, source=f"commands over {base}",
            id_shift=box.host_uid, keep_git_history=keep_git_history, merged=box.rootfs.merged)
    finally:
        if out:
            out.close()
        await backend.destroy(box)
        backend.release_node_resources()
        slots.close()
    config = dict(image.config)
    config["env"] = {**config.get("env", {}), **(image_env or {})}
    store.tag(name, list(image.layers) + [digest], config)
    return digest


def ensure_python_image(store: ImageStore, log: Callable[[str], None] = print) -> None:
    try:
        image = store.resolve(PYTHON_IMAGE)
    except Exception:  # noqa: BLE001 - missing: build it
        log(f"building {PYTHON_IMAGE} over {BASE_IMAGE} (apt-get in a build sandbox)")
        asyncio.run(build_layer_with_commands(
            store, BASE_IMAGE, PYTHON_COMMANDS, PYTHON_IMAGE, log=log,
            log_file=store.root / "build-python.log", image_env=PYTHON_ENV))
    else:
        env = image.config.get("env", {})
        if any(env.get(k) != v for k, v in PYTHON_ENV.items()):
            # Built before PYTHON_ENV existed: same layers, updated config (no rebuild).
            log(f"updating {PYTHON_IMAGE}'s environment: {' '.join(PYTHON_ENV)}")
            store.tag(PYTHON_IMAGE, list(image.layers),
                      {**image.config, "env": {**env, **PYTHON_ENV}})
    ensure_fncall_image(store, log)


# The fncall backend's workers: python:3.11 + compilers and node (C, C++, Node.js calls).
FNCALL_IMAGE = "fncall:1"
FNCALL_COMMANDS = [
    "apt-get update -q",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
    "gcc g++ libc6-dev nodejs",
    "apt-get clean",
    "rm -rf /var/lib/apt/lists/*",
]


def ensure_fncall_image(store: ImageStore, log: Callable[[str], None] = print) -> None:
    try:
        store.resolve(FNCALL_IMAGE)
        return
    except Exception:  # noqa: BLE001 - missing: build it
        pass
    log(f"building {FNCALL_IMAGE} over {PYTHON_IMAGE} (gcc, g++, nodejs)")
    asyncio.run(build_layer_with_commands(
        store, PYTHON_IMAGE, FNCALL_COMMANDS, FNCALL_IMAGE, log=log,
        log_file=store.root / "build-fncall.log"))


# ---- benchmark image (default off: `rollbox image ensure-bench-images`, never `make test`) ----

BENCH_IMAGE = "python-big:3.11"
# Enough wheels to pass 1 GB of layers over python:3.11, like the data-science images trainers
# use; pinned so two nodes build the same tree.
BENCH_PIP_PACKAGES = ["numpy==2.2.6", "pandas==2.3.3", "scipy==1.16.3", "scikit-learn==1.7.2",
                      "sympy==1.14.0", "matplotlib==3.10.7", "pyarrow==22.0.0",
                      "polars==1.35.2", "opencv-python-headless==4.12.0.88",
                      "jax[cpu]==0.8.1"]
BENCH_MIN_BYTES = 1 << 30
# A small repository with a test suite: the benchmark's workload runs pytest and git in it.
BENCH_REPO_COMMANDS = [
    "mkdir -p /work/repo/pkg /work/repo/tests",
    "printf 'def add(a, b):\\n    return a + b\\n' > /work/repo/pkg/__init__.py",
    "printf 'import numpy, pkg\\n\\ndef test_add():\\n    assert pkg.add(1, 2) == 3\\n\\n"
    "def test_np():\\n    assert numpy.arange(4).sum() == 6\\n' > /work/repo/tests/test_pkg.py",
    "cd /work/repo && git init -q && git -c user.email=b@x -c user.name=bench add -A && "
    "git -c user.email=b@x -c user.name=bench commit -q -m init",
]


def pip_layer(store: ImageStore, packages: list[str], log: Callable[[str], None], *,
              no_deps: bool = False) -> str:
    """A layer holding ``packages`` under /usr/local/lib/python3.11/dist-packages (on Debian's
    sys.path), installed by the host's pip: the host has the same Python and glibc as the
    image, and its pip has the host's index and CA settings, which a build sandbox lacks.
    ``no_deps``: only the named packages (e.g. one whose data files alone are wanted)."""
    import shutil
    import subprocess
    import sys

    staging = store.staging_dir("pipdeps")
    try:
        target = staging / "usr/local/lib/python3.11/dist-packages"
        target.mkdir(parents=True)
        log(f"pip install --target (host): {' '.join(packages)}")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir",
                               "--ignore-installed", "--only-binary=:all:",
                               *(["--no-deps"] if no_deps else []), "--target",
                               str(target), *packages], capture_output=True, text=True)
        if proc.returncode != 0:
            raise InfraError(f"pip install for an image layer failed: {proc.stderr[-2000:]}")
        for dirpath, _dirs, _files in os.walk(staging):
            os.chmod(dirpath, 0o755)
        return store.add_layer_from_dir(staging, source="pip:" + ",".join(packages),
                                        progress=log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_bench_image(store: ImageStore, log: Callable[[str], None] = print) -> str:
    """Build ``python-big:3.11`` = python:3.11 + a pip layer (>= 1 GB in all) + a workspace
    layer with a small git repo (the second built in a sandbox: only that layer is new).
    Returns the image name. Needs PyPI; takes minutes."""
    if store.exists(BENCH_IMAGE):
        return BENCH_IMAGE
    ensure_python_image(store, log)
    pip_image = "python-big-deps:3.11"
    if not store.exists(pip_image):
        base = store.resolve(PYTHON_IMAGE)
        digest = pip_layer(store, BENCH_PIP_PACKAGES, log)
        store.tag(pip_image, list(base.layers) + [digest], base.config)
    size = sum(int(store.layer_meta(d)["size"]) for d in store.resolve(pip_image).layers)
    if size < BENCH_MIN_BYTES:
        raise InfraError(f"{pip_image} is {size / 2**20:.0f} MiB, expected >= 1 GiB: add "
                         "packages to BENCH_PIP_PACKAGES")
    log(f"building {BENCH_IMAGE}: workspace layer with a small repo")
    asyncio.run(build_layer_with_commands(
        store, pip_image, BENCH_REPO_COMMANDS, BENCH_IMAGE, network="none", log=log,
        log_file=store.root / "logs" / "build-bench.log"))
    return BENCH_IMAGE
