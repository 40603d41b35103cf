"""Red team F43 (../shared/redteam.md): another project's screen and input. A project's API key
on another project's real ``vm`` sandbox id (the SDK's handle made with that id, the api over
a real edge, a TCG boot of busybox:test): its screenshot, display, every mouse and keyboard
action and a live view are each 404 ``not_found`` (as for an id that does not exist: nothing
learnt of it), nothing is recorded in the sandbox's event log, and no key reaches the guest
(the owner's own typed line, sent after, runs; the other's never does)."""
from __future__ import annotations

import asyncio
import time

import pytest

import rollbox
from rollbox import errors
from rollbox.sdk._async import AsyncSandbox
from tests.helpers.vm_guest import full_vm_marks

BB = "busybox:test"
pytestmark = full_vm_marks(BB)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}


async def test_another_projects_key_reaches_no_screen_and_no_input(  # noqa: ANN001
        edge, api_server) -> None:
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("owner")) as mine, \
            rollbox.AsyncClient(url, keys.create("intruder")) as theirs_client:
        sb = await mine.create(BB, backend="vm", vm_console="shell", memory_mib=256,
                               disk_mib=64)
        try:
            theirs = AsyncSandbox(theirs_client, sb.info)  # the id known, the key not its own
            before = len(await sb.events())
            attempts = [theirs.screenshot(), theirs.display(),
                        theirs.keyboard.type("echo x > /tmp/intruder\n"),
                        theirs.keyboard.press("ctrl+c"), theirs.mouse.click(1, 1),
                        theirs.mouse.move(2, 2), theirs.mouse.drag(0, 0, 5, 5),
                        theirs.mouse.scroll(1, 1, dy=1), theirs.live_view()]
            for attempt in attempts:
                with pytest.raises(errors.NotFound) as refused:
                    await attempt
                assert refused.value.status == 404
            with pytest.raises(errors.NotFound):
                await theirs_client.get(sb.id)
            assert sb.id not in {s.id for s in await theirs_client.list()}
            assert len(await sb.events()) == before  # nothing of theirs recorded

            await sb.keyboard.type("echo x > /tmp/owner\n")  # after theirs, on one input path
            end = time.monotonic() + 30
            while (await sb.exec("test -e /tmp/owner")).exit_code != 0:
                assert time.monotonic() < end, "the owner's keys never reached the guest"
                await asyncio.sleep(0.3)
            assert (await sb.exec("test -e /tmp/intruder")).exit_code == 1
        finally:
            await sb.delete()
    assert edge.leftovers(sb.id) == []
