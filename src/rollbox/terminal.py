"""What of a sandbox's terminal output may reach the operator's own terminal when the CLI
attaches one to it (``rollbox sandbox exec --pty`` on a terminal; red-team class 45).

Owns :class:`TerminalFilter` only: a byte filter, no I/O, no rollbox imports (the CLI that
uses it owns the terminal). Everything a screen program needs passes (text, CSI: cursor,
colours, modes, the alternate screen); the sequences that act beyond the screen are dropped:
OSC strings other than the window and icon titles (0, 1, 2), e.g. OSC 52, which sets the
operator's clipboard or, as a query, makes the terminal type its content into the sandbox;
DCS, APC, PM and SOS strings (terminal reprogramming, tmux passthrough to an outer terminal,
DECRQSS answers); and C1 controls encoded as UTF-8 (U+0080..U+009F: an 8-bit CSI/OSC/DCS to a
terminal that honours them). A string is buffered up to ``MAX_STRING`` bytes, then dropped
whole.
"""
from __future__ import annotations

ESC, BEL, CAN, SUB = 0x1B, 0x07, 0x18, 0x1A
MAX_STRING = 4096
KEPT_OSC = (b"0", b"1", b"2")  # titles

_GROUND, _ESC, _STRING, _STRING_ESC, _C2 = range(5)


class TerminalFilter:
    """``feed(chunk) -> bytes`` to write to the local terminal; keeps state across chunks."""

    def __init__(self) -> None:
        self._state = _GROUND
        self._osc = False  # the string being read is an OSC (kept if it is a title)
        self._buf = bytearray()
        self._overflow = False
        self.dropped = 0  # sequences dropped so far

    def _start_string(self, osc: bool, intro: int) -> None:
        self._state = _STRING
        self._osc = osc
        self._buf = bytearray((ESC, intro))
        self._overflow = False

    def _end_string(self, out: bytearray, terminator: bytes | None) -> None:
        """A string ended (``terminator`` BEL or ST; None: aborted)."""
        body = bytes(self._buf[2:])
        number = body.split(b";", 1)[0]
        if (self._osc and terminator is not None and not self._overflow and b";" in body
                and number in KEPT_OSC):
            out += self._buf
            out += terminator
        else:
            self.dropped += 1
        self._buf = bytearray()
        self._state = _GROUND

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for b in data:
            state = self._state
            if state == _GROUND:
                if b == ESC:
                    self._state = _ESC
                elif b == 0xC2:
                    self._state = _C2
                else:
                    out.append(b)
            elif state == _C2:
                self._state = _GROUND
                if 0x80 <= b <= 0x9F:
                    self.dropped += 1  # a C1 control as UTF-8
                elif b == ESC:
                    out.append(0xC2)
                    self._state = _ESC
                else:
                    out += bytes((0xC2, b))
            elif state == _ESC:
                if b == ord("]"):
                    self._start_string(True, b)
                elif b in b"P_^X":
                    self._start_string(False, b)
                elif b == ESC:
                    pass  # ESC cancels the sequence it interrupts and starts another
                elif b == ord("\\"):
                    self._state = _GROUND  # a stray ST terminates nothing
                else:
                    out += bytes((ESC, b))
                    self._state = _GROUND
            elif state == _STRING:
                if b == BEL and self._osc:
                    self._end_string(out, b"\x07")
                elif b == ESC:
                    self._state = _STRING_ESC
                elif b in (CAN, SUB):
                    self._end_string(out, None)
                elif len(self._buf) < MAX_STRING:
                    self._buf.append(b)
                else:
                    self._overflow = True
            else:  # _STRING_ESC
                if b == ord("\\"):
                    self._end_string(out, b"\x1b\\")
                else:  # an ESC inside the string aborts it and starts a sequence
                    self._end_string(out, None)
                    self._state = _ESC
                    out += self.feed(bytes((b,)))
        return bytes(out)
