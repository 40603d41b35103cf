"""The agent-based file API (``rollbox.agent.files``: the platform's busybox applets run in the
sandbox's root through its agent, every byte back parsed as hostile), on a real sandbox.

On containers the platform tool is reached through the platform shell exec'ing the image's own
busybox (busybox:test): the parsing, caps, flow control and error mapping under test are the
same as on a microVM, where the agent runs the platform's busybox by descriptor."""
from __future__ import annotations

import asyncio
import io
import os
import re
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from rollbox import errors
from rollbox.agent import protocol as P
from rollbox.agent.files import XATTR_FILE_TOOL, AgentFiles
from rollbox.agent.tools import HIGH_WATER, PlatformTools, tool_request
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.redteam.test_file_paths import make_tar, once
from tests.redteam.test_file_paths import member as redteam_member

BB = "busybox:test"


def image_busybox(argv: list[str], stdin: bool, timeout_ms: int, stream_limit: int
                  ) -> P.ExecRequest:
    """A container stand-in for EXEC_PLATFORM_TOOL: the platform shell execs busybox."""
    return P.ExecRequest(argv=["bash", "-c", 'exec -a "$0" /bin/busybox "$@"', *argv], env=[],
                         timeout_ms=timeout_ms, stdin=stdin, stream_limit=stream_limit,
                         tail_limit=0, platform_shell=True)


def image_busybox_or_agent(argv: list[str], stdin: bool, timeout_ms: int, stream_limit: int
                           ) -> P.ExecRequest:
    """image_busybox, but a tool built into the agent (``rollbox-xattr``) runs as on a
    microVM: EXEC_PLATFORM_TOOL, exec'd from the agent's own binary (fd 4 in a container)."""
    if argv[0] == XATTR_FILE_TOOL:
        return tool_request(argv, stdin, timeout_ms, stream_limit)
    return image_busybox(argv, stdin, timeout_ms, stream_limit)


@dataclass
class Box:
    """One sandbox under test: its agent-based files and a shell of the sandbox."""

    files: AgentFiles
    sh: Callable[[str], Awaitable[str]]


@pytest.fixture(params=[image_busybox])
async def box(edge, request: pytest.FixtureRequest) -> AsyncIterator[Box]:  # noqa: ANN001
    """``request.param``: how a tool is run (indirect parametrize to change it)."""
    info = await edge.create(SandboxSpec(image=BB, resources=Resources(disk_mib=64)), "t")
    live = edge._live(info.id)
    tools = PlatformTools(lambda: live.box.channel, request=request.param)

    async def sh(cmd: str) -> str:
        r = await edge.exec_wait(info.id, await edge.exec_start(info.id, ExecSpec(cmd=cmd)))
        assert r.exit_code == 0, r
        return r.stdout

    try:
        yield Box(AgentFiles(tools), sh)
    finally:
        await edge.delete(info.id)


async def test_ops(box: Box) -> None:
    await check_write_read_stat_list_mkdir_remove(box)


async def test_bad_input(box: Box) -> None:
    await check_bad_input_and_special_files(box)
    await check_paths_stay_in_root(box)


async def test_streams(box: Box) -> None:
    await check_streams_bounded_and_disk_cap(box)


async def test_tar(box: Box) -> None:
    await check_tar_round_trip_and_hostile_members(box)


@pytest.mark.parametrize("box", [image_busybox_or_agent], indirect=True)
async def test_xattrs(box: Box) -> None:
    await check_xattrs(box)


async def test_xattrs_with_an_agent_before_the_tool(box: Box) -> None:
    """No ``rollbox-xattr`` (busybox answers 127 for it, as an older agent does): a write with
    attributes is NotSupported and leaves nothing; stat and list work, with none."""
    with pytest.raises(errors.NotSupported):
        await box.files.write_stream("/o/a", once(b"x"), xattrs={"user.e2b.k": "v"})
    assert await box.files.list("/o") == []  # the parent was made; no file, no temp file
    await box.files.write_stream("/o/b", once(b"x"))
    assert (await box.files.stat("/o/b")).xattrs is None
    assert [f.xattrs for f in await box.files.list("/o")] == [None]


