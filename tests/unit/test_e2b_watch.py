"""rollbox.compat.e2b.watch's parsing of the sandbox's watch records (hostile bytes) and its
mapping of inotify masks onto envd's event types, a platform write's temp file hidden."""
from __future__ import annotations

import pytest

from rollbox import errors
from rollbox.compat.e2b import watch as W


def rec(kind: bytes, mask: int, cookie: int, name: bytes) -> bytes:
    return W.RECORD.pack(kind, mask, cookie, len(name)) + name


def test_parser_splits_records_across_reads() -> None:
    data = rec(b"WS", 0, 0, b"") + rec(b"WE", W.IN_CREATE, 0, "é/x".encode())
    p = W.Parser()
    out = [r for i in range(len(data)) for r in p.feed(data[i:i + 1])]
    assert out == [("sync", 0, 0, ""), ("event", W.IN_CREATE, 0, "é/x")]


def test_parser_refuses_garbage() -> None:
    with pytest.raises(errors.InfraError):
        W.Parser().feed(b"XX" + bytes(10))


def test_masks_as_envd_reports_them() -> None:
    assert W.event_types(W.IN_CREATE) == ["EVENT_TYPE_CREATE"]
    assert W.event_types(W.IN_MOVED_TO) == ["EVENT_TYPE_CREATE"]
    assert W.event_types(W.IN_MODIFY) == ["EVENT_TYPE_WRITE"]
    assert W.event_types(W.IN_ATTRIB) == ["EVENT_TYPE_CHMOD"]
    assert W.event_types(W.IN_DELETE) == ["EVENT_TYPE_REMOVE"]
    assert W.event_types(W.IN_MOVED_FROM) == ["EVENT_TYPE_RENAME"]
    assert W.event_types(0x40000000 | W.IN_CREATE) == ["EVENT_TYPE_CREATE"]  # IN_ISDIR


def test_platform_write_is_create_and_write_and_its_temp_never_shows() -> None:
    t = W.Translator()
    tmp = W.TMP_PREFIX + "0123"
    assert t.events(W.IN_CREATE, 0, f"d/{tmp}") == []
    assert t.events(W.IN_MODIFY, 0, f"d/{tmp}") == []
    assert t.events(W.IN_MOVED_FROM, 7, f"d/{tmp}") == []
    assert [e["type"] for e in t.events(W.IN_MOVED_TO, 7, "d/f")] == [
        "EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE"]
    # a rename by the sandbox itself is a rename and a create
    assert t.events(W.IN_MOVED_FROM, 8, "a") == [{"name": "a", "type": "EVENT_TYPE_RENAME"}]
    assert t.events(W.IN_MOVED_TO, 8, "b") == [{"name": "b", "type": "EVENT_TYPE_CREATE"}]
