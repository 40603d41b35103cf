"""E2B's pty API (``sandbox.pty``) on rollbox's envd, on the wire exactly as the e2b SDK 2.63.0
sends it (e2b/sandbox_async/commands/pty.py): ``process.Process/Start`` with ``pty.size`` and
``/bin/bash -i -l``, ``SendInput`` with ``input.pty`` bytes, ``Update`` with a new ``pty.size``,
``Connect`` to a running terminal, ``SendSignal`` to kill it; output arrives as ``data.pty``.
Bad sizes are ``invalid_argument``. A real edge and the api app with its front doors on a real
port; no SDK (its version's transport internals are not this test's)."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import have_image

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(not have_image("debian:bookworm"), reason="debian:bookworm not built"),
]
JSON = {"Content-Type": "application/json"}
STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def envelope(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(data)) + data


async def frames(resp: httpx.Response) -> AsyncIterator[tuple[int, Any]]:
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            yield flags, json.loads(buf[5:5 + size])
            buf = buf[5 + size:]


class Terminal:
    """One pty's event stream: ``output`` is the data.pty bytes so far, ``end`` its end."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.output = b""
        self.pid: int | None = None
        self.end: dict[str, Any] | None = None
        self.started = asyncio.Event()
        self.kinds: set[str] = set()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for flags, msg in frames(self.resp):
            if flags & 2:
                return
            ev = msg["event"]
            if "start" in ev:
                self.pid = ev["start"]["pid"]
                self.started.set()
            elif "data" in ev:
                self.kinds.update(ev["data"])
                self.output += base64.b64decode(ev["data"].get("pty", ""))
            elif "end" in ev:
                self.end = ev["end"]

    async def until(self, text: bytes, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while text not in self.output:
                if self.task.done():
                    raise AssertionError(f"stream ended before {text!r}: {self.output!r}")
                await asyncio.sleep(0.05)


@pytest.fixture
async def envd(edge, tmp_path) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:  # noqa: ANN001
    from rollbox.api import BackgroundServer, create_app
    from rollbox.compat.frontdoors import FRONT_DOORS
    from rollbox.iam import KeyStore
    from rollbox.watcher import placement_over

    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("e2b-pty")
    app = create_app(placement_over([edge]), keys, front_doors=FRONT_DOORS)
    try:
        async with BackgroundServer(app) as srv, httpx.AsyncClient(base_url=srv.url,
                                                                   timeout=60) as c:
            r = await c.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 120},
                             headers={"X-API-KEY": key})
            assert r.status_code == 201, r.text
            sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
            try:
                yield c, {"X-Access-Token": token}
            finally:
                await c.delete(f"/e2b/sandboxes/{sid}", headers={"X-API-KEY": key})
    finally:
        keys.close()


