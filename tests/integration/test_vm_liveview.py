"""The live view of a "vm" sandbox in real headless chromium (issue 16 item 4), a TCG boot of
busybox:test (one per test) with ``vm_console="shell"`` (the agent's sh on tty1), through the
api over a RemoteEdge (the cluster's path: api -> edge service ``/display`` -> the VM's
checked RFB stream):

- the page (noVNC from ``make novnc``) shows the screen: its canvas has the display's size and
  the shell's text; a screenshot of the page is saved (docs/backends/vm-liveview.png when
  ``ROLLBOX_DOCS_SHOTS=1``);
- view-only: keys typed into the page reach nothing;
- take-over (the page's button): the agent's computer-use input answers display_locked (409),
  the sandbox is flagged (taken_over, takeovers), the page's state says ``yours`` and a second
  viewer's says not, its take-over answers display_locked; ``echo hi > /tmp/x`` + Enter typed in the
  page makes the file (exec); release: the agent types again;
- the event log has computer.view_issued, view_login, view, takeover and release, in order;
- two viewers (no browser): only the one that took over has the input; the other's take-over
  is display_locked (409) and its keys reach nothing; a release by anyone gives the agent its
  input back (rollbox.edge.takeover);
- the bridge on its own (no browser, the same RemoteEdge path): after a take-over a click and
  keys written all at once, without waiting for each other, reach the guest in order and the
  stream lives on (the pointer goes to the tablet bound to the display's console: sent to no
  console, QEMU refused it with "Input handler not found for event type abs" and the stream
  ended, which was the page's lost take-over typing);
- tokens: no cookie, a forged one, a reused or another sandbox's code, an expired cookie, a
  take-over without the page's header or from another origin, a WebSocket without the cookie:
  each a typed 401/403; after delete the cookie is refused (410) and the page's stream ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

import rollbox
from rollbox.config import Settings
from rollbox.errors import DisplayLocked
from rollbox.models import ComputerAction, ExecSpec, Resources, SandboxSpec
from tests.helpers.vm_guest import real_guest_marks

BB = "busybox:test"
DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "backends" / "vm-liveview.png"
pytestmark = real_guest_marks(BB) + [
    pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                       reason="no full-VM guest (make vmguest)"),
    pytest.mark.skipif(not (Settings().view_novnc_dir / "core" / "rfb.js").is_file(),
                       reason="no noVNC (make novnc)"),
    pytest.mark.parametrize("edge_transport", ["remote"], indirect=True),
]

# Bright pixels of the page's noVNC canvas, and its size.
CANVAS = """
const c = document.querySelector('#screen canvas');
if (!c || !c.width) return null;
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 300) n++;
return [c.width, c.height, n];
"""


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}


async def js(driver: Any, script: str) -> Any:
    return await asyncio.to_thread(driver.execute_script, script)


async def until(what: str, probe: Any, timeout_s: float = 60.0) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what} (last: {got!r})")
        await asyncio.sleep(0.3)


async def typed_in_page(driver: Any, parts: list[str]) -> None:
    """Keys into the focused canvas as a person types them: "<shift>." is shift held down
    around a key (a US keyboard's '>')."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    def send() -> None:
        chain = ActionChains(driver)
        for part in parts:
            if part.startswith("<shift>"):
                chain.key_down(Keys.SHIFT).send_keys(part[7:]).key_up(Keys.SHIFT)
            elif part == "<enter>":
                chain.send_keys(Keys.ENTER)
            else:
                chain.send_keys(part)
        chain.perform()

    await asyncio.to_thread(send)


async def click(driver: Any, css: str) -> None:
    await asyncio.to_thread(lambda: driver.find_element("css selector", css).click())


async def test_live_view_in_chromium(edge, api_server, chromium, tmp_path: Path,  # noqa: ANN001
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="rollbox.backends.vm.backend")  # shown on failure
    url, keys = api_server
    driver = chromium
    async with rollbox.AsyncClient(url, keys.create("proj")) as client, \
            httpx.AsyncClient(base_url=url) as http:
        sb = await client.create(BB, backend="vm", memory_mib=256, disk_mib=64,
                                 vm_console="shell")
        other = None
        try:
            assert sb.info.vm_console == "shell"
            access = await sb.live_view()
            assert access.url.startswith(f"/view/{sb.id}/login/c1.") and "?" not in access.url
            await asyncio.to_thread(driver.get, url + access.url)
            await until("the view to connect",
                        lambda: js(driver, "return window.rollboxView && "
                                           "window.rollboxView.state === 'connected'"))
            d = await sb.display()
            # the shell's prompt on tty1: the canvas is the display's size and has text
            await until("the screen in the canvas", lambda: js(driver, CANVAS))
            await until("the shell's text", lambda: _bright(driver, d))
            # view only: typed keys reach nothing
            await click(driver, "#screen canvas")
            await typed_in_page(driver, ["echo no ", "<shift>.", " /tmp/y", "<enter>"])
            await asyncio.sleep(2)
            assert (await sb.exec("test -e /tmp/y")).exit_code == 1
            # the bridge on its own: a raw RFB client's keys are dropped unless taken over,
            # and a message of an unknown type ends its stream
            await _raw_client_refused(http, url, sb)
            # take over: the agent is locked out, the sandbox flagged
            await click(driver, "#takeover")
            await until("the take-over", lambda: js(driver, "return window.rollboxView."
                                                           "takenOver"))
            info = await sb.refresh()
            assert info.taken_over and info.takeovers == 1
            with pytest.raises(DisplayLocked):
                await sb.keyboard.type("echo agent\n")
            assert await js(driver, "return window.rollboxView.yours") is True
            # a second viewer (a session of its own): told it is not its, its take-over refused
            second = await _login(http, sb)
            state = (await http.get(f"/view/{sb.id}/state", headers=ck(second))).json()
            assert state["taken_over"] is True and state["yours"] is False
            assert _code(await http.post(f"/view/{sb.id}/takeover", headers={
                **ck(second), "X-Rollbox-View": "1"})) == (409, "display_locked", None)
            before = (await js(driver, CANVAS))[2]
            await click(driver, "#screen canvas")
            await typed_in_page(driver, ["echo hi ", "<shift>.", " /tmp/x", "<enter>"])

            async def made() -> bool:
                r = await sb.exec("cat /tmp/x")
                return r.exit_code == 0 and r.stdout == "hi\n"
            try:
                await until("/tmp/x from the page's keys", made, 60)
            except AssertionError:  # what the screen shows says why
                await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "failed.png"))
                (tmp_path / "screen.png").write_bytes(await sb.screenshot())
                raise AssertionError(f"no /tmp/x; the page and screen: {tmp_path}") from None
            async def drawn() -> bool:  # the typed line and the next prompt on the canvas
                return (await js(driver, CANVAS))[2] > before
            await until("the typed line in the canvas", drawn, 30)
            await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "liveview.png"))
            if os.environ.get("ROLLBOX_DOCS_SHOTS") == "1":
                shutil.copyfile(tmp_path / "liveview.png", DOCS_SHOT)
            # release: the agent types again
            await click(driver, "#release")
            await until("the release", lambda: js(driver, "return window.rollboxView."
                                                         "takenOver === false"))
            await sb.keyboard.type("echo agent > /tmp/z\n")
            await until("/tmp/z from the agent's keys",
                        lambda: _has(sb, "/tmp/z", "agent\n"), 30)
            info = await sb.refresh()
            assert not info.taken_over and info.takeovers == 1
            kinds = [e.kind for e in await sb.events() if e.kind.startswith("computer.")]
            want = ["computer.view_issued", "computer.view_login", "computer.view",
                    "computer.takeover", "computer.release", "computer.type"]
            rest = iter(kinds)
            assert all(k in rest for k in want), kinds  # in this order (others between)
            assert kinds.count("computer.takeover") == kinds.count("computer.release") == 1
            assert "computer.type" not in kinds[:kinds.index("computer.release")]  # refused
            takeover = next(e for e in await sb.events() if e.kind == "computer.takeover")
            assert json.loads(takeover.data)["by"].startswith("live view ")

            await _tokens_refused(http, url, sb)
            cookie = await _login(http, sb)
            other = await client.create(BB)  # a container: no screen, no view
            with pytest.raises(rollbox.errors.BadRequest, match="vm"):
                await other.live_view()
        finally:
            if other is not None:
                await other.delete()
            await sb.delete()
        # after delete: the cookie is refused, the page's stream has ended
        r = await http.get(f"/view/{sb.id}/", headers=ck(cookie))
        assert r.status_code == 410 and r.json()["error"]["code"] == "sandbox_dead"
        await until("the page's stream to end",
                    lambda: js(driver, "return ['disconnected', 'lost'].includes("
                                       "window.rollboxView.state)"), 30)


