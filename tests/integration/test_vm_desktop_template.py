"""The desktop's machine template (``backends/vm/templates.py``, ``vm_full_templates="disk"``):
the first ``create("desktop:1", backend="vm")`` of a node boots the disk once,
waits for its X server and a still screen, saves the machine and restores it; the next create
restores it without a boot. Both restored VMs show the drawn desktop (its size, colour and
panel) at once, answer exec as themselves (hostname, machine-id), and the second one acts on
input: the demo's scripted agent clicks the panel's Editor launcher, the editor's window is
drawn, the typed line is saved by ctrl+s into the note (read back by exec). That needs both
of docs/backends/vm.md's Templates fixes: the click's button held (vm display.CLICK_HOLD_S)
and the session's X cookie for any host name (the restore renames the guest). Prints the
first create (boot + settle + save + restore) against a restore, and create -> the editor
drawn. desktop_slow (one desktop boot under TCG)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import rollbox
from rollbox.desktop.episode import (
    CPUS, MEMORY_MIB, NOTE_FILE, TEXT, ScriptedAgent, read_note, run_agent, screen,
)
from rollbox.images.sources.desktop import DESKTOP_MODE
from tests.helpers.desktop import desktop_edge_settings

pytestmark = [pytest.mark.desktop_slow, pytest.mark.root, pytest.mark.timeout(3600)]
IMAGE = "desktop:1"


@pytest.fixture
def edge_settings(desktop_disk, tmp_path: Path) -> dict:  # noqa: ANN001
    return desktop_edge_settings("disk", vm_idle_squeeze_s=0,
                                 vm_step_log=tmp_path / "steps.jsonl")


async def test_create_restores_a_drawn_desktop(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    vm = edge.backends["vm"]
    boxes = []
    try:
        async with rollbox.AsyncClient(url, keys.create("proj"), timeout=1800) as client:
            times = []
            for _ in range(2):
                t0 = time.monotonic()
                sb = await client.create(IMAGE, backend="vm", memory_mib=MEMORY_MIB, cpus=CPUS,
                                         ttl_s=1800)
                boxes.append(sb)
                first = await screen(sb)  # the desktop is there when create returns
                times.append(time.monotonic() - t0)
                assert first.is_desktop(), (first.size, first.background(), first.panel())
                assert first.size == DESKTOP_MODE
            kinds = {d["id"]: d["kind"] for d in map(json.loads, edge.settings.vm_step_log
                                                     .read_text().splitlines())}
            assert [kinds[b.id] for b in boxes] == ["restore", "restore"], kinds
            builds = {i: k for i, k in kinds.items() if i.startswith("tplb-")}
            assert list(builds.values()) == ["cold"], kinds  # one desktop boot
            assert len(vm.machine_templates.store.ids()) == 1
            outs = [(await sb.exec("hostname; cat /etc/machine-id")).stdout.split()
                    for sb in boxes]
            assert [o[0] for o in outs] == [b.id for b in boxes]
            assert outs[0][1] != outs[1][1]
            # the restored desktop takes the mouse and the keyboard (the note starts empty)
            assert await read_note(boxes[1], NOTE_FILE) == ""
            at = await run_agent(boxes[1], ScriptedAgent(text=TEXT))
            assert "editor" in at, at
            assert await read_note(boxes[1], NOTE_FILE) == TEXT
            print(f"desktop:1 first create (boot to a settled desktop + save + restore) "
                  f"{times[0]:.1f} s, second create (restore) {times[1]:.1f} s; on it the "
                  f"editor drawn {at['editor']:.1f} s after the agent's first look, the note "
                  f"saved at {at['saved']:.1f} s")
    finally:
        for sb in boxes:
            await edge.delete(sb.id)
        left = vm.machine_templates.clear()
    assert left == []
    for sb in boxes:
        assert edge.leftovers(sb.id) == []
