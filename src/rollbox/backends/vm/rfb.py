"""The live view's client-to-server RFB (VNC) stream, checked: what a browser's noVNC sends is
parsed message by message, and only what draws the screen reaches QEMU's VNC server; the
keyboard and pointer become QMP ``input-send-event`` batches (the one input path,
``display.py``), or nothing.

:class:`ClientFilter` is fed the browser's bytes as they come (any split) and gives back
``(bytes for QEMU, input batches)``:

- the handshake: ``RFB 003.008\\n`` only, security type 1 (None: the edge already
  authenticated the viewer; QEMU gets the socket with ``skipauth``), ClientInit forced to
  *shared* (a viewer never disconnects another);
- SetPixelFormat, FramebufferUpdateRequest: forwarded; SetEncodings: forwarded with only the
  encodings of :data:`ENCODINGS` (so QEMU enables nothing that makes the client send a message
  this filter does not know: no fences, continuous updates, extended clipboard, audio, xvp or
  extended mouse buttons);
- KeyEvent (keysym, :data:`KEYSYMS`), QEMU's extended KeyEvent (an XT scancode, QEMU's
  ``number`` key), PointerEvent (absolute position scaled to the display, buttons 1-3, wheel):
  input, never forwarded; ClientCutText (the clipboard): read and dropped.

Anything else (an unknown message type, a bad handshake, a length over its bound) is a
:class:`~rollbox.errors.BadRequest` and the stream ends: nothing past it is forwarded. The
filter does not decide whether input is allowed (the edge's take-over does).

What QEMU sends is the browser's to parse, except its start: :class:`ServerInit` reads QEMU's
bytes only as far as ServerInit (version, security types, SecurityResult, the framebuffer's
width and height; at most :data:`SERVER_HEAD_MAX` bytes), so that pointer positions are
scaled by the stream's own framebuffer size, with no screenshot in the input path.

Owns the message formats and the keysym table; does not know sockets, QMP or sandboxes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from rollbox.backends.vm.display import ABS_MAX, KEYS
from rollbox.errors import BadRequest

VERSION = b"RFB 003.008\n"
SECURITY_NONE = 1
MAX_ENCODINGS = 64
MAX_CUT_TEXT = 1 << 20  # a clipboard message longer than this ends the stream
MAX_PENDING = 1 << 20  # bytes of the client's not yet parsed
MAX_KEYCODE = 0xFF  # QEMU's qnum: XT set 1, 0x80 for the 0xe0-prefixed keys

# Encodings a client may ask QEMU for: pixel data and the pseudo-encodings that only change
# what the server sends (quality/compression levels, cursor, size changes, QEMU's extended key
# event, last rect). Anything else is dropped from SetEncodings.
ENCODINGS = frozenset({
    0, 1, 2, 5, 6, 7, 16,  # raw, copyrect, rre, hextile, zlib, tight, zrle
    -260,  # tight png
    *range(-32, -22),  # jpeg quality levels
    *range(-256, -246),  # compression levels
    -223,  # DesktopSize
    -224,  # LastRect
    -239,  # Cursor
    -258,  # QEMU extended key event (the client then sends scancodes)
})

# X keysyms (KeyEvent without a scancode) -> qcode. Printable ASCII maps to the key that
# types it on a US layout (the client sends shift itself); the rest are the named keys.
KEYSYMS: dict[int, str] = {
    0xFF08: "backspace", 0xFF09: "tab", 0xFF0D: "ret", 0xFF1B: "esc", 0xFFFF: "delete",
    0xFF50: "home", 0xFF51: "left", 0xFF52: "up", 0xFF53: "right", 0xFF54: "down",
    0xFF55: "pgup", 0xFF56: "pgdn", 0xFF57: "end", 0xFF63: "insert", 0xFF67: "menu",
    0xFFE1: "shift", 0xFFE2: "shift_r", 0xFFE3: "ctrl", 0xFFE4: "ctrl_r",
    0xFFE9: "alt", 0xFFEA: "alt_r", 0xFE03: "alt_r", 0xFFEB: "meta_l", 0xFFEC: "meta_r",
    0xFFE5: "caps_lock", 0xFF7F: "num_lock", 0xFF14: "scroll_lock", 0xFF13: "pause",
    0xFF61: "print",
    **{0xFFBE + i: f"f{i + 1}" for i in range(12)},
    0x20: "spc",
}
_SHIFTED_US = dict(zip('!@#$%^&*()_+{}:"~|<>?', [
    "1", "2", "3", "4", "5", "6", "7", "8", "9", "0", "minus", "equal", "bracket_left",
    "bracket_right", "semicolon", "apostrophe", "grave_accent", "backslash", "comma", "dot",
    "slash"], strict=True))
for _c in "abcdefghijklmnopqrstuvwxyz":
    KEYSYMS[ord(_c)] = _c
    KEYSYMS[ord(_c.upper())] = _c
for _c in "0123456789":
    KEYSYMS[ord(_c)] = _c
for _c, _q in _SHIFTED_US.items():
    KEYSYMS[ord(_c)] = _q
for _c in "-=[];'`\\,./":
    KEYSYMS[ord(_c)] = KEYS[_c]

# PointerEvent button-mask bits -> QMP buttons (RFB: 1 left, 2 middle, 4 right, 8/16 wheel).
BUTTONS = (("left", 0x01), ("middle", 0x02), ("right", 0x04), ("wheel-up", 0x08),
           ("wheel-down", 0x10))

# Fixed-size messages: type -> total length (type byte included).
_FIXED = {0: 20, 3: 10, 4: 8, 5: 6}


@dataclass
class ClientFilter:
    """One viewer's client-to-server stream (see the module docstring). ``size`` is the
    display's (width, height) that pointer positions are scaled by; the caller keeps it
    current. ``held`` are the keys (qcode or number) and ``mask`` the buttons down as far as
    the guest was told (:meth:`release` lets go of them); ``pointers`` counts the pointer
    events scaled by ``size`` (allowed ones)."""

    size: tuple[int, int] = (1, 1)
    _buf: bytearray = field(default_factory=bytearray)
    _stage: int = 0  # 0 version, 1 security type, 2 ClientInit, 3 messages
    _skip: int = 0  # bytes of a dropped clipboard message still to come
    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    mask: int = 0
    messages: int = 0
    pointers: int = 0

    def feed(self, data: bytes, allow_input: bool) -> tuple[bytes, list[list[dict[str, Any]]]]:
        """(bytes for QEMU, input batches to send now) of ``data``; BadRequest ends it.
        Input that is not allowed is dropped but tracked, so that what it pressed is never
        left held in the guest by a later release."""
        out = bytearray()
        batches = self.release() if not allow_input else []  # a take-over ended
        if len(self._buf) + len(data) > MAX_PENDING:
            raise BadRequest("live view: an RFB message over its bound", reason="rfb")
        self._buf += data
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    break
            if self._stage < 3:
                if not self._handshake(out):
                    break
                continue
            if not self._buf:
                break
            kind = self._buf[0]
            need = self._length(kind)
            if need is None or len(self._buf) < need:
                break
            msg = bytes(self._buf[:need])
            del self._buf[:need]
            self.messages += 1
            self._message(kind, msg, out, batches, allow_input)
        return bytes(out), batches

    def _handshake(self, out: bytearray) -> bool:
        if self._stage == 0:
            if len(self._buf) < len(VERSION):
                if not VERSION.startswith(bytes(self._buf)):
                    raise BadRequest("live view: the client's RFB version is not 3.8",
                                     reason="rfb")
                return False
            if bytes(self._buf[:len(VERSION)]) != VERSION:
                raise BadRequest("live view: the client's RFB version is not 3.8", reason="rfb")
            out += VERSION
            del self._buf[:len(VERSION)]
            self._stage = 1
            return True
        if not self._buf:
            return False
        b = self._buf[0]
        del self._buf[:1]
        if self._stage == 1:
            if b != SECURITY_NONE:
                raise BadRequest(f"live view: security type {b} (only None: the view is "
                                 "authenticated by its token)", reason="rfb")
            out.append(SECURITY_NONE)
            self._stage = 2
            return True
        out.append(1)  # ClientInit: shared, whatever the client asked
        self._stage = 3
        return True

    def _length(self, kind: int) -> int | None:
        """The whole message's length once enough of it is here to know (None: wait)."""
        if kind in _FIXED:
            return _FIXED[kind]
        if kind == 2:  # SetEncodings: 4 + 4 n
            if len(self._buf) < 4:
                return None
            (n,) = struct.unpack_from(">H", self._buf, 2)
            if n > MAX_ENCODINGS:
                raise BadRequest(f"live view: {n} encodings (at most {MAX_ENCODINGS})",
                                 reason="rfb")
            return 4 + 4 * n
        if kind == 6:  # ClientCutText: 8 + length, dropped as it streams
            if len(self._buf) < 8:
                return None
            (n,) = struct.unpack_from(">i", self._buf, 4)
            if not 0 <= n <= MAX_CUT_TEXT:
                raise BadRequest(f"live view: clipboard message of length {n}", reason="rfb")
            return 8
        if kind == 255:  # QEMU client message: only the extended key event (12 bytes)
            if len(self._buf) < 2:
                return None
            if self._buf[1] != 0:
                raise BadRequest(f"live view: QEMU client message {self._buf[1]}",
                                 reason="rfb")
            return 12
        raise BadRequest(f"live view: RFB client message type {kind} is not allowed",
                         reason="rfb")

    def _message(self, kind: int, msg: bytes, out: bytearray,
                 batches: list[list[dict[str, Any]]], allow: bool) -> None:
        if kind in (0, 3):
            out += msg
        elif kind == 2:
            (n,) = struct.unpack_from(">H", msg, 2)
            encs = [e for e in struct.unpack_from(f">{n}i", msg, 4) if e in ENCODINGS]
            out += struct.pack(f">BxH{len(encs)}i", 2, len(encs), *encs)
        elif kind == 6:
            (self._skip,) = struct.unpack_from(">i", msg, 4)
        elif kind == 4:
            down, keysym = msg[1] != 0, struct.unpack_from(">I", msg, 4)[0]
            code = KEYSYMS.get(keysym)
            if code is not None:
                self._key({"type": "qcode", "data": code}, down, batches, allow)
        elif kind == 255:
            down, keysym, keycode = struct.unpack_from(">HII", msg, 2)
            if 0 < keycode <= MAX_KEYCODE:
                self._key({"type": "number", "data": keycode}, down != 0, batches, allow)
            elif keysym in KEYSYMS:
                self._key({"type": "qcode", "data": KEYSYMS[keysym]}, down != 0, batches,
                          allow)
        elif kind == 5:
            mask, x, y = struct.unpack_from(">BHH", msg, 1)
            if mask & 0x80:
                raise BadRequest("live view: extended pointer event (not negotiated)",
                                 reason="rfb")
            self._pointer(mask, x, y, batches, allow)

    def _key(self, key: dict[str, Any], down: bool, batches: list[list[dict[str, Any]]],
             allow: bool) -> None:
        name = f"{key['type']}:{key['data']}"
        if not allow:
            return
        if down:
            self.held[name] = key
        elif name not in self.held:
            return  # its press was not sent: nor is its release
        else:
            del self.held[name]
        batches.append([{"type": "key", "data": {"down": down, "key": key}}])

    def _pointer(self, mask: int, x: int, y: int, batches: list[list[dict[str, Any]]],
                 allow: bool) -> None:
        if not allow:
            return
        self.pointers += 1
        w, h = self.size
        x, y = min(x, w - 1), min(y, h - 1)
        batch: list[dict[str, Any]] = [
            {"type": "abs", "data": {"axis": "x", "value": x * ABS_MAX // max(1, w - 1)}},
            {"type": "abs", "data": {"axis": "y", "value": y * ABS_MAX // max(1, h - 1)}}]
        for button, bit in BUTTONS:
            if (mask ^ self.mask) & bit:
                batch.append({"type": "btn", "data": {"down": bool(mask & bit),
                                                       "button": button}})
        self.mask = mask
        batches.append(batch)

    def release(self) -> list[list[dict[str, Any]]]:
        """The batch that lets go of every key and button the guest was told is down (sent
        when a take-over ends or the view closes); empty if none."""
        batch = [{"type": "key", "data": {"down": False, "key": k}} for k in self.held.values()]
        batch += [{"type": "btn", "data": {"down": False, "button": b}}
                  for b, bit in BUTTONS if self.mask & bit]
        self.held.clear()
        self.mask = 0
        return [batch] if batch else []


# QEMU's start of the stream: version, the count and list of security types, SecurityResult,
# ServerInit's width and height (what follows, its pixel format and name, is not read).
SERVER_HEAD_MAX = len(VERSION) + 1 + 255 + 4 + 4
SECURITY_NONE = 1  # RFB security type None: the only one the live view's stream may offer


@dataclass
class ServerInit:
    """QEMU's side of one stream, read as far as its ServerInit: ``size`` is the framebuffer's
    (width, height) once seen, else None. The bytes are hostile: at most
    :data:`SERVER_HEAD_MAX` are kept; a start that is not RFB 3.8 with security None (a
    failure, no security type, a zero size) leaves ``size`` None and stops reading (the
    browser then refuses the stream itself). Later size changes (DesktopSize) are inside
    framebuffer updates and not parsed here."""

    size: tuple[int, int] | None = None
    done: bool = False
    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        self._buf += data[:SERVER_HEAD_MAX - len(self._buf)]
        buf = self._buf
        v = len(VERSION)
        if len(buf) <= v:
            return
        n = buf[v]
        if buf[:v] != VERSION or n == 0:
            self._stop()
            return
        need = v + 1 + n + 4 + 4
        if len(buf) < need:
            return
        if SECURITY_NONE not in buf[v + 1:v + 1 + n]:
            # Another type (VNC auth's challenge) would be read as the result and the size.
            self._stop()
            return
        (result,) = struct.unpack_from(">I", buf, v + 1 + n)
        w, h = struct.unpack_from(">HH", buf, v + 1 + n + 4)
        if result == 0 and w and h:
            self.size = (w, h)
        self._stop()

    def _stop(self) -> None:
        self.done = True
        self._buf = bytearray()


__all__ = ["ClientFilter", "ENCODINGS", "KEYSYMS", "SERVER_HEAD_MAX", "ServerInit", "VERSION"]
