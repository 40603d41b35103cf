"""What of a sandbox's output may reach the operator's terminal (red-team class 45).

Owns :func:`escape_control` (text a sandbox wrote, shown escaped: what the CLIs print of it),
the platform processes' log format (:func:`escaped_logging`: every line a server writes to its
log is escaped the same way, since a command's output or a tenant's argv can end up in a log
message; or, as JSON lines, :class:`JsonFormatter`, with the request, sandbox and exec ids of
``rollbox.trace``) and :class:`TerminalFilter` (a byte filter for the operator's terminal when ``rollbox sandbox
exec --pty`` attaches it to the sandbox's); no I/O, no rollbox imports (the CLIs that use them
own their terminals; the one import is ``rollbox.trace``, for the ids). Through the filter everything a screen program needs passes (text, CSI:
cursor, colours, modes, the alternate screen); the sequences that act beyond the screen are
dropped: OSC strings other than the window and icon titles (0, 1, 2), e.g. OSC 52, which sets
the operator's clipboard or, as a query, makes the terminal type its content into the sandbox;
DCS, APC, PM and SOS strings (terminal reprogramming, tmux passthrough to an outer terminal,
DECRQSS answers); and C1 controls encoded as UTF-8 (U+0080..U+009F: an 8-bit CSI/OSC/DCS to a
terminal that honours them). A string is buffered up to ``MAX_STRING`` bytes, then dropped
whole.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
from typing import IO, Any

from rollbox import trace

# C0 controls but \n and \t, DEL, C1 controls (0x9b is a one-byte CSI for some terminals), the
# bidirectional marks, overrides and isolates (text that reads differently than it runs; U+061C
# too), the line and paragraph separators (a line break to some terminals) and the zero-width
# characters (invisible text).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                      "\u2060-\u2069\ufeff]")
_NAMED = {"\r": "\\r", "\x1b": "\\e", "\b": "\\b", "\x07": "\\a", "\x0b": "\\v", "\x0c": "\\f",
          "\x00": "\\0"}


def escape_control(text: str) -> str:
    """``text`` with every character that could move the cursor, recolour, retitle or reprogram
    a terminal (ESC and so CSI/OSC/DCS sequences, \\r, backspace, C1, bidi controls) shown as an
    escape (``\\e``, ``\\r``, ``\\x9b``, ``\\u202e``); newlines and tabs stay."""
    def one(m: re.Match[str]) -> str:
        c = m.group()
        if c in _NAMED:
            return _NAMED[c]
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _CONTROL.sub(one, text)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class EscapingFormatter(logging.Formatter):
    """A log line (message, arguments, traceback) with its control characters escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_control(super().format(record))


TRACE_IDS = ("request_id", "sandbox_id", "exec_id")


def stamp_trace_ids() -> None:
    """Make every log record carry the ids bound where it was made (``record.trace_ids``), so
    a handler that formats it later or elsewhere (a queue, pytest's caplog) still names them.
    Installed once per process."""
    old = logging.getLogRecordFactory()
    if getattr(old, "rollbox_stamps", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old(*args, **kwargs)
        record.trace_ids = trace.current()
        return record

    factory.rollbox_stamps = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


class JsonFormatter(logging.Formatter):
    """A log line as one JSON object: ``ts`` (UTC, ms), ``level``, ``logger``, ``msg``, the
    ``request_id``/``sandbox_id``/``exec_id`` bound where the record was made
    (rollbox.trace; :func:`stamp_trace_ids`) and ``exc`` (a traceback). JSON's ASCII escapes
    leave no control, bidi or other non-ASCII character in the line."""

    def format(self, record: logging.LogRecord) -> str:
        ids = getattr(record, "trace_ids", None)
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
            **(ids if isinstance(ids, dict) else trace.current())}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=True, default=str)


def escaped_logging(level: int, stream: IO[str] | None = None, *, json_lines: bool = False,
                    **kw: Any) -> None:
    """``logging.basicConfig`` of a platform process (``rollbox serve``, the mirror, cluster
    replicas and edge actors): stderr (or ``stream``), ``LOG_FORMAT`` escaped, or with
    ``json_lines`` :class:`JsonFormatter`'s lines (``Settings.log_format``)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else EscapingFormatter(LOG_FORMAT))
    stamp_trace_ids()
    logging.basicConfig(level=level, handlers=[handler], **kw)


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
