"""The desktop demo's episode logic without a VM (``rollbox.desktop.episode``): the scripted
agent's step planner over screens, the grader's reading of an event log (what it refuses),
the reward, and whole episodes against a fake desktop (a unit test of the code around the
SDK: screens drawn and encoded as PNG, input changing them, an event log recorded as the edge
records it): the honest agent earns 1.0, the cheater that writes the note by exec earns 0.0
although its own VM says it won, and a replay waits for a window slower to open than it was
for the agent."""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from PIL import Image

from rollbox.desktop import episode as ep
from rollbox.models import ComputerAction

W, H = 1024, 768
BG = bytes(ep.BACKGROUND)
GREY = bytes((0xD8, 0xD8, 0xD8))
WHITE, BLACK = b"\xff\xff\xff", b"\0\0\0"


def _rect(buf: bytearray, x0: int, y0: int, x1: int, y1: int, color: bytes) -> None:
    for y in range(y0, y1):
        buf[(y * W + x0) * 3:(y * W + x1) * 3] = color * (x1 - x0)


def draw(window: bool, chars: int) -> Image.Image:
    """The fake desktop: background, the panel, the editor's window, typed text as a bar."""
    buf = bytearray(BG * (W * H))
    _rect(buf, 0, H - ep.PANEL_HEIGHT, W, H, GREY)
    if window:
        _rect(buf, 57, 57, 703, 563, WHITE)
        if chars:
            _rect(buf, 63, 110, 63 + min(600, 8 * chars), 125, BLACK)
    return Image.frombytes("RGB", (W, H), bytes(buf))


def _screen(window: bool = False, chars: int = 0, t: float = 0.0) -> ep.Screen:
    return ep.Screen(draw(window, chars), t)


@dataclass
class Event:
    kind: str
    data: str


class FakeDesktop:
    """One fake desktop VM: a click on the Editor launcher opens the window after
    ``open_after`` screenshots; typed text is drawn when the window is open and has focus;
    ctrl+s saves it to the note. ``exec`` knows reading the note and the cheat's printf."""

    def __init__(self, open_after: int) -> None:
        self.id = f"fake{id(self)}"
        self.open_after, self.clicked_at = open_after, None
        self.shots, self.window, self.buffer, self.note = 0, False, "", ""
        self.log: list[Event] = []
        self._cache: dict[tuple[bool, int], bytes] = {}

    async def screenshot(self) -> bytes:
        self.shots += 1
        if self.clicked_at is not None and self.shots - self.clicked_at >= self.open_after:
            self.window = True
        key = (self.window, len(self.buffer))
        if key not in self._cache:
            self._cache[key] = ep.encode_png(draw(*key), level=1)
        return self._cache[key]

    async def computer(self, a: ComputerAction) -> None:
        if a.action == "click" and 117 <= (a.x or 0) <= 160 and (a.y or 0) > H - 34:
            self.clicked_at = self.shots
        elif a.action == "type" and self.window:
            self.buffer += a.text or ""
        elif a.action == "press" and a.keys == "ctrl+s" and self.window:
            self.note = self.buffer
        rec = a.model_dump(exclude_none=True, exclude={"screenshot_hash"})
        rec.update(display={"width": W, "height": H}, events=1, ts=time.time())
        self.log.append(Event(f"computer.{a.action}", json.dumps(rec)))

    async def exec(self, cmd: Any, **kw: Any) -> Any:
        @dataclass
        class R:
            exit_code: int
            stdout: str = ""
            stderr: str = ""
        if isinstance(cmd, list) and cmd[0] == "head" and cmd[-1] == ep.NOTE_FILE:
            return R(0, self.note)
        if isinstance(cmd, str) and cmd.startswith("printf %s "):
            self.note = shlex.split(cmd)[2]
            return R(0)
        return R(127, stderr="not in the fake")

    async def events(self) -> list[Event]:
        return list(self.log)

    async def delete(self) -> None:
        pass