async def check_xattrs(box: Box) -> None:
    """user.* extended attributes through the agent's ``rollbox-xattr`` (a microVM's file
    metadata): set by a streamed write on its temp file before it appears, read back by stat
    and list (links and special files have none, a FIFO is never opened), gone after an
    overwrite without them; bad ones refused before anything is written; a file the sandbox
    gave more attributes than the cap shows the cap's worth."""
    attrs = {"user.e2b.author": "mish", "user.x": "caf\u00e9", "user.empty": ""}
    assert await box.files.write_stream("/m/a.txt", once(b"hello"), mode=0o600,
                                        xattrs=attrs) == 5
    a = await box.files.stat("/m/a.txt")
    assert (a.xattrs, a.mode, await box.files.read("/m/a.txt")) == (attrs, 0o600, b"hello")
    await box.sh("ln -s a.txt /m/l; ln -s /m /ml; mkfifo /m/ff")
    await box.files.write_stream("/ml/b", once(b"b"), xattrs={"user.k": "v"})  # in-root link
    listed = {f.name: f.xattrs for f in await asyncio.wait_for(box.files.list("/m"), 60)}
    assert listed == {"a.txt": attrs, "b": {"user.k": "v"}, "ff": None, "l": None}
    assert (await box.files.stat("/m/l")).xattrs is None  # the link's own: not followed
    await box.files.write_stream("/m/a.txt", once(b"again"))  # replaced: the new file's none
    assert (await box.files.stat("/m/a.txt")).xattrs is None
    for bad in ({"trusted.x": "1"}, {"user.overlay.opaque": "y"}, {"user.big": "v" * 5000},
                {f"user.n{i}": "v" for i in range(65)}, {"user.a\0b": "1"}):
        with pytest.raises(errors.BadRequest):
            await box.files.write_stream("/m/bad", once(b"x"), xattrs=bad)
    assert {f.name for f in await box.files.list("/m")} == {"a.txt", "b", "ff", "l"}
    # planted past the cap (as the sandbox's root can): stat holds the first 64. A small
    # filesystem (the microVM's, 1 KiB blocks) stores fewer: then all of those it took.
    pairs = [a for i in range(70) for a in (f"user.p{i}", b"v".hex())]
    res = await box.files.tools.run([XATTR_FILE_TOOL, "set", "/m/b", *pairs])
    full = re.search(rb"can't set 'user\.p(\d+)' on '/m/b': No space left on device", res.stderr)
    assert res.ok or full, res
    planted = 1 + (70 if res.ok else int(full.group(1)))  # user.k too
    assert len((await box.files.stat("/m/b")).xattrs or {}) == min(64, planted)
    for p in ("/m", "/ml"):
        await box.files.remove(p, recursive=True)


async def check_write_read_stat_list_mkdir_remove(box: Box) -> None:
    await box.files.write("/work/a/b.txt", b"hello\n", mode=0o4640)
    assert await box.files.read("/work/a/b.txt") == b"hello\n"
    s = await box.files.stat("/work/a/b.txt")
    assert (s.type, s.size, s.mode, s.uid, s.name, s.path) == (
        "file", 6, 0o640, 0, "b.txt", "/work/a/b.txt")  # setuid stripped
    await box.files.write("/work/a/b.txt", b"two")  # replaced atomically
    assert await box.files.read("/work/a/b.txt") == b"two"
    assert (await box.files.stat("/work/a/b.txt")).mode == 0o644
    odd = "/work/we'ird\nname -> 'x'"
    await box.files.write(odd, b"")
    await box.sh("ln -s /work/a/b.txt /work/l; ln -s \"/x' -> 'y\" /work/q; "
             "mkfifo /work/ff; mknod /work/null c 1 3 2>/dev/null || true")
    listing = {f.name: (f.type, f.link_target) for f in await box.files.list("/work")}
    assert listing["a"] == ("dir", None) and listing["ff"] == ("other", None)
    assert listing["l"] == ("symlink", "/work/a/b.txt")
    assert listing["q"] == ("symlink", "/x' -> 'y")
    assert listing[odd[6:]] == ("file", None)
    assert [f.name for f in await box.files.list("/work")] == sorted(listing)
    assert {f.name for f in await box.files.list("/")} >= {"work", "bin", "etc"}
    # through a link: list and read follow it in-root, stat does not
    assert [f.name for f in await box.files.list("/work/a")] == ["b.txt"]
    assert await box.files.read("/work/l") == b"two"
    assert (await box.files.stat("/work/l")).type == "symlink"
    await box.files.mkdir("/work/m")
    await box.files.mkdir("/work/p/q/r", parents=True)
    await box.files.mkdir("/work/p/q/r", parents=True)  # no error if it exists
    assert (await box.files.stat("/work/p/q/r")).type == "dir"
    with pytest.raises(errors.BadRequest, match="already exists"):
        await box.files.mkdir("/work/m")
    with pytest.raises(errors.NotFound):
        await box.files.mkdir("/work/nope/x")
    with pytest.raises(errors.BadRequest, match="not a directory"):
        await box.files.mkdir("/work/a/b.txt/x", parents=True)
    with pytest.raises(errors.BadRequest, match="directory not empty"):
        await box.files.remove("/work/p")
    await box.files.remove("/work/p", recursive=True)
    await box.files.remove("/work/l")  # the link goes, not its target
    assert await box.files.read("/work/a/b.txt") == b"two"
    await box.files.remove("/work/m")
    with pytest.raises(errors.NotFound):
        await box.files.stat("/work/p")
    with pytest.raises(errors.BadRequest):
        await box.files.remove("/")


