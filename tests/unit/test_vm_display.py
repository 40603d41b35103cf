"""backends/vm/display.py without a VM: the QMP input events an action becomes (pointer
scaled to QEMU's 0..32767 axes, chords, typed text batched with a key at most once per batch)
and the typed refusals that send nothing."""
from __future__ import annotations

import pytest

from rollbox.backends.vm import display
from rollbox.errors import BadRequest, InfraError
from rollbox.models import ComputerAction

SIZE = (1280, 800)


def test_click_is_scaled_to_the_absolute_axes() -> None:
    batches = display.plan(ComputerAction(action="click", x=1279, y=0, button="right"), SIZE,
                           100)
    assert batches[0][0]["data"] == {"axis": "x", "value": display.ABS_MAX}
    assert batches[0][1]["data"] == {"axis": "y", "value": 0}
    assert batches[0][2] == {"type": "btn", "data": {"down": True, "button": "right"}}
    assert batches[1] == [{"type": "btn", "data": {"down": False, "button": "right"}}]


def test_chord_and_typed_text() -> None:
    (batch,) = display.plan(ComputerAction(action="press", keys="ctrl+s"), SIZE, 100)
    assert [(e["data"]["key"]["data"], e["data"]["down"]) for e in batch] == [
        ("ctrl", True), ("s", True), ("s", False), ("ctrl", False)]
    batches = display.plan(ComputerAction(action="type", text="Hello"), SIZE, 100)
    typed = [[e["data"]["key"]["data"] for e in b if e["data"]["down"]] for b in batches]
    assert typed == [["shift", "h", "e", "l"], ["l", "o"]]  # "ll" split across batches
    assert display.char_keys("?") == ("slash", True) and display.char_keys("\n") == ("ret", False)


def test_a_pressed_button_is_held_before_it_is_let_go() -> None:
    # JWM's tray drops a release that comes while it handles the press: a click holds
    def pauses(action: ComputerAction) -> list[float]:
        batches = display.plan(action, SIZE, 100)
        return [display.pause_after(action.action, b) for b in batches[:-1]]

    hold, gap = display.CLICK_HOLD_S, display.CLICK_GAP_S / 2
    assert hold >= 0.3  # JWM's press handling took 208 ms under TCG at load 10-15
    assert pauses(ComputerAction(action="click", x=5, y=5)) == [hold]
    quick = display.DOUBLE_CLICK_HOLD_S  # both presses within a double-click time (400 ms)
    assert pauses(ComputerAction(action="double_click", x=5, y=5)) == [quick, gap, quick]
    assert 2 * quick + gap < 0.2
    assert pauses(ComputerAction(action="drag", x=5, y=5, x2=9, y2=9)) == [0.0, hold, 0.0]
    assert pauses(ComputerAction(action="scroll", x=5, y=5, dy=2)) == [0.0, 0.0, 0.0, 0.0]
    assert set(pauses(ComputerAction(action="type", text="hello"))) == {display.TYPE_PAUSE_S}


def test_a_persons_input_in_the_live_view_is_not_paced() -> None:
    # The viewer's press and release of one read arrive as consecutive batches: holding the
    # button there would stretch a person's double click past the double-click time.
    press = [{"type": "btn", "data": {"down": True, "button": "left"}}]
    assert display.pause_after("click", press) == display.CLICK_HOLD_S
    assert display.pause_after(display.VIEW_INPUT, press) == 0.0


@pytest.mark.parametrize("action, why", [
    (ComputerAction(action="move", x=1280, y=0), "outside the 1280x800"),
    (ComputerAction(action="press", keys="hyper+x"), "unknown key"),
    (ComputerAction(action="press", keys="ctrl+ctrl"), "repeats"),
    (ComputerAction(action="type", text="\x1b"), "can not type"),
    (ComputerAction(action="type", text="abc"), "at most 2"),
])
def test_refusals(action: ComputerAction, why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        display.plan(action, SIZE, 2)


def test_png_checks() -> None:
    ihdr = display.PNG_SIGNATURE + b"\0\0\0\rIHDR" + (640).to_bytes(4, "big") + \
        (480).to_bytes(4, "big") + b"\x08\x02\0\0\0" + b"\0" * 4
    assert display.png_size(ihdr) == (640, 480)
    with pytest.raises(InfraError):
        display.png_size(b"GIF89a" + b"\0" * 40)
    with pytest.raises(InfraError):
        display.png_size(ihdr[:16] + (0).to_bytes(4, "big") + ihdr[20:])
