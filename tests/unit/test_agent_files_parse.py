"""Parsing what a sandbox's platform tools send back (rollbox.agent.files): stat records and
tar streams are hostile (a guest's root may have replaced the agent or busybox), so garbage,
forged records and crafted tar members give typed errors or are dropped, never a wrong path."""
from __future__ import annotations

import asyncio
import io
import struct
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.agent.files import _filestat, _records, _TarRewrite, _transformed, parse_xattrs
from tests.unit.test_snapshot_tar import gnu_sparse_tar


def test_stat_records_match_names_and_reject_garbage() -> None:
    n = "rbxabc"
    out = (f"{n} 81a4 5 0 0 100 /a\n{n} a1ff 3 7 8 9 '/l' -> '/x\nrbx0 y'\n").encode()
    recs = _records(out, n, 2)
    assert len(recs) == 2
    a = _filestat("/a", *recs[0])
    assert a is not None and (a.type, a.size, a.mode, a.mtime) == ("file", 5, 0o644, 100.0)
    link = _filestat("/l", *recs[1])
    assert link is not None and link.link_target == "/x\nrbx0 y"  # a newline in a target
    assert _filestat("/b", *recs[0]) is None  # a record about another name
    for bad in (b"garbage\n", f"{n} 81a4 5\n".encode(), f"{n} zz 1 2 3 4 /a\n".encode(),
                f"{n} 81a4 -5 0 0 1 /a\n".encode(), f"{n} 81a4 5 0 0 1 /a".encode()):
        with pytest.raises(errors.InfraError):
            recs = _records(bad, n, 1)
            _filestat("/a", *recs[0])
    with pytest.raises(errors.InfraError):  # more records than names asked for
        _records(f"{n} 81a4 5 0 0 1 /a\n{n} 81a4 5 0 0 1 /a\n".encode(), n, 1)
    big = _filestat("/u", ["81a4", "1", "70000", "4294967295", "0"], "/u")
    assert big is not None and (big.uid, big.gid) == (65534, 65534)  # out of range ids


def xg(idx: int, name: bytes, value: bytes, nl: int | None = None,
       vl: int | None = None) -> bytes:
    """One ``rollbox-xattr get`` record (lengths forged when given)."""
    return (struct.pack("<2sIHH", b"XG", idx, len(name) if nl is None else nl,
                        len(value) if vl is None else vl) + name + value)


def test_xattr_records_match_paths_and_hold_the_caps() -> None:
    out = xg(0, b"user.e2b.a", b"1") + xg(2, b"user.x", b"caf\xc3\xa9") + xg(0, b"user.b", b"")
    assert parse_xattrs(out, 3) == [{"user.e2b.a": "1", "user.b": ""}, None,
                                    {"user.x": "caf\u00e9"}]
    assert parse_xattrs(b"", 2) == [None, None]
    assert parse_xattrs(xg(0, b"user.v", b"\xff"), 1) == [{"user.v": "\ufffd"}]  # as hostfs
    many = b"".join(xg(0, f"user.n{i}".encode(), b"v") for i in range(64))
    assert len(parse_xattrs(many, 1)[0] or {}) == 64
    for bad in (
            b"XG\0",  # cut header
            xg(0, b"user.a", b"1")[:-1],  # cut value
            xg(0, b"user.a", b"1", vl=60000),  # longer than what follows
            xg(1, b"user.a", b"1"),  # a path not asked for
            xg(0, b"trusted.a", b"1"), xg(0, b"user.", b"1"),  # not user.*
            xg(0, b"user.overlay.opaque", b"y"),  # the overlay's own
            xg(0, b"user.a\0b", b"1"),
            xg(0, b"user." + b"a" * 251, b"1"),  # name above 255 bytes
            xg(0, b"user.a", b"v" * 4097),  # value above 4096
            xg(0, b"", b"1"),
            xg(0, b"user.a", b"1") + xg(0, b"user.a", b"2"),  # a repeat
            many + xg(0, b"user.more", b"v"),  # the 65th
            b"XA" + xg(0, b"user.a", b"1")[2:]):  # another tool's tag
        with pytest.raises(errors.InfraError):
            parse_xattrs(bad, 1)


def tar_of(members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.GNU_FORMAT
           ) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def ti(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644
       ) -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.linkname, t.mode = kind, link, mode
    return t


