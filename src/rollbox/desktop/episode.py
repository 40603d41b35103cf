"""``rollbox demo --backend vm --task desktop``: computer-use episodes on ``desktop:1`` VMs,
graded by replaying the platform's record of the agent's input in a fresh VM.

The task: write a given text into the note (``/home/user/note.txt``) with the desktop's text
editor and save it. One episode, all through the SDK:

1. the environment: ``client.create("desktop:1", backend="vm")``, a Debian desktop (JWM, a
   panel of launchers at the bottom, mousepad behind "Editor" opening the note);
2. the scripted agent (:class:`ScriptedAgent`) sees only screenshots (``sandbox.screenshot()``,
   decoded by :func:`decode_png`, Pillow's PNG decoder with a size bound) and acts only with
   ``sandbox.computer`` (mouse and keyboard): waits for the desktop to be drawn, moves onto
   the panel's Editor launcher and clicks it, moves the pointer off the panel, waits for the
   window,
   types the text, waits for it to be drawn, presses ctrl+s (a save dialog, should one open:
   types the path and Enter) and waits for the save; the screenshot of each step is written
   to the output folder;
3. the grader (:func:`grade_by_replay`): reads the source sandbox's **event log** (the
   edge's record of every input action it sent to that VM's QEMU, with its time: the guest
   can not write it), checks it (known input actions only, bounded count, coordinates on the
   desktop's screen; anything else refuses the whole log), boots a FRESH desktop VM from the
   pristine base disk, replays the actions there with the recorded gaps (after a click it
   also waits for 1 % of the screen to change: a window may take longer to open than it did
   for the agent; a click with no such effect costs the replay EFFECT_WAIT_S), and reads the
   note in that VM. Reward 1.0 iff the note holds the text.

What "cheating" is here, and why the grader catches it: the task is to operate the GUI, and
the agent's channel reaches its own VM as root: it can write the note with ``exec`` (or draw
anything on its screen, or fake its agent's answers). :data:`CHEAT` writes the note by exec
and never touches the GUI; its own VM then says the note is right. Nothing of the source VM
is read for the reward: not its disk (a disk snapshot would carry the exec'd note, so a
"fresh check of the saved file" from a copy of the source disk could not catch this cheat),
not its screen, not its agent. The reward's only input is the platform's input record, which
the agent can extend only by really sending input; the fresh VM's note is then the effect of
that input alone. The fresh VM's answer is guest-reported, by a guest that only ever saw the
replayed input (the browser demo's argument).

Owns the episode, the policy, the grader, the screenshots' decoding and the strip; goes through
the SDK only.
"""
from __future__ import annotations

import asyncio
import io
import json
import shlex
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops
from pydantic import ValidationError

from rollbox.benchkit import percentile
from rollbox.errors import BadRequest, InfraError
from rollbox.images.sources.desktop import DESKTOP_IMAGE, DESKTOP_MODE, NOTE_FILE
from rollbox.models import ComputerAction

TEXT = "hello from rollbox"
BACKGROUND = (0x3A, 0x6E, 0xA5)  # the desktop's colour (the image's jwmrc)
PANEL_HEIGHT = 34  # the panel at the bottom (jwmrc Tray height)
EDITOR_X = 138  # the Editor launcher's centre (DejaVu Sans 11 labels: Menu, Terminal, Editor)
POINTER_PARK = (900, 300)  # on the desktop, right of where the editor's window opens
MEMORY_MIB, CPUS = 1024, 2  # a desktop VM (Xorg, JWM, mousepad)
POLL_S = 1.0  # between the agent's screenshots
# How long the agent waits for each thing it waits for (TCG on a loaded host).
DESKTOP_WAIT_S = 900.0  # boot to a drawn desktop
WINDOW_WAIT_S = 240.0   # the editor's window after the click
TEXT_WAIT_S = 120.0     # the typed text drawn
SETTLE_S = 3.0          # a new window gets this long before the keyboard is used
SAVE_S = 5.0            # after ctrl+s (and after a save dialog's Enter)
WINDOW_DROP = 0.03      # a window opened: this much less of the screen is background
TEXT_PIXELS = 200       # typed text drawn: at least this many pixels changed
DIALOG_FRACTION = 0.05  # after ctrl+s this much of the screen changed: a dialog opened
# The grader.
MAX_REPLAY_ACTIONS = 64
MAX_GAP_S = 120.0       # a recorded gap longer than this is replayed as this
EFFECT_WAIT_S = 240.0   # after a replayed click: the screen changes within this
EFFECT_FRACTION = 0.01  # ... by at least this much of it
NOTE_WAIT_S = 30.0      # the replayed save reaches the note within this
MAX_NOTE_BYTES = 4096   # what the grader reads of the note
REPLAYED = frozenset({"move", "click", "double_click", "drag", "scroll", "type", "press"})
CLICKS = frozenset({"click", "double_click"})
# The cheat: the note written by exec, the GUI never touched.
CHEAT = "exec-note"
MAX_PIXELS = 4096 * 4096  # a screenshot larger than this is refused before it is inflated
STRIP_GAP, STRIP_BACKGROUND = 8, (32, 32, 32)  # around each screenshot of the step strip


