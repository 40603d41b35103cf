"""Streamed single files through the real stack (SDK -> api -> edge -> runc sandbox): every
form of content the SDK takes, streamed reads, the disk cap on host-side writes (typed
disk-full error, no temp file left), a grade whose declared files overflow the grader's disk,
and the server's RSS staying bounded while large files stream through a real server process."""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.embedded import _free_port, wait_healthy
from rollbox.iam import KeyStore
from rollbox.placement import Placement
from tests.conftest import node_settings

BB = "busybox:test"


@pytest.fixture
async def client(edge, tmp_path: Path) -> AsyncIterator[rollbox.AsyncClient]:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    app = create_app(Placement([edge]), edge.event_log, keys)
    try:
        async with BackgroundServer(app) as srv, \
                rollbox.AsyncClient(srv.url, keys.create("proj")) as c:
            yield c
    finally:
        keys.close()


async def test_sdk_write_forms_read_stream_and_download(client: rollbox.AsyncClient,
                                                        tmp_path: Path) -> None:
    async with await client.create(BB) as sb:
        blob = os.urandom(3 << 20)
        await sb.files.write("/tmp/bytes", blob)
        await sb.files.write("/tmp/str", "text")

        async def agen() -> AsyncIterator[bytes]:
            for i in range(0, len(blob), 100_000):
                yield blob[i:i + 100_000]

        await sb.files.write("/tmp/agen", agen())
        await sb.files.write("/tmp/iter", iter([b"a", b"b", b"c"]))
        local = tmp_path / "local.bin"
        local.write_bytes(blob)
        with open(local, "rb") as f:
            await sb.files.write("/tmp/fileobj", f, mode=0o600)
        await sb.files.write("/tmp/bytesio", io.BytesIO(b"from memory"))
        await sb.files.write("/tmp/empty", b"")

        assert await sb.files.read("/tmp/bytes") == blob
        assert await sb.files.read_text("/tmp/str") == "text"
        assert await sb.files.read("/tmp/iter") == b"abc"
        assert await sb.files.read("/tmp/bytesio") == b"from memory"
        assert await sb.files.read("/tmp/empty") == b""
        assert (await sb.files.stat("/tmp/fileobj")).mode == 0o600
        parts = [c async for c in sb.files.read_stream("/tmp/agen")]
        assert len(parts) > 1 and b"".join(parts) == blob
        down = tmp_path / "down"
        down.mkdir()
        assert await sb.files.download_file("/tmp/fileobj", down / "f.bin") == len(blob)
        assert (down / "f.bin").read_bytes() == blob
        with pytest.raises(errors.NotFound):
            await sb.files.download_file("/tmp/missing", down / "never")
        assert [p.name for p in down.iterdir()] == ["f.bin"]  # no partial file either
        with pytest.raises(errors.NotFound):
            async for _ in sb.files.read_stream("/tmp/missing"):
                pass
        with pytest.raises(errors.BadRequest):
            await sb.files.write("/tmp/text-file", open(local, "r"))  # noqa: SIM115


async def test_host_write_above_disk_cap_is_typed_and_clean(client: rollbox.AsyncClient,
                                                            tmp_path: Path) -> None:
    async with await client.create(BB, disk_mib=16) as sb:
        await sb.files.write("/tmp/keep", "kept")
        with pytest.raises(errors.BadRequest) as full:
            await sb.files.write("/tmp/keep", b"\0" * (24 << 20))
        assert full.value.details.get("reason") == "disk_full"
        # The old file is intact, no temp file is left, and the space came back.
        assert await sb.files.read("/tmp/keep") == b"kept"
        assert (await sb.exec("ls -a /tmp")).stdout.split() == [".", "..", "keep"]
        await sb.files.write("/tmp/fits", b"\0" * (8 << 20))
        # A tar upload past the cap gets the same typed error.
        with pytest.raises(errors.BadRequest) as tar_full:
            await sb.files.upload_dir(_big_dir(tmp_path / "big"), "/up")
        assert tar_full.value.details.get("reason") == "disk_full"
        assert ".rollbox-tmp" not in (await sb.exec("ls -aR /up")).stdout


