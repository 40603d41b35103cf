"""A full VM's screen and input, through QMP only: ``screendump`` into a descriptor for the
screen, ``input-send-event`` for keys and pointer alike (one input path: mixing ``send-key``
with it reorders keys). Nothing here opens a path in the jail or on the host.

- Screenshot: a memfd the edge made, passed write-only with ``add-fd`` and named by QEMU as
  ``/dev/fdset/N`` (its own open of it dups the descriptor); QEMU writes the PNG, the edge reads
  it back. Those bytes are QEMU's (which emulates guest-facing devices), so they are hostile:
  at most ``max_bytes`` are read, they must start with the PNG signature and an IHDR chunk
  whose size is sane; they are never decoded on the host (the caller gets them as they are).
- Input: :func:`plan` turns one :class:`~rollbox.models.ComputerAction` into batches of QMP
  input events, checked first (coordinates on the display, key names in :data:`KEYS`, text
  of printable ASCII, tab and newline, a US layout): a BadRequest names what is wrong and
  nothing is sent. :func:`send` sends the batches; a batch holds at most a few keys, a
  pointer button is held :data:`CLICK_HOLD_S` before it is let go, and the batches of typed
  text are paced (the PS/2 keyboard's queue holds 256 bytes of scancodes;
  QEMU drops what does not fit, silently: a USB keyboard's 16-event queue lost keys and
  key-ups, which the guest then auto-repeated).

Owns the event shapes, the key table and the screenshot bytes' checks; does not know handles,
locks or the event log (``backend.py``, the edge).
"""
from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator
from typing import Any

from rollbox.backends.microvm import qmp
from rollbox.errors import BadRequest, InfraError
from rollbox.models import ComputerAction

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_SIDE = 16384
ABS_MAX = 0x7FFF  # QEMU's absolute axis range (INPUT_EVENT_ABS_MAX)
KEYS_PER_BATCH = 8  # <= 48 scancode bytes: under a fifth of the PS/2 keyboard's 256-byte queue
TYPE_PAUSE_S = 0.03  # between batches of typed keys
CLICK_GAP_S = 0.05  # between the two clicks of a double click
# A button held this long before it is let go (click, drag). Sent at once, a release reached
# JWM while it handled the press, and its tray drops the button events queued then
# (DiscardButtonEvents: XSync, then every queued press and release, before it grabs the
# pointer): the launcher stayed pressed and ran nothing. On a restored desktop under TCG
# (strace of JWM): the release 37 ms after the press lost; at load ~5 JWM's press handling
# took 46 ms and a 0.15 s hold opened the editor, at load 10-15 it took 208 ms and a 0.15 s
# hold was lost too. Half a second: a slow hand's click, and a guest under TCG runs several
# times slower than on hardware.
CLICK_HOLD_S = 0.5
# A double click's presses must come within the toolkits' double-click time (JWM's and GTK's
# 400 ms): its button is held this long only.
DOUBLE_CLICK_HOLD_S = 0.05

# Key names a caller may use -> QEMU qcode (QKeyCode). Letters and digits map to themselves.
KEYS: dict[str, str] = {
    **{c: c for c in "abcdefghijklmnopqrstuvwxyz0123456789"},
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
    "ctrl": "ctrl", "control": "ctrl", "ctrl_r": "ctrl_r", "shift": "shift",
    "shift_r": "shift_r", "alt": "alt", "alt_r": "alt_r", "altgr": "alt_r",
    "meta": "meta_l", "super": "meta_l", "win": "meta_l", "cmd": "meta_l", "menu": "menu",
    "enter": "ret", "return": "ret", "esc": "esc", "escape": "esc", "tab": "tab",
    "space": "spc", "backspace": "backspace", "delete": "delete", "del": "delete",
    "insert": "insert", "home": "home", "end": "end", "pageup": "pgup", "pagedown": "pgdn",
    "up": "up", "down": "down", "left": "left", "right": "right", "capslock": "caps_lock",
    "printscreen": "print", "pause": "pause", "scrolllock": "scroll_lock",
    "numlock": "num_lock",
    "minus": "minus", "-": "minus", "equal": "equal", "=": "equal", "[": "bracket_left",
    "]": "bracket_right", ";": "semicolon", "'": "apostrophe", "`": "grave_accent",
    "\\": "backslash", ",": "comma", ".": "dot", "/": "slash",
}
MODIFIERS = frozenset({"ctrl", "ctrl_r", "shift", "shift_r", "alt", "alt_r", "meta_l"})
# Printable ASCII typed with shift on a US layout -> the unshifted key's qcode.
_SHIFTED = dict(zip('!@#$%^&*()_+{}:"~|<>?', "1234567890", strict=False))
_SHIFTED.update({"_": "minus", "+": "equal", "{": "bracket_left", "}": "bracket_right",
                 ":": "semicolon", '"': "apostrophe", "~": "grave_accent", "|": "backslash",
                 "<": "comma", ">": "dot", "?": "slash"})