async def _bright(driver: Any, d: Any) -> bool:
    got = await js(driver, CANVAS)
    return bool(got) and got[0] == d.width and got[1] == d.height and got[2] > 50


async def _has(sb: Any, path: str, text: str) -> bool:
    r = await sb.exec(f"cat {path}")
    return r.exit_code == 0 and r.stdout == text


async def _login(http: httpx.AsyncClient, sb: Any, ttl_s: float | None = None) -> str:
    access = await sb.live_view(ttl_s)
    r = await http.get(access.url)
    assert r.status_code == 200, r.text
    set_cookie = r.headers["set-cookie"]
    for attr in ("HttpOnly", "SameSite=strict", f"Path=/view/{sb.id}/"):
        assert attr.lower() in set_cookie.lower(), set_cookie
    token = r.cookies["rollbox_view"]
    http.cookies.clear()  # each request below names the cookie it sends
    return token


def _code(r: httpx.Response) -> tuple[int, str, str | None]:
    err = r.json()["error"]
    return r.status_code, err["code"], (err.get("details") or {}).get("reason")


async def _raw_client_refused(http: httpx.AsyncClient, url: str, sb: Any) -> None:
    cookie = await _login(http, sb)
    ws_url = url.replace("http://", "ws://") + f"/view/{sb.id}/ws"
    async with websockets.connect(ws_url, additional_headers=ck(cookie)) as ws:
        got = bytearray()

        async def need(n: int) -> bytes:
            while len(got) < n:
                got.extend(await asyncio.wait_for(ws.recv(), 10))
            out = bytes(got[:n])
            del got[:n]
            return out

        assert (await need(12)).startswith(b"RFB 003.00")
        await ws.send(b"RFB 003.008\n")
        n = (await need(1))[0]
        assert 1 in await need(n)  # None (the api authenticated the viewer)
        await ws.send(b"\x01")
        assert await need(4) == b"\x00\x00\x00\x00"
        await ws.send(b"\x01")
        init = await need(24)
        await need(struct.unpack(">I", init[20:24])[0])
        keys = [ord(c) for c in "touch /tmp/r"] + [0xFF0D]
        await ws.send(b"".join(struct.pack(">BBxxI", 4, down, k) for k in keys
                               for down in (1, 0)))
        await asyncio.sleep(2)
        assert (await sb.exec("test -e /tmp/r")).exit_code == 1
        await ws.send(b"\x07")  # no such client message
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def ck(token: str) -> dict[str, str]:
    return {"Cookie": f"rollbox_view={token}"}


