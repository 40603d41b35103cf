"""rollbox.terminal.TerminalFilter: what a sandbox's terminal may send to the operator's
(red-team class 45): screen sequences pass, OSC other than titles, DCS/APC/PM/SOS and C1
controls as UTF-8 are dropped, across any chunking."""
from __future__ import annotations

import pytest

from rollbox.terminal import MAX_STRING, TerminalFilter

KEPT = [b"plain text \xc3\xa9\r\n", b"\x1b[31mred\x1b[0m", b"\x1b[2J\x1b[H", b"\x1b[?1049h",
        b"\x1b]0;title\x07", b"\x1b]2;t\x1b\\", b"\x1b7\x1b8", b"\xc2\xa0nbsp"]
DROPPED = [b"\x1b]52;c;cHduZWQ=\x07", b"\x1b]52;c;?\x1b\\", b"\x1bP$qm\x1b\\",
           b"\x1bPtmux;\x1b\x1b]52;c;eA==\x07\x1b\\", b"\x1b_apc\x1b\\", b"\x1b^pm\x1b\\",
           b"\x1bXsos\x1b\\", b"\xc2\x9b", b"\xc2\x9d", b"\x1b]8;;http://x\x07",
           b"\x1b]0;" + b"a" * (MAX_STRING + 10) + b"\x07"]


def _all_splits(data: bytes) -> list[list[bytes]]:
    """Whole, one byte at a time, and (short ones) cut in two at every place."""
    cuts = range(1, len(data)) if len(data) <= 256 else range(0)
    return [[data], [bytes((b,)) for b in data]] + [[data[:i], data[i:]] for i in cuts]


@pytest.mark.parametrize("seq", KEPT)
def test_screen_sequences_pass(seq: bytes) -> None:
    for chunks in _all_splits(seq):
        f = TerminalFilter()
        assert b"".join(f.feed(c) for c in chunks) == seq, chunks


@pytest.mark.parametrize("seq", DROPPED)
def test_what_acts_beyond_the_screen_is_dropped(seq: bytes) -> None:
    for chunks in _all_splits(b"A" + seq + b"B"):
        f = TerminalFilter()
        assert b"".join(f.feed(c) for c in chunks) == b"AB", chunks
        assert f.dropped >= 1


def test_an_escape_inside_a_string_aborts_it() -> None:
    f = TerminalFilter()
    assert f.feed(b"\x1b]52;c;x\x1b[1mB") == b"\x1b[1mB"
    assert f.feed(b"\x1b]52;c;x\x18C") == b"C"  # CAN aborts



def test_platform_logs_are_escaped() -> None:
    """What ``rollbox serve`` (and the mirror, cluster replicas, edge actors) logs: control
    characters of a message, its arguments and its traceback escaped, newlines kept."""
    import io
    import logging

    from rollbox.terminal import escaped_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    buf = io.StringIO()
    try:
        escaped_logging(logging.WARNING, stream=buf, force=True)
        log = logging.getLogger("rollbox.test")
        log.warning("exec %s failed: %s", "x\x1b]52;c;?\x07", "out\rput\x9b")
        try:
            raise ValueError("tb\x1b[2J")
        except ValueError:
            log.exception("boom\x1b")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    text = buf.getvalue()
    assert not any(ch in text for ch in ("\x1b", "\x07", "\r", "\x9b")), repr(text)
    assert "x\\e]52;c;?\\a failed: out\\rput\\x9b" in text and "tb\\e[2J" in text
    assert "Traceback" in text and "\n" in text
