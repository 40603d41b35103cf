"""Task images uploaded through the api (SDK -> api -> edge -> mkfs.erofs on the server), and
the layer storage limits of projects (uploads and snapshots): owner-only images, caps, quota,
the image store's reserve, and nothing half-created on any refusal."""
from __future__ import annotations

import asyncio
import io
import os
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.iam import KeyStore
from rollbox.models import SandboxSpec, SnapshotSpec
from rollbox.watcher import placement_over
from tests.conftest import BOTH_TRANSPORTS, api_app, new_name

BB = "busybox:test"


class Api:
    def __init__(self, edge, keys: KeyStore, url: str) -> None:  # noqa: ANN001
        self.edge = edge
        self.proj = rollbox.AsyncClient(url, keys.create("proj"))
        self.other = rollbox.AsyncClient(url, keys.create("other"))


@pytest.fixture
async def api(edge, api_edge, tmp_path: Path) -> AsyncIterator[Api]:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    app = api_app(api_edge, edge, keys)
    try:
        async with BackgroundServer(app) as srv:
            a = Api(edge, keys, srv.url)
            try:
                yield a
            finally:
                await a.proj.close()
                await a.other.close()
    finally:
        keys.close()


def staged(edge) -> list[str]:  # noqa: ANN001
    return sorted(p.name for p in edge.store.tmp_dir.iterdir()
                  if p.name.startswith(f"upload-{os.getpid()}-"))


def tree(root: Path, size: int = 1000) -> Path:
    (root / "work/pkg/__pycache__").mkdir(parents=True)
    (root / "work/pkg/m.py").write_text("X = 1\n")
    (root / "work/pkg/__pycache__/m.cpython-311.pyc").write_bytes(b"stale bytecode")
    (root / "work/data.bin").write_bytes(b"\1" * size)
    (root / "work/suid").write_text("#!/bin/sh\n")
    os.chmod(root / "work/suid", 0o4755)
    os.symlink("pkg/m.py", root / "work/link")
    return root


