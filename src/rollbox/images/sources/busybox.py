"""Image source: ``busybox:test``, a tiny static image for fast tests."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from rollbox.errors import InfraError
from rollbox.images.store import Image, ImageStore


BUSYBOX_RECIPE = "busybox-every-applet-1"


def build_busybox_image(store: ImageStore, name: str = "busybox:test", *,
                        busybox: Path = Path("/bin/busybox")) -> Image:
    """A tiny static image for fast tests: /bin/busybox plus a /bin symlink for every applet
    (as the busybox image has; command strings run under the platform's bash, which finds
    only the applets that are linked)."""
    if not busybox.is_file():
        raise InfraError(f"{busybox} not found: install busybox-static (make deps)")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    staging = store.staging_dir("busybox")
    try:
        root = staging / "rootfs"
        for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root"):
            (root / d).mkdir(parents=True)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root / "root", 0o700)
        shutil.copy2(busybox, root / "bin" / "busybox")
        os.chmod(root / "bin" / "busybox", 0o755)
        for applet in applets:
            if applet != "busybox" and "/" not in applet:
                os.symlink("busybox", root / "bin" / applet)
        (root / "etc" / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        # Fixed owner and times: rebuilding from the same busybox gives the same digest.
        mtime = int(busybox.stat().st_mtime)
        for p in sorted(root.rglob("*"), reverse=True) + [root]:
            os.chown(p, 0, 0, follow_symlinks=False)
            os.utime(p, (mtime, mtime), follow_symlinks=False)
        config = {"env": {"PATH": "/bin", "HOME": "/root"}, "cwd": "/", "user": "root",
                  "recipe": BUSYBOX_RECIPE}
        digest = store.add_layer_from_dir(root, source=f"busybox:{busybox}")
        return store.tag(name, [digest], config)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def busybox_image_current(store: ImageStore, name: str = "busybox:test") -> bool:
    """Whether ``name`` exists and was built by this recipe (an older one linked 20 applets,
    which a command string, run by the platform's bash, does not find beyond)."""
    try:
        return store.resolve(name).config.get("recipe") == BUSYBOX_RECIPE
    except Exception:  # noqa: BLE001 - missing or unreadable: (re)build it
        return False