async def check_paths_stay_in_root(box: Box) -> None:
    """Red team E31: links and ``..`` resolve inside the sandbox's root (on a microVM, the
    guest's own init and platform tools outside it stay out of reach too)."""
    await box.sh("mkdir -p /e && ln -s ../../../../../../.. /e/up && ln -s / /e/abs")
    assert (await box.files.stat("/e/up")).link_target == "../../../../../../.."
    root = [f.name for f in await box.files.list("/")]
    assert [f.name for f in await box.files.list("/e/up")] == root
    assert [f.name for f in await box.files.list("/../../..")] == root
    await box.files.write("/e/up/escaped.txt", b"in root")
    assert await box.files.read("/escaped.txt") == b"in root"
    await box.files.upload_tar("/e/abs/t", once(make_tar([(member("a"), b"a")])))
    assert await box.files.read("/t/a") == b"a"
    for outside in ("/e/up/init", "/e/up/platform/busybox", "/../platform/bash",
                    "/e/abs/../../view/proc"):
        with pytest.raises(errors.NotFound):
            await box.files.read(outside)
    for p in ("/escaped.txt", "/t", "/e"):
        await box.files.remove(p, recursive=True)


async def check_bad_input_and_special_files(box: Box) -> None:
    await box.files.mkdir("/d")
    with pytest.raises(errors.BadRequest, match="is a directory"):
        await box.files.write("/d", b"x")
    assert await box.files.list("/d") == []  # no temp file left
    for bad in ("relative", "", "/a\0b", "/" + "a" * 5000):
        with pytest.raises(errors.BadRequest):
            await box.files.write(bad, b"x")
        with pytest.raises(errors.BadRequest):
            await box.files.stat(bad)
    with pytest.raises(errors.BadRequest):
        await box.files.write("/", b"x")
    with pytest.raises(errors.BadRequest, match="not a directory"):
        await box.files.write("/bin/busybox/x", b"x")
    with pytest.raises(errors.NotFound):
        await box.files.read("/nope")
    await box.sh("mkfifo /d/ff; ln -s /d/ff /d/lf; ln -s /d/loop /d/loop; "
             "truncate -s 60M /d/sparse")
    # a device node where the sandbox may make one (a VM's root can; a container's can not,
    # but its /dev, which the container's agent sees, has one)
    await box.sh("mknod /d/zero c 1 5 2>/dev/null; true")
    made = {f.name for f in await box.files.list("/d")}
    zero = "/d/zero" if "zero" in made else "/dev/zero"
    for path in ("/d/ff", "/d/lf", zero, "/d"):  # never opened: no hang
        with pytest.raises(errors.BadRequest, match="not a regular file|directory"):
            await asyncio.wait_for(box.files.read(path), 30)
    with pytest.raises(errors.BadRequest, match="symbolic links"):
        await box.files.read("/d/loop")
    with pytest.raises(errors.PayloadTooLarge):
        await box.files.read("/d/sparse", max_bytes=1 << 20)
    with pytest.raises(errors.PayloadTooLarge):
        await anext(box.files.read_stream("/d/sparse", max_bytes=1 << 20))
    with pytest.raises(errors.PayloadTooLarge):
        await box.files.read("/bin/busybox", max_bytes=100)