async def rewrite(data: bytes, **kw: object) -> tuple[dict[str, tarfile.TarInfo], _TarRewrite]:
    kw.setdefault("links", True)
    kw.setdefault("upload", False)
    rw = _TarRewrite(kw.pop("max_bytes", 1 << 20), kw.pop("max_entries", 100),  # type: ignore[arg-type]
                     **kw)  # type: ignore[arg-type]

    async def src() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    out = b"".join([c async for c in _transformed(src(), rw.rewrite)])
    with tarfile.open(fileobj=io.BytesIO(out)) as tf:
        return {m.name: m for m in tf}, rw


async def test_tar_from_the_sandbox_is_rebuilt_clean() -> None:
    data = tar_of([
        (ti("./", tarfile.DIRTYPE), None), (ti("./a", mode=0o4755), b"hello"),
        (ti("./dev", tarfile.CHRTYPE), None), (ti("./wh", tarfile.BLKTYPE), None),
        (ti("./fifo", tarfile.FIFOTYPE), None), (ti("./hl", tarfile.LNKTYPE, "./a"), None),
        (ti("./hl2", tarfile.LNKTYPE, "./missing"), None),
        (ti("./sl", tarfile.SYMTYPE, "/etc/shadow"), None),
        (ti("./cont", tarfile.CONTTYPE), b"x"),
    ])
    got, rw = await rewrite(data)
    assert set(got) == {"a", "hl", "sl", "cont"}  # specials, the top dir and a dangling hard link gone
    assert got["a"].mode == 0o4755 and got["a"].uname == ""  # a download keeps modes
    assert got["hl"].linkname == "a" and got["sl"].linkname == "/etc/shadow"
    assert rw.bytes == 6
    up, _ = await rewrite(tar_of([(ti("a", mode=0o6755), b"x")]), upload=True)
    assert up["a"].mode == 0o755  # an upload never carries setuid/setgid


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "//x"])
async def test_tar_from_the_sandbox_bad_names(name: str) -> None:
    with pytest.raises(errors.InfraError, match="bad tar"):
        await rewrite(tar_of([(ti(name), b"x")], tarfile.PAX_FORMAT))
    with pytest.raises(errors.BadRequest):  # the same from a client: its bad request
        await rewrite(tar_of([(ti(name), b"x")], tarfile.PAX_FORMAT), upload=True)


async def test_tar_from_the_sandbox_caps(tmp_path: Path) -> None:
    with pytest.raises(errors.PayloadTooLarge):
        await rewrite(tar_of([(ti("a"), b"x" * 600), (ti("b"), b"y" * 600)]), max_bytes=1000)
    with pytest.raises(errors.PayloadTooLarge):
        await rewrite(tar_of([(ti(f"f{i}"), b"") for i in range(5)]), max_entries=4)
    # a header claiming a huge member is refused before any of it is read
    huge = ti("big")
    huge.size = 1 << 40
    hdr = huge.tobuf(tarfile.GNU_FORMAT)
    with pytest.raises(errors.PayloadTooLarge):
        await rewrite(hdr + b"\0" * 4096)
    for fmt in ("gnu", "pax"):  # a few bytes naming a 1 GiB file: refused, not expanded
        with pytest.raises(errors.InfraError, match="sparse"):
            await rewrite(gnu_sparse_tar(tmp_path, fmt), max_bytes=2 << 30)
    with pytest.raises(errors.InfraError, match="malformed|bad tar"):
        await rewrite(b"\xff" * 2048)
    with pytest.raises(errors.InfraError, match="unexpected member"):
        await rewrite(tar_of([(ti("x"), b"1"), (ti("y"), b"2")]), single="x")
    longpax = ti("p")
    longpax.pax_headers = {"comment": "c" * (2 << 20)}
    with pytest.raises(errors.BadRequest, match="pax header too large"):
        await rewrite(tar_of([(longpax, b"1")], tarfile.PAX_FORMAT))


async def test_source_failure_is_raised_as_is() -> None:
    rw = _TarRewrite(1 << 20, 10, links=True, upload=True)

    async def src() -> AsyncIterator[bytes]:
        yield tar_of([(ti("a"), b"x" * 5000)])[:1500]
        raise errors.InfraError("client went away")

    with pytest.raises(errors.InfraError, match="client went away"):
        async for _ in _transformed(src(), rw.rewrite):
            await asyncio.sleep(0)
