"""``rollbox demo --backend vm --task desktop`` end to end (issue 16 item 5): two episodes on
real ``desktop:1`` VMs through the api and a real edge (TCG): the honest agent opens the
editor by mouse, types, saves with ctrl+s and is graded 1.0 by the replay in a fresh VM; the
cheater writes the note by exec, its own VM says it won, the grade is 0.0. Four desktop
boots: ``desktop_slow`` only. With ``ROLLBOX_DOCS_SHOTS=1`` the honest episode's step strip
is copied to ``docs/demo-desktop.png`` (looked at by eye: docs/desktop-demo.md); a test run
writes nothing into the checkout otherwise."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rollbox.desktop.episode import run_desktop_episodes
from tests.helpers.desktop import desktop_edge_settings

pytestmark = [pytest.mark.desktop_slow, pytest.mark.root, pytest.mark.timeout(5400)]

REPO = Path(__file__).resolve().parents[2]
STRIP = REPO / "docs" / "demo-desktop.png"


@pytest.fixture
def edge_settings(desktop_disk) -> dict:  # noqa: ANN001
    return desktop_edge_settings("disk")  # the node default: desktops restored


async def test_desktop_demo_end_to_end(edge, api_server, tmp_path: Path) -> None:  # noqa: ANN001
    url, keys = api_server
    summary = await run_desktop_episodes(2, url, keys.create("demo"), out_dir=tmp_path)
    print({k: v for k, v in summary.items() if k != "results"})
    assert not summary["errors"], summary["errors"]
    honest, cheat = summary["results"]
    assert honest["cheat"] == [] and cheat["cheat"] == ["exec-note"]
    assert honest["own_vm_reward"] == 1.0 and honest["reward"] == 1.0, honest
    assert honest["grade"]["replayed"] == 5 and honest["grade"]["note"].startswith(
        summary["text"])
    assert cheat["own_vm_reward"] == 1.0, cheat  # its own VM says the note is right
    assert cheat["reward"] == 0.0 and cheat["grade"]["replayed"] == 0, cheat
    steps = [Path(p).stem.split("-", 2)[2] for p in honest["screenshots"]]
    assert steps == ["1-desktop", "2-editor", "3-typed", "4-saved", "grader-replay"], steps
    assert Path(summary["strip"]).stat().st_size > 0
    if os.environ.get("ROLLBOX_DOCS_SHOTS") == "1":
        shutil.copyfile(summary["strip"], STRIP)