def cheat_command(text: str) -> str:
    return f"printf %s {shlex.quote(text)} > {NOTE_FILE} && chown 1000:1000 {NOTE_FILE}"


# ---- what the agent sees ---------------------------------------------------------------------

def decode_png(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The RGB pixels (alpha dropped) of a screenshot's PNG, decoded as hostile input (it is
    the agent's VM's screen, and this runs in the demo's client process: the platform itself
    never decodes one, backends/vm/display.py): only Pillow's PNG decoder is tried, the
    header's size is checked against ``max_pixels`` before anything is inflated (Pillow's own
    ``Image.MAX_IMAGE_PIXELS`` bomb check refuses far larger ones while opening), and inflation
    stops at the pixels the header promised. Anything else: a typed BadRequest."""
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as im:
            w, h = im.size
            if not 0 < w * h <= max_pixels:
                raise BadRequest(f"PNG of {w}x{h} pixels: over {max_pixels}", reason="png")
            im.load()
            return im if im.mode == "RGB" else im.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, struct.error,
            Image.DecompressionBombError) as e:
        raise BadRequest(f"not a PNG that decodes: {e}", reason="png") from e


def encode_png(img: Image.Image, level: int = 9) -> bytes:
    """``img`` as PNG bytes (zlib ``level``)."""
    out = io.BytesIO()
    img.save(out, "PNG", compress_level=level)
    return out.getvalue()


@dataclass(frozen=True)
class Screen:
    """One screenshot as the agent sees it (RGB), with when it was taken."""
    img: Image.Image
    t: float

    @property
    def size(self) -> tuple[int, int]:
        return self.img.size

    def background(self) -> float:
        """Fraction of the screen in the desktop's colour."""
        w, h = self.img.size
        counts = {color: n for n, color in self.img.getcolors(w * h)}
        return counts.get(BACKGROUND, 0) / (w * h)

    def panel(self) -> float:
        """Fraction of a row inside the bottom panel that is light grey (the tray)."""
        w, h = self.img.size
        row = self.img.crop((0, h - 8, w, h - 7)).tobytes()
        grey = sum(1 for i in range(0, len(row), 3)
                   if min(row[i:i + 3]) >= 0xC0 and max(row[i:i + 3]) - min(row[i:i + 3]) < 16)
        return grey / w

    def is_desktop(self) -> bool:
        """The session is drawn: the desktop's size, mostly its colour, the panel."""
        return (self.size == DESKTOP_MODE and self.background() > 0.5
                and self.panel() > 0.2)


def changed_pixels(a: Image.Image, b: Image.Image) -> int:
    """Pixels that differ (in any channel) between two RGB screens of one size; a different
    size counts as all changed."""
    if a.size != b.size:
        return a.width * a.height
    r, g, bl = ImageChops.difference(a, b).split()
    return a.width * a.height - ImageChops.lighter(ImageChops.lighter(r, g), bl).histogram()[0]


# ---- the policy ------------------------------------------------------------------------------