@BOTH_TRANSPORTS
async def test_upload_directory_and_tar_then_use(api: Api, names: list[str],
                                                 tmp_path: Path) -> None:
    edge = api.edge
    name = new_name(names, "up")
    seen: list[tuple[int, int | None]] = []
    info = await api.proj.images.upload(name, tree(tmp_path / "src"), base=BB,
                                        progress=lambda s, t: seen.append((s, t)))
    assert info.owner == "proj" and info.layer == info.layers[-1]
    assert info.layers[:-1] == edge.store.resolve(BB).layers
    assert seen and seen[-1][0] >= 1000 and seen[-1][1] is not None
    assert staged(edge) == []
    sb = await edge.create(SandboxSpec(image=name), "proj")
    try:
        out = await edge.exec_wait(sb.id, await edge.exec_start(sb.id, rollbox.models.ExecSpec(
            cmd="cat /work/pkg/m.py; ls -a /work/pkg; stat -c %a /work/suid; "
                "readlink /work/link; wc -c < /work/data.bin")))
        lines = out.stdout.split()
        assert lines[:3] == ["X", "=", "1"]
        assert "__pycache__" not in lines  # uploaded layers drop bytecode
        assert "755" in lines  # the setuid bit is stripped
        assert "pkg/m.py" in lines and lines[-1] == "1000"
    finally:
        await edge.delete(sb.id)

    # A gzipped tar file works the same; other projects neither see nor use the images.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"from a tar\n"
        ti = tarfile.TarInfo("hello.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    (tmp_path / "img.tar.gz").write_bytes(buf.getvalue())
    name2 = new_name(names, "uptar")
    info2 = await api.proj.images.upload(name2, tmp_path / "img.tar.gz")
    assert len(info2.layers) == 1
    mine = {i.name for i in await api.proj.images.list()}
    assert {name, name2, BB} <= mine
    assert not {name, name2} & {i.name for i in await api.other.images.list()}
    with pytest.raises(errors.NotFound):
        await api.other.create(name2)
    with pytest.raises(errors.NotFound):
        await api.other.images.delete(name2)
    with pytest.raises(errors.BadRequest):
        await api.proj.images.delete(BB)  # the node's own images are the operator's

    # Usage counts the project's own layers (not the base's); deleting frees the share.
    usage = await api.proj.images.usage()
    sizes = {d: int(edge.store.layer_meta(d)["size"]) for d in (info.layer, info2.layer)}
    assert usage.used_bytes == sum(sizes.values()) and usage.images == 2
    await api.proj.images.delete(name2)
    assert (await api.proj.images.usage()).used_bytes == sizes[info.layer]
    assert (await api.other.images.usage()).used_bytes == 0


async def test_cli_upload_with_progress(edge, names: list[str], tmp_path: Path) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from rollbox.image_cli import app as image_app

    keys = KeyStore(tmp_path / "keys.db")
    app = create_app(placement_over([edge]), keys)
    try:
        async with BackgroundServer(app) as srv:
            name = new_name(names, "cli")
            args = ["upload", name, str(tree(tmp_path / "src")), "--base", BB, "--url", srv.url,
                    "--api-key", keys.create("proj")]
            res = await asyncio.to_thread(CliRunner().invoke, image_app, args)
            assert res.exit_code == 0, res.output
            assert name in res.output and "upload" in res.output  # the progress bar's label
            assert edge.store.resolve(name).config["owner"] == "proj"
            res = await asyncio.to_thread(CliRunner().invoke, image_app, args)
            assert res.exit_code == 2 and "already exists" in res.output
    finally:
        keys.close()


async def test_bad_uploads_leave_nothing(api: Api, names: list[str], tmp_path: Path) -> None:
    edge = api.edge
    src = tree(tmp_path / "src", size=3 << 20)
    taken = new_name(names, "dup")
    await api.proj.images.upload(taken, src)
    own = f"proj/own-{os.getpid()}:1"  # under its project's name
    names.append(own)
    await api.proj.images.upload(own, src)
    layers = set(edge.store.list_layers())
    refs = {i.name for i in edge.store.list()}
    with pytest.raises(errors.BadRequest, match="needs a path"):
        await api.proj.images.upload("nopath:1", src)
    with pytest.raises(errors.BadRequest, match="already exists"):
        await api.proj.images.upload(taken, src)
    with pytest.raises(errors.NotFound):
        await api.proj.images.upload(new_name(names, "nobase"), src, base="no/such:1")
    (tmp_path / "junk.tar").write_bytes(os.urandom(4096))
    with pytest.raises(errors.BadRequest, match="malformed tar"):
        await api.proj.images.upload(new_name(names, "junk"), tmp_path / "junk.tar")
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as tf:
        ti = tarfile.TarInfo("../escape")
        tf.addfile(ti, io.BytesIO(b""))
    (tmp_path / "escape.tar").write_bytes(bad.getvalue())
    with pytest.raises(errors.BadRequest, match=r"'\.\.'"):
        await api.proj.images.upload(new_name(names, "esc"), tmp_path / "escape.tar")
    # Names under another project's name are that project's: not taken, not probed (an
    # image of it that exists gets the same answer as a free name).
    for name in (own, own.replace("/own-", "/free-")):
        with pytest.raises(errors.BadRequest, match="that project's"):
            await api.other.images.upload(name, src)
    # Errors name no host path (the store, the upload's staging dir).
    with pytest.raises(errors.NotFound) as gone:
        await api.proj.images.delete(new_name(names, "never"))
    broken = tmp_path / "broken"
    subprocess.run(["bash", "-ec", "git init -q r; echo a > r/a; git -C r add a; "
                    "git -C r -c user.email=a@b -c user.name=a commit -qm one"],
                   cwd=broken.mkdir() or broken, check=True, capture_output=True)
    obj = next(p for p in (broken / "r/.git/objects").glob("??/*"))
    obj.chmod(0o644)
    obj.write_bytes(b"")
    with pytest.raises(errors.BadRequest, match="git") as corrupt:
        await api.proj.images.upload(new_name(names, "corrupt"), broken)
    for exc in (gone.value, corrupt.value):
        assert str(edge.store.root) not in exc.message and "rootfs" not in exc.message
    # Above the node's upload cap.
    edge.settings.image_upload_max_bytes = 1 << 20
    try:
        with pytest.raises(errors.PayloadTooLarge):
            await api.proj.images.upload(new_name(names, "big"), src)
    finally:
        edge.settings.image_upload_max_bytes = 8 << 30
    # Above the project's layer storage.
    edge.settings.project_layer_mib = 2
    try:
        with pytest.raises(errors.QuotaExceeded):  # proj is over it already
            await api.proj.images.upload(new_name(names, "quota"), src)
        with pytest.raises(errors.QuotaExceeded):  # other is not: stopped mid-extraction
            await api.other.images.upload(new_name(names, "quota"), src)
    finally:
        edge.settings.project_layer_mib = 50 << 10
    # The image store below its reserve (retryable).
    edge.settings.image_store_reserve_bytes = 1 << 60
    try:
        with pytest.raises(errors.CapacityExceeded) as full:
            await api.proj.images.upload(new_name(names, "reserve"), src)
        assert full.value.retryable
    finally:
        edge.settings.image_store_reserve_bytes = None
    assert staged(edge) == []
    assert set(edge.store.list_layers()) == layers
    assert {i.name for i in edge.store.list()} == refs


async def test_concurrent_uploads_cannot_both_pass_the_quota(api: Api, names: list[str],
                                                             tmp_path: Path) -> None:
    edge = api.edge
    layers = set(edge.store.list_layers())
    a = tree(tmp_path / "a", size=2 << 20)
    b = tree(tmp_path / "b", size=(2 << 20) + 1)  # another digest
    edge.settings.project_layer_mib = 3
    try:
        results = await asyncio.gather(
            api.proj.images.upload(new_name(names, "ca"), a),
            api.proj.images.upload(new_name(names, "cb"), b), return_exceptions=True)
    finally:
        edge.settings.project_layer_mib = 50 << 10
    ok = [r for r in results if isinstance(r, rollbox.models.ImageInfo)]
    # Refused by the final check (QuotaExceeded), or up front while the other one holds the
    # project's room (retryable CapacityExceeded).
    refused = [r for r in results if isinstance(r, errors.QuotaExceeded)
               or isinstance(r, errors.CapacityExceeded) and "held_bytes" in r.details]
    assert len(ok) == 1 and len(refused) == 1, results
    assert set(edge.store.list_layers()) - layers == {ok[0].layer}  # the refused one is gone


async def test_snapshot_counts_against_layer_storage(edge, names: list[str]) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "proj")
    await edge.file_write(sb.id, "/work/blob", b"\7" * (3 << 20), 0o644)
    layers = set(edge.store.list_layers())
    edge.settings.project_layer_mib = 1
    try:
        with pytest.raises(errors.QuotaExceeded):
            await edge.snapshot(sb.id, SnapshotSpec(name=new_name(names)), "proj")
    finally:
        edge.settings.project_layer_mib = 50 << 10
    edge.settings.image_store_reserve_bytes = 1 << 60
    try:
        with pytest.raises(errors.CapacityExceeded):
            await edge.snapshot(sb.id, SnapshotSpec(name=new_name(names)), "proj")
    finally:
        edge.settings.image_store_reserve_bytes = None
    assert set(edge.store.list_layers()) == layers
    assert not [n for n in names if edge.store.exists(n)]
    res = await edge.snapshot(sb.id, SnapshotSpec(name=new_name(names)), "proj")
    assert edge.storage.usage("proj").used_bytes >= res.size
    await edge.delete(sb.id)