async def _tokens_refused(http: httpx.AsyncClient, url: str, sb: Any) -> None:
    page = f"/view/{sb.id}/"
    assert _code(await http.get(page)) == (401, "view_token_invalid", "missing")
    cookie = await _login(http, sb)
    assert (await http.get(page, headers=ck(cookie))).status_code == 200
    exp, session = cookie.split(".")[1:3]
    forged = f"v1.{int(exp) + 3600}.{session}.{cookie.split('.')[3]}"
    assert _code(await http.get(page, headers=ck(forged))) == (
        401, "view_token_invalid", "forged")
    access = await sb.live_view()
    assert (await http.get(access.url)).status_code == 200
    assert _code(await http.get(access.url)) == (401, "view_token_invalid", "used")
    code = access.url.rsplit("/", 1)[1]
    other_id = sb.id[:-4] + ("0000" if not sb.id.endswith("0000") else "1111")
    assert _code(await http.get(f"/view/{other_id}/login/{code}")) == (
        401, "view_token_invalid", "forged")
    assert _code(await http.get(f"/view/{other_id}/", headers=ck(cookie))) == (
        401, "view_token_invalid", "forged")
    # the take-over needs the page's own header, and its own origin
    takeover = f"/view/{sb.id}/takeover"
    assert (await http.post(takeover, headers=ck(cookie))).status_code == 403
    r = await http.post(takeover, headers={**ck(cookie), "X-Rollbox-View": "1",
                                           "Origin": "http://evil.example"})
    assert r.status_code == 403 and not (await sb.refresh()).taken_over
    # the WebSocket: refused without the cookie, and from another origin
    ws_url = url.replace("http://", "ws://") + f"/view/{sb.id}/ws"
    for headers in ({}, {"Cookie": f"rollbox_view={cookie}", "Origin": "http://evil.example"}):
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(ws_url, additional_headers=headers):
                pass
        assert refused.value.response.status_code in (401, 403)
    # expiry
    short = await _login(http, sb, ttl_s=1)
    await asyncio.sleep(2.1)
    assert _code(await http.get(page, headers=ck(short))) == (
        401, "view_token_invalid", "expired")
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(ws_url,
                                      additional_headers={"Cookie": f"rollbox_view={short}"}):
            pass


