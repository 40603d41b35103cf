"""Browser tier (``pytest -m browser``): MiniWoB++ episodes in ``browser:1`` sandboxes driven by
input actions only, graded by replay in a fresh sandbox (rollbox.browser.episode).

Each cheat is tested on its own against the defence that stops it: a score set by script in the
agent's own page (the grader never reads that page), a script entry forged into the action log
(the grader refuses any log with a non-input action, so a correct click beside it is worth 0).
On a microVM (TCG here: a cold chromium takes minutes) one honest and one cheating episode."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollbox.browser.episode import (
    ACTIONS, BROWSER_TB_MIB, CHEATS, DRIVER, STEP_TIMEOUT_S, episode, parse_grade,
)
from rollbox.browser.image import ensure_browser_image
from rollbox.config import Settings
from rollbox.images.store import ImageStore
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.browser, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc"),
              pytest.mark.timeout(1800)]
PNG = b"\x89PNG\r\n\x1a\n"
needs_microvm = pytest.mark.skipif(
    not Settings().vm_initrd.is_file() or not Settings().vm_jailer.is_file()
    or not have_image("python:3.11"), reason="no guest or jailer (make guest native)")


@pytest.fixture
def edge_settings() -> dict:
    # TCG (the KVM probe has its own slow test), chromium-sized translation cache
    return {"vm_accel": "tcg", "vm_tb_size_mib": BROWSER_TB_MIB}


@pytest.fixture(scope="session")
def browser_image() -> str:
    """Built once by this tier into the node's image store (the default tier never builds it)."""
    return ensure_browser_image(ImageStore(Settings().images_dir), log=lambda _m: None)


def _timings() -> dict[str, list[float]]:
    return {k: [] for k in ("create", "browser_start", "act", "grade", "episode")}


@pytest.fixture
async def client(api_server, browser_image):  # noqa: ANN001, ANN201
    url, keys = api_server
    async with AsyncClient(base_url=url, api_key=keys.create("browser"),
                           timeout=STEP_TIMEOUT_S) as c:
        yield c


def _assert_rewarded(r: dict) -> None:
    assert r["page_said_reward"] == 1, r
    assert r["reward"] == 1.0 and r["grade"]["ended"] and r["grade"]["actions_replayed"] == 1, r
    for shot in r["screenshots"]:
        data = Path(shot).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, shot


@pytest.mark.parametrize("task", ["click-button", "click-test"])
async def test_honest_agent_is_rewarded(client, task: str, tmp_path: Path) -> None:  # noqa: ANN001
    _assert_rewarded(await episode(client, 0, backend="container", task=task, seed=7,
                                   out_dir=tmp_path, timings=_timings()))


@needs_microvm
@pytest.mark.timeout(3600)
async def test_microvm_honest_rewarded_cheater_zero(client, tmp_path: Path) -> None:  # noqa: ANN001
    """The demo's two episodes on microVMs: the grader is a fresh microVM that replays the log."""
    _assert_rewarded(await episode(client, 0, backend="microvm", task="click-button", seed=11,
                                   out_dir=tmp_path, timings=_timings()))
    r = await episode(client, 1, backend="microvm", task="click-button", seed=12,
                      out_dir=tmp_path, timings=_timings(), cheats=CHEATS)
    assert r["page_said_reward"] == 1 and r["reward"] == 0.0, r


async def test_score_set_by_script_gets_zero(client, tmp_path: Path) -> None:  # noqa: ANN001
    r = await episode(client, 1, backend="container", task="click-button", seed=7,
                      out_dir=tmp_path, timings=_timings(), cheats=frozenset({"script-score"}))
    assert r["page_said_reward"] == 1, r  # the agent's own page was fooled...
    assert r["reward"] == 0.0 and "refused" not in r["grade"], r  # ...the replay was not
    assert r["grade"]["actions"] == 0 and not r["grade"]["ended"], r


async def test_forged_script_action_refuses_the_log(client, tmp_path: Path) -> None:  # noqa: ANN001
    r = await episode(client, 2, backend="container", task="click-button", seed=7,
                      out_dir=tmp_path, timings=_timings(), cheats=frozenset({"forged-log"}))
    assert r["page_said_reward"] == 1, r  # its click was right: without the forgery, 1.0
    assert r["reward"] == 0.0 and "not an input action" in r["grade"]["refused"], r


async def test_grader_stops_at_a_click_off_the_page(client) -> None:  # noqa: ANN001
    """A log the parser accepts but chromium can't perform (below the viewport) is the log's
    fault: reward 0 with the reason, not a grader failure."""
    sb = await client.create("browser:1", memory_mib=2048)
    try:
        await sb.files.write(ACTIONS, '{"type": "click", "x": 10, "y": 399}\n')
        g = await sb.grade(f"{DRIVER} grade --task click-test --seed 1 --actions {ACTIONS}",
                           files=[ACTIONS], timeout=600)
    finally:
        await sb.delete()
    assert g.result.exit_code == 0, g.result
    out = parse_grade(g.result.stdout)
    assert out["reward"] == 0.0 and "replay stopped at action 0" in out["stopped"], out
