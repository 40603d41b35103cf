"""The browser grader's parsing of a hostile action log and the host's parsing of the grader's
answer (rollbox.browser.driver / episode), without a browser."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollbox.browser import driver
from rollbox.browser.episode import choose_target, parse_grade
from rollbox.errors import InfraError


def test_input_actions_are_normalised() -> None:
    assert driver.check_action({"type": "click", "x": 10.7, "y": 3}) == \
        {"type": "click", "x": 10, "y": 3}
    assert driver.check_action({"type": "type", "text": "hi"})["text"] == "hi"
    assert driver.check_action({"type": "key", "key": "Enter"})["key"] == "Enter"


@pytest.mark.parametrize("action", [
    {"type": "script", "js": "core.endEpisode(1)"},
    {"type": "navigate", "url": "javascript:core.endEpisode(1)"},
    {"type": "click", "x": 10, "y": 10, "js": "x"},       # extra field
    {"type": "click", "x": True, "y": 10},                # bool is not a coordinate
    {"type": "click", "x": "10", "y": 10},
    {"type": "click", "x": float("nan"), "y": 10},
    {"type": "click", "x": -1, "y": 10},
    {"type": "click", "x": 10, "y": driver.VIEWPORT[1]},
    {"type": "type", "text": "a" * (driver.MAX_TEXT + 1)},
    {"type": "type", "text": "line\nbreak"},
    {"type": "key", "key": "\ue000"},                     # a raw WebDriver code point
    ["click", 1, 2], "click", None,
])
def test_anything_but_an_input_action_is_refused(action: object) -> None:
    with pytest.raises(driver.DriverError):
        driver.check_action(action)


def test_log_bounds(tmp_path: Path) -> None:
    log = tmp_path / "a.jsonl"
    log.write_text("\n".join(json.dumps({"type": "click", "x": 1, "y": 1})
                             for _ in range(driver.MAX_ACTIONS)) + "\n\n")
    assert len(driver.parse_log(log)) == driver.MAX_ACTIONS
    log.write_text(log.read_text() + json.dumps({"type": "key", "key": "Tab"}) + "\n")
    with pytest.raises(driver.DriverError, match="actions"):
        driver.parse_log(log)
    log.write_text(" " * (driver.MAX_LOG_BYTES + 1))
    with pytest.raises(driver.DriverError, match="bytes"):
        driver.parse_log(log)
    for bad in (b"{not json\n", b"[" * 30000 + b"\n", b"\xff\xfe\n"):
        log.write_bytes(bad)
        with pytest.raises(driver.DriverError, match="not JSON"):
            driver.parse_log(log)


def test_task_names_are_checked(tmp_path: Path) -> None:
    (tmp_path / "miniwob").mkdir()
    (tmp_path / "miniwob/click-button.html").write_text("<html></html>")
    (tmp_path / "core").mkdir()
    (tmp_path / "core/core.html").write_text("<html></html>")
    assert driver.validate_task("click-button", str(tmp_path)) == "click-button"
    for bad in ("../core/core", "click-button.html", "", "click button", "click-test",
                "Click-Button", "-click"):
        with pytest.raises(driver.DriverError):
            driver.validate_task(bad, str(tmp_path))


def test_grade_answer_parsing() -> None:
    assert parse_grade('noise\n{"reward": 1.0, "ended": true}\n')["reward"] == 1.0
    for bad in ("", "{}", '{"reward": 2}', '{"reward": true}', '{"reward": "1"}', "[1]",
                '{"reward": 0.5' + " " * 5000 + "}", "not json"):
        with pytest.raises(InfraError):
            parse_grade(bad)


def test_policy_picks_the_named_button() -> None:
    obs = {"query": 'Click on the "Okay" button.', "elements": [
        {"tag": "button", "text": "no", "x": 0, "y": 0, "w": 1, "h": 1},
        {"tag": "div", "text": "Okay", "x": 5, "y": 5, "w": 1, "h": 1},
        {"tag": "button", "text": "Okay", "x": 9, "y": 9, "w": 1, "h": 1}]}
    assert choose_target(obs)["x"] == 9
    assert choose_target({"query": "Click the button.", "elements": obs["elements"][2:]})["x"] == 9
    with pytest.raises(InfraError):
        choose_target({"query": "Click the button.", "elements": obs["elements"]})