class RfbClient:
    """A raw RFB client on a display_open stream (no browser): the handshake, then messages."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.got = bytearray()
        self.size = (0, 0)

    async def need(self, n: int) -> bytes:
        while len(self.got) < n:
            data = await asyncio.wait_for(self.stream.read(), 10)
            assert data, "the stream ended"
            self.got.extend(data)
        out = bytes(self.got[:n])
        del self.got[:n]
        return out

    async def handshake(self) -> tuple[int, int]:
        """Version, security None, ClientInit; the ServerInit's size (its name read too)."""
        assert (await self.need(12)) == b"RFB 003.008\n"
        await self.stream.write(b"RFB 003.008\n")
        n = (await self.need(1))[0]
        assert 1 in await self.need(n)
        await self.stream.write(b"\x01")
        assert await self.need(4) == b"\x00\x00\x00\x00"
        await self.stream.write(b"\x01")
        init = await self.need(24)
        self.size = struct.unpack(">HH", init[:4])
        await self.need(struct.unpack(">I", init[20:24])[0])
        return self.size


def key_messages(text: str) -> list[bytes]:
    """RFB KeyEvents typing ``text`` on a US keyboard ('>' with shift), then Enter."""
    msgs = []
    for c in text:
        sym = {" ": 0x20, ">": ord(">")}.get(c, ord(c))
        shift = c == ">"
        if shift:
            msgs.append(struct.pack(">BBxxI", 4, 1, 0xFFE1))
        msgs += [struct.pack(">BBxxI", 4, 1, sym), struct.pack(">BBxxI", 4, 0, sym)]
        if shift:
            msgs.append(struct.pack(">BBxxI", 4, 0, 0xFFE1))
    return msgs + [struct.pack(">BBxxI", 4, 1, 0xFF0D), struct.pack(">BBxxI", 4, 0, 0xFF0D)]