@dataclass
class ScriptedAgent:
    """The honest agent: a state machine over screenshots. :meth:`step` takes the newest
    screen and answers the input actions to send now; ``milestone`` names the screen just
    seen when it is one of the episode's steps (for the strip); ``done`` at the end."""
    text: str = TEXT
    note_file: str = NOTE_FILE
    state: str = "desktop"
    done: bool = False
    milestone: str | None = None
    since: float | None = None  # when the current state began
    ref: Image.Image | None = None  # the screen the current state compares with
    ref_background: float = 0.0
    parked: bool = False  # the pointer left the panel after the click
    log: list[str] = field(default_factory=list)

    WAITS = {"desktop": DESKTOP_WAIT_S, "click": WINDOW_WAIT_S, "editor": WINDOW_WAIT_S, "settle": WINDOW_WAIT_S,
             "typed": TEXT_WAIT_S, "saving": TEXT_WAIT_S, "dialog": TEXT_WAIT_S}

    def _to(self, state: str, s: Screen) -> None:
        self.log.append(f"{s.t:.1f} {self.state} -> {state}")
        self.state, self.since = state, s.t

    def step(self, s: Screen) -> list[ComputerAction]:
        self.milestone = None
        if self.done:
            return []
        if self.since is None:
            self.since = s.t
        if s.t - self.since > self.WAITS[self.state]:
            raise InfraError(f"the scripted agent waited {self.WAITS[self.state]:.0f} s in "
                             f"state {self.state!r} and saw nothing it waits for")
        w, h = s.size
        launcher = (EDITOR_X, h - PANEL_HEIGHT // 2)
        if self.state == "desktop":
            if not s.is_desktop():
                return []
            self.milestone, self.ref_background = "desktop", s.background()
            self._to("click", s)
            # as a hand does: onto the launcher first, the click on the next look, off the
            # panel on the one after (a click's button is held: vm display.CLICK_HOLD_S, else
            # JWM's tray drops the release and runs nothing)
            return [ComputerAction(action="move", x=launcher[0], y=launcher[1])]
        if self.state == "click":
            self._to("editor", s)
            return [ComputerAction(action="click", x=launcher[0], y=launcher[1])]
        if self.state == "editor":
            if not self.parked:
                # off the panel after the click: resting there the pointer keeps the
                # launcher's tooltip up, pixels that change while the agent compares screens
                self.parked = True
                return [ComputerAction(action="move", x=POINTER_PARK[0], y=POINTER_PARK[1])]
            if s.size == DESKTOP_MODE and s.background() < self.ref_background - WINDOW_DROP:
                self._to("settle", s)
            return []
        if self.state == "settle":
            if s.t - self.since < SETTLE_S:
                return []
            self.milestone, self.ref = "editor", s.img
            self._to("typed", s)
            return [ComputerAction(action="type", text=self.text)]
        if self.state == "typed":
            assert self.ref is not None
            if changed_pixels(self.ref, s.img) < TEXT_PIXELS:
                return []
            self.milestone, self.ref = "typed", s.img
            self._to("saving", s)
            return [ComputerAction(action="press", keys="ctrl+s")]
        if self.state == "saving":
            assert self.ref is not None
            if changed_pixels(self.ref, s.img) > DIALOG_FRACTION * w * h:
                self.milestone = "save-dialog"
                self._to("dialog", s)
                return [ComputerAction(action="type", text=self.note_file),
                        ComputerAction(action="press", keys="enter")]
            if s.t - self.since >= SAVE_S:
                self.milestone, self.done = "saved", True
                self._to("done", s)
            return []
        if self.state == "dialog":
            if s.t - self.since >= SAVE_S:
                self.milestone, self.done = "saved", True
                self._to("done", s)
            return []
        raise AssertionError(self.state)


# ---- the grader ------------------------------------------------------------------------------

class Refused(Exception):
    """The action log is not one the grader replays (the reason is the message)."""


def replay_actions(events: Iterable[Any], size: tuple[int, int] = DESKTOP_MODE
                   ) -> list[tuple[float, ComputerAction]]:
    """The input actions of a sandbox's event log (``computer.<action>`` events, written by
    the edge as it sent them), in order, with their times; screenshots skipped. Refused: an
    action the grader does not replay, a record that is not a valid action of its own kind,
    coordinates off ``size``, times going backwards, more than MAX_REPLAY_ACTIONS."""
    out: list[tuple[float, ComputerAction]] = []
    for ev in events:
        kind = str(getattr(ev, "kind", ""))
        if not kind.startswith("computer.") or kind == "computer.screenshot":
            continue
        name = kind[len("computer."):]
        if name not in REPLAYED:
            raise Refused(f"event {kind} is not an input action the grader replays")
        try:
            rec = json.loads(ev.data)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
            ts = rec.pop("ts")
            for k in ("display", "events", "screenshot_sha256"):
                rec.pop(k, None)
            action = ComputerAction.model_validate(rec)
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            raise Refused(f"event {kind} is not a valid action record: "
                          f"{type(exc).__name__}") from None
        if action.action != name:
            raise Refused(f"event {kind} records a {action.action!r} action")
        if (not isinstance(ts, int | float) or isinstance(ts, bool)
                or (out and ts < out[-1][0])):
            raise Refused(f"event {kind}: its time is not after the one before")
        for x, y in ((action.x, action.y), (action.x2, action.y2)):
            if x is not None and not 0 <= x < size[0] or y is not None and not 0 <= y < size[1]:
                raise Refused(f"event {kind}: ({x}, {y}) is off the {size[0]}x{size[1]} screen")
        out.append((float(ts), action))
        if len(out) > MAX_REPLAY_ACTIONS:
            raise Refused(f"more than {MAX_REPLAY_ACTIONS} input actions")
    return out


def reward_of(note: str, text: str) -> float:
    """1.0 iff the note holds the text (a final newline an editor adds aside)."""
    return 1.0 if note.removesuffix("\n") == text else 0.0


async def screen(sb: Any) -> Screen:
    data = await sb.screenshot()
    return Screen(decode_png(data), time.monotonic())


async def wait_desktop(sb: Any, timeout: float = DESKTOP_WAIT_S) -> Screen:
    t0 = time.monotonic()
    while True:
        s = await screen(sb)
        if s.is_desktop():
            return s
        if time.monotonic() - t0 > timeout:
            raise InfraError(f"no desktop drawn in {timeout:.0f} s")
        await asyncio.sleep(POLL_S)


async def _screen_changes(sb: Any, before: bytes, timeout: float) -> bool:
    """Whether within ``timeout`` at least EFFECT_FRACTION of the screen differs from
    ``before`` (a window, a menu: a click's effect, not a tooltip or a cursor)."""
    old = decode_png(before)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        await asyncio.sleep(POLL_S / 2)
        now = decode_png(await sb.screenshot())
        if changed_pixels(old, now) >= EFFECT_FRACTION * old.width * old.height:
            return True
    return False


async def read_note(sb: Any, path: str = NOTE_FILE) -> str:
    r = await sb.exec(["head", "-c", str(MAX_NOTE_BYTES), path], timeout=60)
    return r.stdout if r.exit_code == 0 else ""


async def grade_by_replay(client: Any, events: list[Any], text: str, *,
                          shots: list[bytes] | None = None) -> dict[str, Any]:
    """The reward of an episode whose input record is ``events`` (the source sandbox's event
    log): its actions replayed in a fresh desktop VM, the note read there. ``shots`` gets
    the replay's final screen."""
    try:
        actions = replay_actions(events)
    except Refused as exc:
        return {"reward": 0.0, "refused": str(exc), "replayed": 0}
    sb = await client.create(DESKTOP_IMAGE, backend="vm", memory_mib=MEMORY_MIB, cpus=CPUS,
                             ttl_s=3600, labels={"job": "demo-desktop", "role": "grader"})
    try:
        await wait_desktop(sb)
        t_prev = mono_prev = None
        for ts, action in actions:
            if t_prev is not None and mono_prev is not None:
                gap = min(ts - t_prev, MAX_GAP_S) - (time.monotonic() - mono_prev)
                if gap > 0:
                    await asyncio.sleep(gap)
            before = await sb.screenshot() if action.action in CLICKS else b""
            await sb.computer(action)
            t_prev, mono_prev = ts, time.monotonic()
            if before and await _screen_changes(sb, before, EFFECT_WAIT_S):
                await asyncio.sleep(SETTLE_S)
        t0, note = time.monotonic(), ""
        while True:
            note = await read_note(sb)
            if reward_of(note, text) or time.monotonic() - t0 > NOTE_WAIT_S:
                break
            await asyncio.sleep(POLL_S)
        if shots is not None:  # the editor may redraw its title (saved) after the write
            await asyncio.sleep(SAVE_S)
            shots.append(await sb.screenshot())
    finally:
        await sb.delete()
    return {"reward": reward_of(note, text), "refused": None, "replayed": len(actions),
            "note": note[:200]}


# ---- one episode -----------------------------------------------------------------------------

def _save(out_dir: Path, name: str, data: bytes) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / f"{name}.png"
    p.write_bytes(data)
    return p


async def run_agent(sb: Any, agent: ScriptedAgent,
                    on_milestone: Callable[[str, bytes], None] | None = None
                    ) -> dict[str, float]:
    """Drive ``sb`` by ``agent`` (screenshots in, actions out) until it is done; the seconds
    from the start to each milestone (``desktop``, ``editor``: its window drawn after the
    click, ``typed``, ``saved``...), each milestone's screenshot to ``on_milestone``."""
    t0 = time.monotonic()
    at: dict[str, float] = {}
    while True:
        data = await sb.screenshot()
        actions = agent.step(Screen(decode_png(data), time.monotonic()))
        if agent.milestone:
            at[agent.milestone] = time.monotonic() - t0
            if on_milestone is not None:
                on_milestone(agent.milestone, data)
        for a in actions:
            await sb.computer(a)
        if agent.done:
            return at
        await asyncio.sleep(POLL_S)


async def episode(client: Any, i: int, *, text: str, out_dir: Path,
                  timings: dict[str, list[float]], cheat: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    mine: dict[str, float] = {}

    def took(what: str, since: float) -> None:
        mine[what] = round(time.monotonic() - since, 3)
        timings[what].append(mine[what])

    sb = await client.create(DESKTOP_IMAGE, backend="vm", memory_mib=MEMORY_MIB, cpus=CPUS,
                             ttl_s=3600, labels={"job": "demo-desktop", "episode": str(i)})
    took("create", t0)
    shots: list[str] = []
    try:
        t = time.monotonic()
        await wait_desktop(sb)
        took("desktop", t)
        t = time.monotonic()
        if cheat:
            r = await sb.exec(cheat_command(text))
            if r.exit_code != 0:
                raise InfraError(f"the cheat failed: {r.stderr[-300:]}")
            shots.append(str(_save(out_dir, f"desktop-{i}-cheat", await sb.screenshot())))
        else:
            def shot(milestone: str, data: bytes) -> None:
                n = len(shots) + 1
                shots.append(str(_save(out_dir, f"desktop-{i}-{n}-{milestone}", data)))

            await run_agent(sb, ScriptedAgent(text=text), shot)
        took("act", t)
        # what the agent's own VM says (guest-reported: the agent's to fake)
        own = await read_note(sb)
    finally:
        await sb.delete()
    t = time.monotonic()
    events = await sb.events()  # the edge's record, kept after deletion
    final: list[bytes] = []
    graded = await grade_by_replay(client, events, text, shots=final)
    took("grade", t)
    if final:
        shots.append(str(_save(out_dir, f"desktop-{i}-grader-replay", final[0])))
    took("episode", t0)
    return {"episode": i, "cheat": [CHEAT] if cheat else [], "own_vm_reward": reward_of(own, text),
            "reward": graded["reward"], "grade": graded, "screenshots": shots,
            "timings_s": mine}


def write_strip(paths: list[str], dest: Path, factor: int = 2, columns: int = 3) -> Path:
    """The screenshots (PNG files) in rows of ``columns``, each scaled down by ``factor``
    (block averages: the editor's text stays legible at 2), as one PNG."""
    imgs = [decode_png(Path(p).read_bytes()).reduce(factor) for p in paths]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(encode_png(strip(imgs, columns=columns)))
    return dest


def strip(images: list[Image.Image], gap: int = STRIP_GAP,
          background: tuple[int, int, int] = STRIP_BACKGROUND,
          columns: int | None = None) -> Image.Image:
    """The images in rows of ``columns`` (default: all in one row), top-left aligned in cells
    of the largest one's size, ``gap`` pixels of ``background`` around each."""
    if not images:
        raise ValueError("a strip of no images")
    cols = columns or len(images)
    cw, ch = max(i.width for i in images), max(i.height for i in images)
    nrows = -(-len(images) // cols)
    out = Image.new("RGB", (cols * cw + gap * (cols + 1), nrows * ch + gap * (nrows + 1)),
                    background)
    for k, img in enumerate(images):
        r, c = divmod(k, cols)
        out.paste(img, (gap + c * (cw + gap), gap + r * (ch + gap)))
    return out


async def run_desktop_episodes(n: int, url: str, api_key: str, *, out_dir: Path,
                               text: str = TEXT) -> dict[str, Any]:
    """``n`` episodes one at a time (even: the honest agent, odd: the cheater)."""
    from rollbox.sdk import AsyncClient

    timings: dict[str, list[float]] = {k: [] for k in
                                       ("create", "desktop", "act", "grade", "episode")}
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.monotonic()
    async with AsyncClient(base_url=url, api_key=api_key, timeout=DESKTOP_WAIT_S) as client:
        for i in range(n):
            try:
                results.append(await episode(client, i, text=text, out_dir=out_dir,
                                             timings=timings, cheat=i % 2 == 1))
            except Exception as exc:  # noqa: BLE001 - reported in the summary
                errors.append(f"episode {i}: {type(exc).__name__}: {exc}")
    honest = [r for r in results if not r["cheat"]]
    cheats = [r for r in results if r["cheat"]]
    summary: dict[str, Any] = {
        "task": "desktop", "backend": "vm", "text": text, "episodes": n,
        "completed": len(results), "errors": errors, "wall_s": round(time.monotonic() - t0, 3),
        "reward_honest": sum(r["reward"] for r in honest) / max(1, len(honest)),
        "reward_cheating": sum(r["reward"] for r in cheats) / max(1, len(cheats)),
        "cheaters_own_vm_said_won": sum(r["own_vm_reward"] == 1 for r in cheats),
        "results": results,
    }
    steps = [s for r in honest[:1] for s in r["screenshots"]]
    if steps:
        summary["strip"] = str(write_strip(steps, out_dir / "strip.png"))
    for k, xs in timings.items():
        summary[f"{k}_p50_s"] = round(percentile(xs, 50), 3)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="rollbox demo --task desktop (vm)")
    for col in ("episode", "agent", "its own VM said", "graded reward", "replayed", "note"):
        table.add_column(col)
    for r in summary["results"]:
        g = r["grade"]
        table.add_row(str(r["episode"]), "cheater: " + "+".join(r["cheat"]) if r["cheat"]
                      else "honest", f"{r['own_vm_reward']:.1f}", f"{r['reward']:.1f}",
                      str(g.get("replayed")), str(g.get("refused") or repr(g.get("note"))))
    console.print(table)
    for k, v in summary.items():
        if k not in ("results", "errors"):
            console.print(f"{k}: {v}")
    for r in summary["results"]:
        console.print(f"episode {r['episode']} screenshots: " + " ".join(r["screenshots"]))
    for e in summary["errors"][:10]:
        console.print(f"[red]{e}")


def run_desktop_demo(n: int = 2, url: str | None = None, *, out_dir: Path | None = None,
                     text: str = TEXT) -> dict[str, Any]:
    """``n`` episodes against ``url`` or an embedded server (the desktop:1 disk must be built:
    ``rollbox image ensure-desktop``); screenshots and the strip go to ``out_dir`` (default
    ./rollbox-demo-desktop)."""
    from rollbox.embedded import server_process

    out = out_dir or Path("rollbox-demo-desktop")
    with server_process(url) as (base_url, key):
        summary = asyncio.run(run_desktop_episodes(n, base_url, key, out_dir=out, text=text))
    print_summary(summary)
    return summary
