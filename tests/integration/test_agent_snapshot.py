"""The agent-side snapshot (rollbox.agent.snapshot): the upper as a tar stream made inside the
sandbox, parsed as hostile, opaque markers inferred from the merged view, repositories
completed from it, then built into a layer a fresh sandbox boots from.

On a container the upper's tar is made here by busybox on the host (standing in for the
guest's busybox, which makes the same stream on a microVM) and the merged view is read through
the agent; the tree a new sandbox of the snapshot sees must be the one the host-side capture
(images.snapshot.capture_upper) gives, which the same scripts check (tests/integration/
test_snapshot.py)."""
from __future__ import annotations

import io
import os
import tarfile
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from rollbox.agent.files import AgentFiles
from rollbox.agent.snapshot import capture_writable
from rollbox.agent.tools import PlatformTools
from rollbox.backends.base import CaptureOptions
from rollbox.images import git
from rollbox.images import snapshot as snap
from rollbox.models import SandboxSpec
from tests.conftest import new_name
from tests.integration.test_agent_files import image_busybox
from tests.integration.test_snapshot import AGENT_CHANGES, AGENT_MKDIRS, BB, EXPECTED, sh
from tests.integration.test_snapshot import workspace as workspace  # noqa: F401 - fixture

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]


def host_busybox_tar(upper: Path, shift: int) -> Callable[[int], AsyncIterator[bytes]]:
    """The upper's tar as busybox makes it (the guest's stand-in), with the container's
    shifted ids turned back into the sandbox's own, as a guest's tar has them."""
    async def stream(cap: int) -> AsyncIterator[bytes]:
        raw = subprocess.run(["busybox", "tar", "-c", "-f", "-", "-C", str(upper), "."],
                             check=True, capture_output=True).stdout
        out = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tin, \
                tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tout:
            for m in tin:
                s = os.lstat(upper / m.name)  # busybox cuts ids above 7 octal digits
                m.uid, m.gid = s.st_uid - shift, s.st_gid - shift
                tout.addfile(m, tin.extractfile(m) if m.isreg() else None)
        data = out.getvalue()
        assert len(data) <= cap
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]
    return stream


def opts(**kw: object) -> CaptureOptions:
    base: dict[str, object] = dict(pause=False, scrub=snap.DEFAULT_SCRUB, exclude=[],
                                   max_bytes=1 << 30, max_entries=100_000,
                                   complete_repos=True)
    base.update(kw)
    return CaptureOptions(**base)  # type: ignore[arg-type]


async def test_tar_snapshot_boots_the_same_tree(edge, workspace: str,  # noqa: ANN001, F811
                                                names: list[str], tmp_path: Path) -> None:
    src = await edge.create(SandboxSpec(image=BB, layers=[workspace]), "p")
    await sh(edge, src.id, AGENT_MKDIRS)
    await sh(edge, src.id, AGENT_CHANGES)
    live = edge._live(src.id)
    files = AgentFiles(PlatformTools(lambda: live.box.channel, request=image_busybox))
    staging = tmp_path / "staging"
    res = await capture_writable(files, host_busybox_tar(live.box.rootfs.upper, live.box.host_uid), staging,
                                 opts(exclude=["/work/secret", "*.log"]))
    stats = res.stats
    assert stats.whiteouts >= 1 and stats.scrubbed >= 6 and stats.opaque_dirs >= 1
    # /data was removed and made again: opaque, so the base's files stay hidden
    assert (staging / "data").is_dir()
    assert os.getxattr(staging / "data", "trusted.overlay.opaque") == b"y"
    assert not _opaque(staging)  # the root shows the base's files: not opaque
    # the host-side capture of the same upper marks the same directory
    ref = tmp_path / "ref"
    snap.capture_upper(live.box.rootfs.upper, ref, id_shift=live.box.host_uid,
                       scrub=snap.DEFAULT_SCRUB, exclude=["/work/secret", "*.log"])
    assert _opaque(ref / "data") and _tree(ref) == _tree(staging)
    repos = git.process_tree(staging, scratch=tmp_path, keep_history=False)
    digest = edge.store.add_layer_from_dir(staging, source=f"snapshot:{src.id}", git_repos=repos)
    name = new_name(names)
    edge.store.tag(name, list(src.layers) + [digest], edge.store.resolve(BB).config)
    copy = await edge.create(SandboxSpec(image=name), "p")
    await sh(edge, copy.id, EXPECTED)
    for sid in (src.id, copy.id):
        await edge.delete(sid)
    shutil.rmtree(ref)


def _opaque(p: Path) -> bool:
    try:
        return os.getxattr(p, "trusted.overlay.opaque") == b"y"
    except OSError:
        return False


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry's type, mode, size, content and link target (ids: the host's tar sees the
    container's shifted ids, which a guest's tar does not)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            s = p.lstat()
            body = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
            link = os.readlink(p) if p.is_symlink() else ""
            out[str(p.relative_to(root))] = (s.st_mode, s.st_size, body, link, s.st_rdev)
    return out