async def _start(c: httpx.AsyncClient, auth: dict[str, str], rows: int, cols: int,
                 stack: Any) -> Terminal:
    """pty.create(PtySize(rows, cols)) as the SDK sends it."""
    body = envelope({"process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": {
        "TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}},
        "pty": {"size": {"rows": rows, "cols": cols}}})
    resp = await stack.enter_async_context(c.stream(
        "POST", "/e2b/envd/process.Process/Start", headers={**auth, **STREAM}, content=body))
    term = Terminal(resp)
    async with asyncio.timeout(20):
        await term.started.wait()
    return term


async def test_pty_create_input_resize_connect_kill(envd) -> None:  # noqa: ANN001
    import contextlib

    c, auth = envd
    async with contextlib.AsyncExitStack() as stack:
        term = await _start(c, auth, 24, 80, stack)
        sel = {"process": {"pid": term.pid}}

        async def send(data: bytes) -> None:
            r = await c.post("/e2b/envd/process.Process/SendInput", headers={**auth, **JSON},
                             json={**sel, "input": {"pty": base64.b64encode(data).decode()}})
            assert r.status_code == 200, r.text

        await send(b"tty; stty size\n")
        await term.until(b"24 80")
        assert b"/dev/pts/" in term.output and term.kinds == {"pty"}
        r = await c.post("/e2b/envd/process.Process/Update", headers={**auth, **JSON},
                         json={**sel, "pty": {"size": {"rows": 50, "cols": 160}}})
        assert r.status_code == 200, r.text
        await send(b"stty size\n")
        await term.until(b"50 160")
        # Bad sizes and a missing one: invalid_argument, the terminal unharmed.
        for size in ({"rows": 0, "cols": 80}, {"rows": 24, "cols": 100_000}, {"rows": 24}):
            r = await c.post("/e2b/envd/process.Process/Update", headers={**auth, **JSON},
                             json={**sel, "pty": {"size": size}})
            assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
        r = await c.post("/e2b/envd/process.Process/Update", headers={**auth, **JSON}, json=sel)
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
        # Connect to the running terminal: its output again (replayed), as pty data.
        again = Terminal(await stack.enter_async_context(c.stream(
            "POST", "/e2b/envd/process.Process/Connect", headers={**auth, **STREAM},
            content=envelope(sel))))
        await again.until(b"50 160")
        # ctrl-C interrupts the foreground job.
        await send(b"sleep 100\n")
        await asyncio.sleep(0.5)
        await send(b"\x03echo rc=$?\n")
        await term.until(b"rc=130")
        r = await c.post("/e2b/envd/process.Process/SendSignal", headers={**auth, **JSON},
                         json={**sel, "signal": "SIGNAL_SIGKILL"})
        assert r.status_code == 200, r.text
        async with asyncio.timeout(20):
            await term.task
        assert term.end is not None and term.end["exitCode"] == -1, term.end

        # Start with a bad size: invalid_argument, nothing started.
        r = await c.post("/e2b/envd/process.Process/Start", headers={**auth, **STREAM},
                         content=envelope({"process": {"cmd": "/bin/bash"},
                                           "pty": {"size": {"rows": 0, "cols": 0}}}))
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
        # Update of a command without a terminal: invalid_argument.
        plain = await stack.enter_async_context(c.stream(
            "POST", "/e2b/envd/process.Process/Start", headers={**auth, **STREAM},
            content=envelope({"process": {"cmd": "sleep", "args": ["30"]}})))
        other = Terminal(plain)
        async with asyncio.timeout(20):
            await other.started.wait()
        r = await c.post("/e2b/envd/process.Process/Update", headers={**auth, **JSON},
                         json={"process": {"pid": other.pid},
                               "pty": {"size": {"rows": 10, "cols": 10}}})
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
        await c.post("/e2b/envd/process.Process/SendSignal", headers={**auth, **JSON},
                     json={"process": {"pid": other.pid}, "signal": "SIGNAL_SIGKILL"})
        async with asyncio.timeout(20):
            await other.task

        # StreamInput (a client stream) with bad input: typed, never a hang.
        for body, code in ((envelope({"data": {"input": {"pty": "eA=="}}}), "invalid_argument"),
                           (b"", "invalid_argument"), (b"\0\0\0\0\7{", "invalid_argument"),
                           (envelope({"start": {"process": {"pid": 999_999}}}), "not_found"),
                           (envelope({"bogus": {}}), "invalid_argument")):
            r = await c.post("/e2b/envd/process.Process/StreamInput",
                             headers={**auth, **STREAM}, content=body)
            assert r.json()["code"] == code and r.status_code in (400, 404), (body, r.text)


async def test_the_e2b_sdk_pty() -> None:
    """The unmodified SDK's ``sandbox.pty`` (the version in the venv) end to end: create,
    send_stdin, resize, stream_input (StreamInput, a client stream: ordered input, ctrl-C)."""
    e2b = pytest.importorskip("e2b")
    from tests.helpers.e2b_node import e2b_node

    async with e2b_node("e2b-pty-sdk"):
        sbx = await e2b.AsyncSandbox.create("base", timeout=120)
        try:
            seen = bytearray()
            term = await sbx.pty.create(e2b.PtySize(rows=24, cols=80), on_data=seen.extend)

            async def until(text: bytes) -> None:
                async with asyncio.timeout(20):
                    while text not in seen:
                        await asyncio.sleep(0.05)

            await until(b"$ ")  # bash's prompt: typed-ahead input may be lost before it
            await sbx.pty.send_stdin(term.pid, b"stty size\n")
            await until(b"24 80")
            await sbx.pty.resize(term.pid, e2b.PtySize(rows=40, cols=120))
            await sbx.pty.send_stdin(term.pid, b"stty size\n")
            await until(b"40 120")
            with pytest.raises(e2b.SandboxException):
                await sbx.pty.resize(term.pid, e2b.PtySize(rows=0, cols=100_000))
            async with sbx.pty.stream_input(term.pid) as stdin:
                await stdin.send(b"sleep 100\n")
                await asyncio.sleep(0.5)
                await stdin.send(b"\x03")
                for i in range(3):
                    await stdin.send(f"echo in-order-{i}\n".encode())
                await stdin.send(b"exit 0\n")
            res = await term.wait()
            assert res.exit_code == 0
            text = bytes(seen)
            # what the commands printed (not bash echoing what was typed), in order
            assert re.findall(rb"(?<!echo )in-order-(\d)", text) == [b"0", b"1", b"2"], text
            assert b"^C" in text
        finally:
            await sbx.kill()
