"""The operator dashboard (issue 18 item 2) in real headless chromium: sign in with a project
key, the page lists the sandbox the test created (not another project's), opening it streams a
command's output while the command runs, the session cookie is out of the page's reach
(HttpOnly). With ``ROLLBOX_DOCS_SHOTS=1`` the page's screenshot is saved as docs/dashboard.png
(the tests never write into the checkout otherwise)."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import rollbox

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
SHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


async def until(what: str, cond: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = await asyncio.to_thread(cond)
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


async def test_dashboard_lists_and_streams_in_chromium(edge, api_server, chromium) -> None:  # noqa: ANN001
    url, keys = api_server
    driver = chromium
    key = keys.create("proj")
    async with rollbox.AsyncClient(url, key) as client, \
            rollbox.AsyncClient(url, keys.create("other")) as other:
        sb = await client.create(BB, labels={"task": "demo"})
        theirs = await other.create(BB)
        try:
            await asyncio.to_thread(driver.get, url + "/dashboard")
            field = await asyncio.to_thread(driver.find_element, "css selector", "#key")
            await asyncio.to_thread(field.send_keys, key)
            await asyncio.to_thread(
                lambda: driver.find_element("css selector", "#signin").click())
            row = f'#sandboxes tr[data-id="{sb.id}"]'
            await until("the sandbox listed", lambda: js(
                driver, f"return document.querySelector('{row}') !== null"))
            nodes = js(driver, "return document.querySelector('#nodes tbody').textContent")
            assert edge.node_id in nodes and "ok" in nodes
            assert not js(driver, f"return document.querySelector("
                                  f"'#sandboxes tr[data-id=\"{theirs.id}\"]') !== null")
            assert "rollbox_dashboard" not in js(driver, "return document.cookie")  # HttpOnly
            await asyncio.to_thread(lambda: driver.find_element("css selector", row).click())
            await until("the event stream open", lambda: js(
                driver, "return document.querySelector('#events li') !== null"))
            proc = await sb.exec_background(
                "for i in 1 2 3 4 5 6; do echo line$i; sleep 1; done")
            out = "return document.querySelector('#output').textContent"
            await until("line1 drawn", lambda: "line1" in js(driver, out))
            # streamed: the first line is on the page while the command still runs
            assert "line6" not in js(driver, out)
            assert (await sb.processes())[0].state == "running"
            await until("the last line", lambda: "line6" in js(driver, out))
            assert (await proc.wait()).exit_code == 0
            await asyncio.sleep(0.5)
            png = await asyncio.to_thread(driver.get_screenshot_as_png)
            assert png[:8] == b"\x89PNG\r\n\x1a\n"
            if os.environ.get("ROLLBOX_DOCS_SHOTS") == "1":
                SHOT.write_bytes(png)
            # the page's own polling asked nothing that failed
            assert js(driver, "return document.querySelector('#errors tbody').children.length"
                      ) == 0
        finally:
            await sb.delete()
            await theirs.delete()