def _big_dir(d: Path) -> Path:
    d.mkdir()
    (d / "a.bin").write_bytes(b"\1" * (6 << 20))
    (d / "b.bin").write_bytes(b"\2" * (6 << 20))
    return d


async def test_grade_files_above_grader_disk_cap_fail_typed(edge) -> None:  # noqa: ANN001
    from rollbox.backends.container.files import DiskFull
    from rollbox.models import GradeSpec, Resources, SandboxSpec

    info = await edge.create(SandboxSpec(image=BB, resources=Resources(disk_mib=64)), "proj")
    await edge.file_write(info.id, "/work/out.bin", b"\0" * (20 << 20), 0o644)
    before = set(edge.live)
    with pytest.raises(DiskFull) as ei:
        await edge.grade(info.id, GradeSpec(cmd="true", files=["/work/out.bin"],
                                            resources=Resources(disk_mib=8)), "proj")
    assert ei.value.details["disk_mib"] == 8
    assert set(edge.live) == before  # the grader is gone
    graders = [i for i in await edge.list(None, {"rollbox.grader-of": info.id})
               if i.state in ("running", "creating")]
    assert graders == []
    await edge.delete(info.id)


# ---- a real server process: RSS stays bounded while big files stream ----

_SERVE = """
import json, sys
from pathlib import Path
import uvloop
from rollbox.config import Settings
from rollbox.embedded import EmbeddedNode
cfg = json.loads(sys.argv[1])
s = Settings.scratch(Path(cfg["root"]))
s.cgroup_parent, s.node_id = cfg["cgroup"], cfg["node"]
s.uid_base, s.uid_slots = cfg["uid_base"], cfg["uid_slots"]
uvloop.run(EmbeddedNode(s).serve("127.0.0.1", cfg["port"]))
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tmp_node_dir: Path) -> Iterator[tuple[str, str, int]]:
    s = node_settings(tmp_node_dir)
    port = _free_port()
    cfg = {"root": str(tmp_node_dir), "cgroup": s.cgroup_parent, "node": s.node_id,
           "uid_base": s.uid_base, "uid_slots": s.uid_slots, "port": port}
    log = tmp_node_dir / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE, json.dumps(cfg)],
                                stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, (s.data_dir / "admin.key").read_text().strip(), proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_server_rss_bounded_by_concurrent_big_files(
        server: tuple[str, str, int]) -> None:
    url, key, pid = server
    n, size = 4, 200 << 20
    async with rollbox.AsyncClient(url, key) as c:
        boxes = await asyncio.gather(*(c.create(BB, disk_mib=256) for _ in range(n)))
        try:
            base = rss_mib(pid)
            peak = base
            done = asyncio.Event()

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_mib(pid))
                    await asyncio.sleep(0.05)

            async def zeros() -> AsyncIterator[bytes]:
                chunk = bytes(1 << 20)
                for _ in range(size >> 20):
                    yield chunk

            async def roundtrip(sb: rollbox.AsyncSandbox) -> None:
                await sb.files.write("/tmp/big", zeros())
                got = 0
                async for part in sb.files.read_stream("/tmp/big"):
                    got += len(part)
                assert got == size

            sampler = asyncio.create_task(sample())
            await asyncio.gather(*(roundtrip(sb) for sb in boxes))
            done.set()
            await sampler
            print(f"server RSS {base:.0f} MiB -> peak {peak:.0f} MiB")
            assert peak - base < 100, f"server RSS grew {peak - base:.0f} MiB (base {base:.0f})"
        finally:
            await asyncio.gather(*(sb.delete() for sb in boxes), return_exceptions=True)