async def check_streams_bounded_and_disk_cap(box: Box) -> None:
    blob = os.urandom(12 << 20)

    async def chunks(data: bytes, step: int = 1 << 20) -> AsyncIterator[bytes]:
        for i in range(0, len(data), step):
            yield data[i:i + step]

    assert await box.files.write_stream("/s/blob", chunks(blob), mode=0o600) == len(blob)
    assert (await box.files.stat("/s/blob")).mode == 0o600
    got = bytearray()
    box.files.tools.peak_buffered = 0
    async for c in box.files.read_stream("/s/blob"):
        if not got:
            await asyncio.sleep(1.5)  # a consumer behind: the command is stopped, not buffered
        got += c
    assert bytes(got) == blob
    assert 0 < box.files.tools.peak_buffered <= HIGH_WATER + (2 << 20)
    # a stream above its cap or past the disk cap leaves no file, no temp file
    with pytest.raises(errors.PayloadTooLarge):
        await box.files.write_stream("/s/capped", chunks(blob), max_bytes=1 << 20)
    await box.sh("dd if=/dev/zero of=/fill bs=1M count=200 2>/dev/null; sync; true")
    with pytest.raises(errors.BadRequest) as exc:  # DiskFull keeps the bad_request code
        await box.files.write_stream("/s/huge", chunks(blob))
    assert exc.value.details.get("reason") == "disk_full"
    await box.files.remove("/fill")
    assert [f.name for f in await box.files.list("/s")] == ["blob"]

    async def failing() -> AsyncIterator[bytes]:
        yield b"partial"
        raise errors.InfraError("client went away")

    with pytest.raises(errors.InfraError, match="client went away"):
        await box.files.write_stream("/s/broken", failing())
    assert [f.name for f in await box.files.list("/s")] == ["blob"]


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", mode: int = 0o644
           ) -> tarfile.TarInfo:
    ti = redteam_member(name, kind, linkname)
    ti.mode = mode
    return ti


async def check_tar_round_trip_and_hostile_members(box: Box) -> None:
    tar = make_tar([
        (member("pkg", tarfile.DIRTYPE, mode=0o755), None),
        (member("pkg/run.sh", mode=0o4755), b"#!/bin/sh\necho hi\n"),
        (member("pkg/link", tarfile.SYMTYPE, "/etc/passwd"), None),
        (member("pkg/hard", tarfile.LNKTYPE, "pkg/run.sh"), None),
        (member("pkg/dev", tarfile.CHRTYPE), None),
        (member("pkg/fifo", tarfile.FIFOTYPE), None),
        (member("pkg/" + "n" * 200), b"long name"),
    ])
    assert await box.files.upload_tar("/up", once(tar)) == 18 + 9
    listing = {f.name: f for f in await box.files.list("/up/pkg")}
    assert set(listing) == {"run.sh", "link", "hard", "n" * 200}  # no device, no FIFO
    assert listing["run.sh"].mode == 0o755  # no setuid
    assert listing["link"].link_target == "/etc/passwd"
    for bad in ("../escape", "/abs", "a/../../b"):
        with pytest.raises(errors.BadRequest):
            await box.files.upload_tar("/up", once(make_tar([(member(bad), b"x")])))
    with pytest.raises(errors.BadRequest, match="malformed"):
        await box.files.upload_tar("/up", once(b"not a tar" * 200))
    assert await box.files.upload_tar("/nolinks", once(tar), links=False) == 27
    assert {f.name for f in await box.files.list("/nolinks/pkg")} == {"run.sh", "n" * 200}
    # download: members relative to the directory; specials left out; a file is one member
    await box.sh("mkfifo /up/pkg/ff")
    raw = b"".join([c async for c in box.files.download_tar("/up")])
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        got = {m.name: m for m in tf}
        assert set(got) == {"pkg", "pkg/run.sh", "pkg/link", "pkg/hard", "pkg/" + "n" * 200}
        assert got["pkg/link"].issym() and got["pkg/link"].linkname == "/etc/passwd"
        assert tf.extractfile(got["pkg/run.sh"]).read() == b"#!/bin/sh\necho hi\n"  # type: ignore[union-attr]
    one = b"".join([c async for c in box.files.download_tar("/up/pkg/run.sh")])
    with tarfile.open(fileobj=io.BytesIO(one)) as tf:
        assert tf.getnames() == ["run.sh"]
    # a copy of a tree through both directions
    assert await box.files.upload_tar("/copy", box.files.download_tar("/up")) == 27
    assert {f.name for f in await box.files.list("/copy/pkg")} == {"run.sh", "link", "hard",
                                                               "n" * 200}
    with pytest.raises(errors.NotFound):
        await anext(box.files.download_tar("/nope"))
    await box.sh("truncate -s 60M /up/sparse")  # counted at its full size
    small = AgentFiles(box.files.tools, max_upload=8 << 20)
    with pytest.raises(errors.PayloadTooLarge):
        async for _ in small.download_tar("/up"):
            pass