def char_keys(ch: str) -> tuple[str, bool]:
    """(qcode, with shift) of one character to type; BadRequest for what a US keyboard can
    not type (control bytes other than tab and newline, non-ASCII)."""
    if ch == "\n":
        return "ret", False
    if ch == "\t":
        return "tab", False
    if ch == " ":
        return "spc", False
    if "a" <= ch <= "z" or "0" <= ch <= "9":
        return ch, False
    if "A" <= ch <= "Z":
        return ch.lower(), True
    if ch in _SHIFTED:
        return _SHIFTED[ch], True
    if ch in KEYS and len(ch) == 1:
        return KEYS[ch], False
    raise BadRequest(f"can not type the character {ch!r} (printable ASCII, tab and newline "
                     "only)", reason="text")


def chord(keys: str) -> list[str]:
    """The qcodes of a chord such as ``ctrl+s`` or ``ctrl+shift+t`` (modifiers first, one
    other key at most); BadRequest naming an unknown key."""
    names = [k.strip().lower() for k in keys.split("+")] if keys != "+" else ["+"]
    if keys.endswith("++"):  # "ctrl++": the plus key
        names = [k.strip().lower() for k in keys[:-2].split("+")] + ["+"]
    codes: list[str] = []
    for name in names:
        if name == "+":
            codes += ["shift", "equal"]
            continue
        if name not in KEYS:
            raise BadRequest(f"unknown key {name!r} in {keys!r}", reason="keys",
                             known=sorted(KEYS)[:200])
        codes.append(KEYS[name])
    plain = [c for c in codes if c not in MODIFIERS]
    if len(plain) > 1:
        raise BadRequest(f"a chord has at most one key besides modifiers: {keys!r}",
                         reason="keys")
    if len(set(codes)) != len(codes):
        raise BadRequest(f"a key repeats in {keys!r}", reason="keys")
    return codes


def _key(code: str, down: bool) -> dict[str, Any]:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": code}}}


def _btn(button: str, down: bool) -> dict[str, Any]:
    return {"type": "btn", "data": {"down": down, "button": button}}


