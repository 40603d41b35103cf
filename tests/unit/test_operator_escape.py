"""escape_control: nothing a sandbox prints reaches the operator's terminal as a control."""
from __future__ import annotations

import pytest

from rollbox.operator_cli import _table, _text, escape_control


def test_terminal_controls_are_shown_escaped() -> None:
    attacks = {
        "\x1b[2J\x1b[H": "\\e[2J\\e[H",  # CSI: clear screen, home
        "\x1b]0;pwned\x07": "\\e]0;pwned\\a",  # OSC: window title
        "\x1b]52;c;ZXZpbA==\x1b\\": "\\e]52;c;ZXZpbA==\\e\\",  # OSC 52: set the clipboard
        "\x1bP+q\x1b\\": "\\eP+q\\e\\",  # DCS
        "ok\rFAKE": "ok\\rFAKE",  # carriage return overwriting the line
        "abc\b\b\bxyz": "abc\\b\\b\\bxyz",
        "\x9b31m": "\\x9b31m",  # one-byte C1 CSI
        "\x00\x7f\x0c\x0b": "\\0\\x7f\\f\\v",
        "safe\u202etxt.exe": "safe\\u202etxt.exe",  # bidi override
        "a\u061cb\u2067c": "a\\u061cb\\u2067c",  # Arabic letter mark, first-strong isolate
        "ok\u2028FAKE\u2029": "ok\\u2028FAKE\\u2029",  # line / paragraph separator
        "zero\u200bwidth\ufeff": "zero\\u200bwidth\\ufeff",  # invisible text
    }
    for raw, shown in attacks.items():
        assert escape_control(raw) == shown
    assert escape_control("line 1\n\tline 2 é ✓\n") == "line 1\n\tline 2 é ✓\n"
    # Invalid UTF-8 from a command's output: shown as bytes, never decoded into a control.
    assert _text(b"\xff\x1b[31mred") == "\\xff\\e[31mred"
    for c in range(0x20):
        if chr(c) not in "\n\t":
            assert escape_control(chr(c)).startswith("\\"), c


def test_piped_table_rows_can_not_be_forged(capsys: pytest.CaptureFixture[str]) -> None:
    """A label value (any project may set one) with a newline and tabs stays in its cell: a
    script reading `rollbox sandbox ls | cut -f1` sees only the real ids."""
    _table(["ID", "LABELS"], [["sb-real", "k=v\nsb-other\tx"]])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["ID", "sb-real"]
    assert lines[1] == "sb-real\tk=v\\nsb-other\\tx"

