"""The node's default images beyond ``debian:bookworm`` and ``busybox:test``
(``rollbox.images.sources``): ``python:3.11``, ``fncall:1`` and the benchmark's
``python-big:3.11``, each a base + layers built by running commands in a container build
sandbox (``rollbox.backends.container.build``) and capturing its writable layer the way a
snapshot (``pack_diff``) does, or by the host's pip.

Above the backends (it runs one): the CLI's ``ensure-defaults`` hook, the browser image and the
benchmarks use it. Owns these recipes; not how a layer is built from commands
(``images.sources.commands``).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from rollbox.backends.container.build import build_layer_with_commands
from rollbox.errors import InfraError
from rollbox.images.store import SUDO_LABEL, ImageStore

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
    ensure_e2b_base_image(store, log)


# E2B's `base` template as E2B's SDK and its tests expect it (rollbox.compat.e2b maps the
# template name `base` here): python:3.11 + curl, a user `user` (uid 1000, home /home/user,
# bash) who may sudo without a password. Sudo is rollbox's agent-mediated one (no setuid: every
# sandbox process has no_new_privs): a layer with the client (images/sudo_client.py) as
# /usr/bin/sudo, and the image label rollbox.sudo=1000 that makes the agent serve its socket
# (docs/security.md). Root images stay as they are. Version 2 replaced Debian's sudo; 3: its
# client without the re, socket and signal imports (a quicker start).
E2B_BASE_IMAGE = "e2b-base:3"
E2B_SUDO_UIDS = "1000"
E2B_BASE_COMMANDS = [
    "apt-get update -q",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
    "curl procps",
    "useradd --create-home --uid 1000 --shell /bin/bash user",
    "apt-get clean",
    "rm -rf /var/lib/apt/lists/*",
]


def ensure_e2b_base_image(store: ImageStore, log: Callable[[str], None] = print) -> None:
    if store.exists(E2B_BASE_IMAGE):
        return
    stage = E2B_BASE_IMAGE.replace(":", "-stage:")  # python:3.11 + the commands' layer
    _ensure_over_python(store, stage, E2B_BASE_COMMANDS, "curl, user `user`",
                        "build-e2b-base.log", log)
    built = store.resolve(stage)
    digest = sudo_layer(store, log)
    labels = {**built.config.get("labels", {}), SUDO_LABEL: E2B_SUDO_UIDS}
    store.tag(E2B_BASE_IMAGE, [*built.layers, digest], {**built.config, "labels": labels})
    store.remove(stage)


def sudo_layer(store: ImageStore, log: Callable[[str], None] = print) -> str:
    """A layer holding rollbox's sudo client as /usr/bin/sudo (root-owned, 0755): put it in an
    image and label the image ``rollbox.sudo`` with the uids allowed."""
    import shutil
    from importlib import resources

    staging = store.staging_dir("sudo")
    try:
        target = staging / "usr/bin/sudo"
        target.parent.mkdir(parents=True)
        target.write_bytes(resources.files("rollbox.images").joinpath(
            "sudo_client.py").read_bytes())
        for path in (staging, staging / "usr", staging / "usr/bin", target):
            os.chmod(path, 0o755)
        return store.add_layer_from_dir(staging, source="rollbox:sudo-client", progress=log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _ensure_over_python(store: ImageStore, name: str, commands: list[str], what: str,
                        log_name: str, log: Callable[[str], None]) -> None:
    """Build ``name`` = python:3.11 + a layer of ``commands`` unless it is there already."""
    try:
        store.resolve(name)
        return
    except Exception:  # noqa: BLE001 - missing: build it
        pass
    log(f"building {name} over {PYTHON_IMAGE} ({what})")
    asyncio.run(build_layer_with_commands(store, PYTHON_IMAGE, commands, name, log=log,
                                          log_file=store.root / log_name))


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
    _ensure_over_python(store, FNCALL_IMAGE, FNCALL_COMMANDS, "gcc, g++, nodejs",
                        "build-fncall.log", log)


# ---- optional: fncall's other languages (`rollbox image ensure-polyglot`, never `make test`) ----

# fncall:1 + Debian's Go, Java (JDK), Rust and TypeScript (tsc) toolchains, lodash for Node.js,
# and less (SWE-ReX's pager test): ~1 GB, built only by the upstream tier or by hand. fncall's
# go/java/rust/typescript calls run on it.
POLYGLOT_IMAGE = "fncall-polyglot:1"  # rollbox.fncall.pool.POLYGLOT_IMAGE
POLYGLOT_PACKAGES = ["golang-go", "default-jdk-headless", "rustc", "node-typescript",
                     "node-lodash", "less"]
POLYGLOT_COMMANDS = [
    "apt-get update -q",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
    + " ".join(POLYGLOT_PACKAGES),
    "apt-get clean",
    "rm -rf /var/lib/apt/lists/*",
]


def ensure_polyglot_image(store: ImageStore, log: Callable[[str], None] = print) -> str:
    """Build ``fncall-polyglot:1`` over ``fncall:1`` if missing (minutes; needs Debian's
    mirrors). Returns the image name."""
    try:
        store.resolve(POLYGLOT_IMAGE)
        return POLYGLOT_IMAGE
    except Exception:  # noqa: BLE001 - missing: build it
        pass
    ensure_python_image(store, log)
    log(f"building {POLYGLOT_IMAGE} over {FNCALL_IMAGE} ({', '.join(POLYGLOT_PACKAGES)})")
    asyncio.run(build_layer_with_commands(
        store, FNCALL_IMAGE, POLYGLOT_COMMANDS, POLYGLOT_IMAGE, log=log,
        log_file=store.root / "build-polyglot.log"))
    return POLYGLOT_IMAGE


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


# ---- the `vm` backend's desktop (default off: `rollbox image ensure-desktop`, never `make test`) --

def ensure_desktop_image(log: Callable[[str], None] = print, *, force: bool = False) -> str:
    """Build the ``desktop:1`` VM disk (Debian bookworm, Xorg, JWM, xterm, mousepad, gnumeric;
    a raw ext4 disk <= 1.5 GiB in ``<data_dir>/vm-disks``) if missing; minutes, needs Debian's
    mirrors and root. Returns the image name."""
    from rollbox.images.sources.desktop import DESKTOP_IMAGE, build_desktop_disk

    disk = build_desktop_disk(name=DESKTOP_IMAGE, progress=log, force=force)
    return disk.name