async def test_live_view_input_reaches_the_guest(edge, api_edge) -> None:  # noqa: ANN001
    info = await edge.create(SandboxSpec(image=BB, backend="vm", vm_console="shell",
                                         resources=Resources(memory_mib=256, disk_mib=64)),
                             "proj")
    sid = info.id
    stream = await api_edge.display_open(sid, "test")
    try:
        rfb = RfbClient(stream)
        w, h = await rfb.handshake()
        d = await edge.display_info(sid)
        assert (w, h) == (d.width, d.height)  # ServerInit: the size pointers are scaled by
        await api_edge.display_takeover(sid, True, "test")
        # a click in the middle, then keys: every message its own write, none awaited
        # before the next is called (the edge keeps them in order)
        msgs = [struct.pack(">BBHH", 5, 1, w // 2, h // 2), struct.pack(">BBHH", 5, 0, w // 2,
                                                                          h // 2)]
        msgs += key_messages("echo ab > /tmp/o")
        await asyncio.gather(*(stream.write(m) for m in msgs))

        async def made() -> bool:
            r = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(
                cmd="cat /tmp/o", timeout_s=30)))
            return r.exit_code == 0 and r.stdout == "ab\n"
        await until("/tmp/o from the stream's keys", made, 30)
        # the stream lives on: an update request is answered
        await stream.write(struct.pack(">BBHHHH", 3, 0, 0, 0, w, h))
        await rfb.need(1)
    finally:
        await stream.close()
        await edge.delete(sid)


async def test_only_the_viewer_that_took_over_has_the_input(  # noqa: ANN001
        edge, edge_transport: str) -> None:  # the module's transport: unused (local edge)
    """Two viewers of one screen (the local edge: a write returns once its input was sent):
    both view-only until one takes over; then the agent's input is display_locked, the other
    viewer's take-over is refused with display_locked (409) and its keys reach nothing, the
    holder's keys reach the guest; a release (by the other viewer: a holder who left must not
    lock the agent out) gives the agent its input back and the former holder is view-only
    again. Whether keys reached the guest is read after keys that did (one QMP input path, in
    order): a line typed before them would have run first."""
    info = await edge.create(SandboxSpec(image=BB, backend="vm", vm_console="shell",
                                         resources=Resources(memory_mib=256, disk_mib=64)),
                             "proj")
    sid = info.id
    a = await edge.display_open(sid, "live view a")
    b = await edge.display_open(sid, "live view b")

    async def typed(stream: Any, text: str) -> None:
        for m in key_messages(text):
            await stream.write(m)

    async def agent_types(text: str) -> None:
        await edge.computer_action(sid, ComputerAction(action="type", text=text + "\n"))

    async def files() -> set[str]:
        r = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(
            cmd="cd /tmp && ls", timeout_s=30)))
        return set(r.stdout.split())

    async def has(name: str) -> bool:
        return name in await files()

    try:
        await RfbClient(a).handshake()
        await RfbClient(b).handshake()
        await typed(a, "echo > /tmp/a0")  # nobody took over: view-only
        await agent_types("echo > /tmp/g0")
        await until("the agent's keys", lambda: has("g0"), 30)
        assert "a0" not in await files()

        held = await edge.display_takeover(sid, True, "live view a")
        assert (held.taken_over, held.taken_over_by, held.takeovers) == (True, "live view a", 1)
        with pytest.raises(DisplayLocked, match="another viewer"):
            await edge.display_takeover(sid, True, "live view b")
        with pytest.raises(DisplayLocked):
            await agent_types("echo > /tmp/g1")
        await typed(b, "echo > /tmp/b1")  # not the holder: nothing
        await typed(a, "echo > /tmp/a1")
        await until("the holder's keys", lambda: has("a1"), 30)
        assert not {"b1", "g1"} & await files()

        released = await edge.display_takeover(sid, False, "live view b")
        assert (released.taken_over, released.taken_over_by) == (False, None)
        await typed(a, "echo > /tmp/a2")  # released: the former holder is view-only again
        await agent_types("echo > /tmp/g2")
        await until("the agent's keys after the release", lambda: has("g2"), 30)
        assert "a2" not in await files()
        takes = [(e.kind, json.loads(e.data)["by"]) for e in await edge.event_log.read(sid)
                 if e.kind in ("computer.takeover", "computer.release")]
        assert takes == [("computer.takeover", "live view a"),
                         ("computer.release", "live view b")]
    finally:
        await a.close()
        await b.close()
        await edge.delete(sid)
