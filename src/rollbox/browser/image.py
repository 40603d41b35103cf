"""``browser:1``: python:3.11 + Debian's chromium and chromium-driver (an apt layer built in a
build sandbox) + the MiniWoB++ tasks (PyPI ``miniwob``, its HTML only: ``--no-deps``, none of
its Python runtime is used) + a tools layer holding :mod:`rollbox.browser.driver`.

Built only on request (``rollbox image ensure-browser``, the ``browser`` test tier, ``rollbox
demo --task browser``), never by ``make images``: it is ~600 MiB and takes minutes.
"""
from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from rollbox.backends.container.build import build_layer_with_commands
from rollbox.default_images import PYTHON_IMAGE, ensure_python_image
from rollbox.images.store import ImageStore

BROWSER_IMAGE = "browser:1"
# python:3.11 + the apt layer; its own name so a new tools layer never re-runs apt.
BROWSER_DEPS_IMAGE = "browser-deps:1"
# fonts-dejavu-core: chromium renders text with it (no recommends, so no font otherwise).
BROWSER_PACKAGES = ["chromium", "chromium-driver", "fonts-dejavu-core"]
BROWSER_COMMANDS = [
    "apt-get update -q",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
    + " ".join(BROWSER_PACKAGES),
    "apt-get clean",
    "rm -rf /var/lib/apt/lists/*",
]
MINIWOB_PACKAGE = "miniwob==1.1.0"
# Where the image has the driver and the tasks (the driver's defaults say the same).
DRIVER_PATH = "/opt/rollbox-browser/driver.py"
MINIWOB_HTML = "/usr/local/lib/python3.11/dist-packages/miniwob/html"
# Files of the tools layer get this mtime, so the same driver source is the same layer digest.
_TOOLS_MTIME = 1_700_000_000


def _tools_layer(store: ImageStore, log: Callable[[str], None]) -> str:
    """A layer holding the driver at DRIVER_PATH (root-owned, world-readable)."""
    src = Path(__file__).with_name("driver.py")
    staging = store.staging_dir("browser-tools")
    try:
        dest = staging / DRIVER_PATH.lstrip("/")
        dest.parent.mkdir(parents=True)
        shutil.copyfile(src, dest)
        for dirpath, _dirs, files in os.walk(staging, topdown=False):
            for path in [*(Path(dirpath) / f for f in files), Path(dirpath)]:
                path.chmod(0o755)
                os.utime(path, (_TOOLS_MTIME, _TOOLS_MTIME))
        return store.add_layer_from_dir(staging, source="rollbox.browser.driver", progress=log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_browser_image(store: ImageStore, log: Callable[[str], None] = print) -> str:
    """Build ``browser:1`` if missing, and re-tag it when the driver changed (only the tools
    layer is rebuilt then). Needs the Debian mirror and PyPI; the first build takes minutes.
    Returns the image name."""
    from rollbox.default_images import pip_layer

    ensure_python_image(store, log)
    if not store.exists(BROWSER_DEPS_IMAGE):
        log(f"building {BROWSER_DEPS_IMAGE} over {PYTHON_IMAGE}: {' '.join(BROWSER_PACKAGES)}")
        asyncio.run(build_layer_with_commands(
            store, PYTHON_IMAGE, BROWSER_COMMANDS, BROWSER_DEPS_IMAGE, log=log,
            log_file=store.root / "logs" / "build-browser.log"))
    deps = store.resolve(BROWSER_DEPS_IMAGE)
    current = store.resolve(BROWSER_IMAGE) if store.exists(BROWSER_IMAGE) else None
    if (current is not None and len(current.layers) == len(deps.layers) + 2
            and current.layers[:len(deps.layers)] == deps.layers):
        miniwob = current.layers[len(deps.layers)]
    else:
        miniwob = pip_layer(store, [MINIWOB_PACKAGE], log, no_deps=True)
    tools = _tools_layer(store, log)
    layers = [*deps.layers, miniwob, tools]
    if current is None or current.layers != layers:
        log(f"tagging {BROWSER_IMAGE}")
        store.tag(BROWSER_IMAGE, layers, deps.config)
    return BROWSER_IMAGE