def _abs(x: int, y: int, size: tuple[int, int]) -> list[dict[str, Any]]:
    w, h = size
    return [{"type": "abs", "data": {"axis": "x", "value": x * ABS_MAX // max(1, w - 1)}},
            {"type": "abs", "data": {"axis": "y", "value": y * ABS_MAX // max(1, h - 1)}}]


def _point(x: int | None, y: int | None, size: tuple[int, int], what: str) -> tuple[int, int]:
    if x is None or y is None:
        raise BadRequest(f"{what} needs x and y", reason="coordinates")
    w, h = size
    if not (0 <= x < w and 0 <= y < h):
        raise BadRequest(f"({x}, {y}) is outside the {w}x{h} display", reason="coordinates",
                         width=w, height=h)
    return x, y


def plan(action: ComputerAction, size: tuple[int, int], max_chars: int) -> list[
        list[dict[str, Any]]]:
    """The batches of QMP input events of ``action`` on a display of ``size``, every input
    checked first (BadRequest; nothing is sent then). A batch is one ``input-send-event``."""
    a = action.action
    if a in ("move", "click", "double_click", "drag", "scroll"):
        x, y = _point(action.x, action.y, size, a)
        at = _abs(x, y, size)
        if a == "move":
            return [at]
        if a == "click":
            return [at + [_btn(action.button, True)], [_btn(action.button, False)]]
        if a == "double_click":
            return [at + [_btn(action.button, True)], [_btn(action.button, False)],
                    [_btn(action.button, True)], [_btn(action.button, False)]]
        if a == "drag":
            x2, y2 = _point(action.x2, action.y2, size, "drag's end (x2, y2)")
            return [at, [_btn(action.button, True)], _abs(x2, y2, size),
                    [_btn(action.button, False)]]
        if action.dy == 0:
            raise BadRequest("scroll needs dy (wheel steps, negative: up)", reason="dy")
        wheel = "wheel-down" if action.dy > 0 else "wheel-up"
        return [at] + [b for _ in range(abs(action.dy))
                       for b in ([_btn(wheel, True)], [_btn(wheel, False)])]
    if a == "type":
        text = action.text
        if not text:
            raise BadRequest("type needs text", reason="text")
        if len(text) > max_chars:
            raise BadRequest(f"text of {len(text)} characters; at most {max_chars} per call",
                             reason="text", max_chars=max_chars)
        keys = [char_keys(ch) for ch in text]  # all checked before anything is sent
        return list(_typed(keys))
    if a == "press":
        if not action.keys:
            raise BadRequest("press needs keys (e.g. ctrl+s)", reason="keys")
        codes = chord(action.keys)
        return [[_key(c, True) for c in codes] + [_key(c, False) for c in reversed(codes)]]
    raise BadRequest(f"unknown action {a!r}", reason="action")  # pragma: no cover (Literal)


def _typed(keys: list[tuple[str, bool]]) -> Iterator[list[dict[str, Any]]]:
    """Batches of at most KEYS_PER_BATCH keys, a key at most once per batch (a key pressed
    twice in one batch was typed once: "ll" came out as "l")."""
    batch: list[dict[str, Any]] = []
    codes: set[str] = set()
    for code, shift in keys:
        if len(codes) == KEYS_PER_BATCH or code in codes:
            yield batch
            batch, codes = [], set()
        codes.add(code)
        if shift:
            batch.append(_key("shift", True))
        batch += [_key(code, True), _key(code, False)]
        if shift:
            batch.append(_key("shift", False))
    if batch:
        yield batch


def events_in(batches: list[list[dict[str, Any]]]) -> int:
    return sum(len(b) for b in batches)


# The VGA device's id: the USB tablet is bound to its console (machine.py) and every event is
# sent to that console, so the pointer's events reach the tablet whichever pointer QEMU holds
# active. Without it they go to the active one, and a VM restored from a saved state (its
# QEMU fresh, the guest not polling the tablet anew) has q35's PS/2 mouse active: a relative
# mouse that drops absolute moves (a restored desktop's clicks landed nowhere).
DISPLAY_ID = "video0"


# The live view's input (``send``'s action for a person's events): paced by the person, never
# by the platform (a hold there would make a person's double click two clicks).
VIEW_INPUT = "view"


def pause_after(action: str, batch: list[dict[str, Any]]) -> float:
    """Seconds :func:`send` waits after ``batch`` of ``action`` before the next one:
    :data:`CLICK_HOLD_S` after a pointer button went down (not the wheel's steps;
    :data:`DOUBLE_CLICK_HOLD_S` in a double click), :data:`TYPE_PAUSE_S` between batches of
    typed keys, half of :data:`CLICK_GAP_S` between a double click's release and its next
    press; else none, and never for :data:`VIEW_INPUT`."""
    if action == VIEW_INPUT:
        return 0.0
    last = batch[-1] if batch else {}
    if last.get("type") == "btn" and last["data"]["down"] and \
            not str(last["data"]["button"]).startswith("wheel"):
        return DOUBLE_CLICK_HOLD_S if action == "double_click" else CLICK_HOLD_S
    if action == "type":
        return TYPE_PAUSE_S
    if action == "double_click":
        return CLICK_GAP_S / 2
    return 0.0


async def send(q: qmp.QMP, action: str, batches: list[list[dict[str, Any]]]) -> None:
    """Send the batches in order on one QMP connection to the display's console
    (:data:`DISPLAY_ID`), paced by :func:`pause_after`. Keys: no keyboard is bound to the
    console, so they go to the active one, the PS/2 keyboard."""
    for i, batch in enumerate(batches):
        if i:
            pause = pause_after(action, batches[i - 1])
            if pause:
                await asyncio.sleep(pause)
        await q.execute("input-send-event", {"events": batch, "device": DISPLAY_ID})


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG bytes from their IHDR; InfraError if they are not a PNG."""
    if len(data) < 33 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise InfraError("screendump: QEMU's answer is not a PNG")
    w, h = struct.unpack(">II", data[16:24])
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
        raise InfraError(f"screendump: implausible size {w}x{h}")
    return w, h


async def screendump(q: qmp.QMP, max_bytes: int) -> bytes:
    """The screen as PNG bytes (see the module docstring), checked, at most ``max_bytes``."""
    memfd = os.memfd_create("rollbox-screen", os.MFD_CLOEXEC)
    try:
        wfd = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            added = await q.execute("add-fd", {"opaque": "screendump"}, fd=wfd)
        finally:
            os.close(wfd)
        fdset = int(added["fdset-id"]) if isinstance(added, dict) else -1
        if fdset < 0:
            raise InfraError("screendump: add-fd gave no fdset")
        try:
            await q.execute("screendump", {"filename": f"/dev/fdset/{fdset}", "format": "png"})
        finally:
            await q.execute("remove-fd", {"fdset-id": fdset})
        size = os.fstat(memfd).st_size
        if size > max_bytes:
            raise InfraError(f"screendump: {size} bytes, more than the {max_bytes} allowed")
        data = os.pread(memfd, size, 0)
    finally:
        os.close(memfd)
    png_size(data)
    return data