async def test_project_layer_quota_overrides_the_node_default(api: Api, names: list[str],
                                                              tmp_path: Path) -> None:
    from rollbox.iam.quotas import SQLiteQuotas
    from rollbox.models import Quota

    edge = api.edge
    quotas = SQLiteQuotas(tmp_path / "quotas.db")
    quotas.set("other", Quota(layer_mib=1))
    edge.quotas = quotas
    try:
        src = tree(tmp_path / "src", size=2 << 20)
        with pytest.raises(errors.QuotaExceeded) as over:
            await api.other.images.upload(new_name(names, "q"), src)
        assert over.value.details["limit_bytes"] == 1 << 20
        assert (await api.other.images.usage()).limit_bytes == 1 << 20
        await api.proj.images.upload(new_name(names, "q"), src)  # no quota: the node default
        assert (await api.proj.images.usage()).limit_bytes == edge.settings.project_layer_mib << 20
    finally:
        edge.quotas = None
        quotas.close()


async def test_upload_with_many_bytecode_dirs(api: Api, names: list[str],
                                              tmp_path: Path) -> None:
    """An upload's dropped bytecode is removed from its staging tree, not named to mkfs.erofs
    one path per argument: 800 __pycache__ dirs under a 3 KB path (2.4 MB of paths, above
    ARG_MAX) still make an image, without them."""
    deep = "/".join(["d" * 250] * 12)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(800):
            ti = tarfile.TarInfo(f"{deep}/p{i}/__pycache__/m.pyc")
            ti.size = 1
            tf.addfile(ti, io.BytesIO(b"x"))
        ti = tarfile.TarInfo(f"{deep}/keep.py")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"y"))
    (tmp_path / "many.tar").write_bytes(buf.getvalue())
    info = await api.proj.images.upload(new_name(names, "many"), tmp_path / "many.tar", base=BB)
    async with await api.proj.create(info.name) as sb:
        found = await sb.exec(["sh", "-c", f"cd /{deep} && find . -name '*.py*' | sort"])
    assert found.stdout.split() == ["./keep.py"]
    assert staged(api.edge) == []