class FakeClient:
    def __init__(self, open_after: list[int]) -> None:
        self.open_after = list(open_after)
        self.made: list[FakeDesktop] = []

    async def create(self, image: str, **kw: Any) -> FakeDesktop:
        assert image == ep.DESKTOP_IMAGE and kw["backend"] == "vm"
        self.made.append(FakeDesktop(self.open_after.pop(0)))
        return self.made[-1]


@pytest.fixture
def fast(monkeypatch):  # noqa: ANN201
    for name in ("POLL_S", "SETTLE_S", "SAVE_S"):
        monkeypatch.setattr(ep, name, 0.0)
    monkeypatch.setattr(ep, "NOTE_WAIT_S", 0.2)


# ---- the planner -----------------------------------------------------------------------------

def test_the_planner_steps_through_the_task() -> None:
    agent = ep.ScriptedAgent(text="hi there")
    text_mode = ep.Screen(Image.new("RGB", (720, 400)), 0.0)
    assert agent.step(text_mode) == [] and agent.state == "desktop"  # still booting
    launcher = (ep.EDITOR_X, H - ep.PANEL_HEIGHT // 2)
    acts = agent.step(_screen(t=1))  # onto the launcher, the click on the next look
    assert [(a.action, a.x, a.y) for a in acts] == [("move", *launcher)]
    assert agent.milestone == "desktop"
    acts = agent.step(_screen(t=2))
    assert [(a.action, a.x, a.y) for a in acts] == [("click", *launcher)]
    acts = agent.step(_screen(t=2.5))  # then off the panel
    assert [(a.action, a.x, a.y) for a in acts] == [("move", *ep.POINTER_PARK)]
    assert agent.step(_screen(t=3)) == []                       # no window yet
    assert agent.step(_screen(window=True, t=3)) == [] and agent.state == "settle"
    assert agent.step(_screen(window=True, t=3 + ep.SETTLE_S / 2)) == []
    acts = agent.step(_screen(window=True, t=4 + ep.SETTLE_S))
    assert [(a.action, a.text) for a in acts] == [("type", "hi there")]
    assert agent.milestone == "editor"
    assert agent.step(_screen(window=True, t=10)) == []          # not drawn yet
    acts = agent.step(_screen(window=True, chars=8, t=11))
    assert [(a.action, a.keys) for a in acts] == [("press", "ctrl+s")]
    assert agent.step(_screen(window=True, chars=8, t=12)) == [] and not agent.done
    agent.step(_screen(window=True, chars=8, t=12 + ep.SAVE_S))
    assert agent.done and agent.milestone == "saved"


def test_the_planner_answers_a_save_dialog_and_gives_up_in_time() -> None:
    agent = ep.ScriptedAgent(text="x", state="saving", since=0.0, ref=draw(True, 1))
    dialog = _screen(window=False, t=1)  # most of the screen changed: a dialog
    acts = agent.step(dialog)
    assert [(a.action, a.text or a.keys) for a in acts] == [("type", ep.NOTE_FILE),
                                                           ("press", "enter")]
    stuck = ep.ScriptedAgent()
    stuck.step(_screen(window=True, t=0.0))  # never the bare desktop
    with pytest.raises(ep.InfraError, match="waited"):
        stuck.step(_screen(window=True, t=ep.DESKTOP_WAIT_S + 1))


def test_screen_stats() -> None:
    assert _screen().is_desktop() and not _screen(window=True).background() > 0.7
    assert ep.changed_pixels(draw(True, 0), draw(True, 3)) >= ep.TEXT_PIXELS
    assert ep.changed_pixels(draw(True, 3), draw(True, 3)) == 0
    assert ep.changed_pixels(draw(False, 0), Image.new("RGB", (1, 1))) == W * H


# ---- the grader's reading of the log ---------------------------------------------------------

def _ev(action: dict, ts: float = 1.0, kind: str | None = None, **extra: Any) -> Event:
    return Event(kind or f"computer.{action['action']}",
                 json.dumps({**action, "ts": ts, "display": {"width": W, "height": H},
                             "events": 2, **extra}))


def test_replay_actions_reads_the_input_record() -> None:
    log = [Event("sandbox.created", "{}"), _ev({"action": "click", "x": 1, "y": 2}, 1.0),
           Event("computer.screenshot", json.dumps({"bytes": 1, "sha256": "x"})),
           Event("exec.started", "{}"), _ev({"action": "type", "text": "a"}, 2.0,
                                            screenshot_sha256="ab")]
    got = ep.replay_actions(log)
    assert [(t, a.action) for t, a in got] == [(1.0, "click"), (2.0, "type")]
    assert got[1][1].text == "a"


@pytest.mark.parametrize("log,why", [
    ([_ev({"action": "click", "x": W, "y": 0})], "off the"),
    ([_ev({"action": "drag", "x": 0, "y": 0, "x2": 5, "y2": -1})], "off the"),
    ([_ev({"action": "type", "text": "a"}, 2.0), _ev({"action": "type", "text": "b"}, 1.0)],
     "time"),
    ([_ev({"action": "type", "text": "a"}, kind="computer.press")], "records a"),
    ([_ev({"action": "press", "keys": "a", "script": "x"})], "not a valid"),
    ([Event("computer.type", "[1]")], "not a valid"),
    ([Event("computer.type", "{")], "not a valid"),
    ([Event("computer.paste", "{}")], "not an input action"),
    ([_ev({"action": "move", "x": 1, "y": 1}, float(i)) for i in range(65)], "more than"),
])
def test_replay_actions_refuses(log: list[Event], why: str) -> None:
    with pytest.raises(ep.Refused, match=why):
        ep.replay_actions(log)


def test_reward() -> None:
    assert ep.reward_of("hello", "hello") == ep.reward_of("hello\n", "hello") == 1.0
    for note in ("", "hello\n\n", "hell", "hello world", " hello"):
        assert ep.reward_of(note, "hello") == 0.0


# ---- whole episodes on the fake desktop ------------------------------------------------------

async def test_honest_and_cheating_episodes(fast, tmp_path: Path) -> None:  # noqa: ANN001
    timings = {k: [] for k in ("create", "desktop", "act", "grade", "episode")}
    # the grader's window opens 3x slower than the agent's did: the replay waits for it
    client = FakeClient([2, 6, 2, 2])
    honest = await ep.episode(client, 0, text="a note", out_dir=tmp_path, timings=timings)
    assert honest["own_vm_reward"] == 1.0 and honest["reward"] == 1.0
    assert honest["grade"]["replayed"] == 5  # move, click, move, type, ctrl+s
    names = [Path(p).stem for p in honest["screenshots"]]
    assert names == ["desktop-0-1-desktop", "desktop-0-2-editor", "desktop-0-3-typed",
                     "desktop-0-4-saved", "desktop-0-grader-replay"]
    cheat = await ep.episode(client, 1, text="a note", out_dir=tmp_path, timings=timings,
                             cheat=True)
    assert cheat["own_vm_reward"] == 1.0  # its own VM says the note is right
    assert cheat["reward"] == 0.0 and cheat["grade"]["replayed"] == 0
    assert [d.note for d in client.made] == ["a note", "a note", "a note", ""]
    strip = ep.write_strip(honest["screenshots"], tmp_path / "strip.png")
    img = ep.decode_png(strip.read_bytes())
    assert img.size == (3 * W // 2 + 4 * 8, 2 * H // 2 + 3 * 8)  # 2 rows of 3


async def test_a_replay_of_a_wrong_text_earns_nothing(fast) -> None:  # noqa: ANN001
    src = FakeDesktop(1)
    src.window = True
    await src.computer(ComputerAction(action="click", x=ep.EDITOR_X, y=H - 17))
    await src.computer(ComputerAction(action="type", text="not it"))
    await src.computer(ComputerAction(action="press", keys="ctrl+s"))
    g = await ep.grade_by_replay(FakeClient([1]), await src.events(), "the text")
    assert g["reward"] == 0.0 and g["note"] == "not it"
