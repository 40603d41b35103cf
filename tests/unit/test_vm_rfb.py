"""The live view's RFB filter (rollbox.backends.vm.rfb): what a browser sends is parsed; only the
messages that draw the screen are forwarded to QEMU, input becomes QMP input-send-event batches
only when allowed, and anything unknown, malformed or over its bound is a BadRequest."""
from __future__ import annotations

import struct

import pytest

from rollbox.backends.vm import rfb
from rollbox.errors import BadRequest

HANDSHAKE = rfb.VERSION + bytes([1]) + bytes([0])  # version, security None, ClientInit exclusive


def ready(size: tuple[int, int] = (800, 600)) -> rfb.ClientFilter:
    f = rfb.ClientFilter(size=size)
    out, batches = f.feed(HANDSHAKE, True)
    assert out == rfb.VERSION + b"\x01\x01" and not batches  # ClientInit forced to shared
    return f


def key(down: bool, keysym: int) -> bytes:
    return struct.pack(">BBxxI", 4, down, keysym)


def qkey(down: bool, keysym: int, code: int) -> bytes:
    return struct.pack(">BBHII", 255, 0, down, keysym, code)


def pointer(mask: int, x: int, y: int) -> bytes:
    return struct.pack(">BBHH", 5, mask, x, y)


def test_handshake_in_any_split_and_bad_versions() -> None:
    f = rfb.ClientFilter()
    got = b""
    for b in HANDSHAKE:
        got += f.feed(bytes([b]), False)[0]
    assert got == rfb.VERSION + b"\x01\x01"
    for bad in (b"RFB 003.003\n", b"GET / HTTP/1.1\r\n"):
        with pytest.raises(BadRequest, match="version"):
            rfb.ClientFilter().feed(bad, False)
    with pytest.raises(BadRequest, match="security type 2"):
        rfb.ClientFilter().feed(rfb.VERSION + b"\x02", False)


def test_screen_messages_forwarded_and_encodings_filtered() -> None:
    f = ready()
    pixfmt = bytes([0, 0, 0, 0]) + bytes(16)
    upd = struct.pack(">BBHHHH", 3, 1, 0, 0, 800, 600)
    encs = [0, 7, -223, -258, -312, -313, -316, 0xC0A1E5CE - (1 << 32), -259, 16]
    setenc = struct.pack(f">BxH{len(encs)}i", 2, len(encs), *encs)
    out, batches = f.feed(pixfmt + setenc + upd, True)
    kept = [0, 7, -223, -258, 16]
    assert out == pixfmt + struct.pack(f">BxH{len(kept)}i", 2, len(kept), *kept) + upd
    assert not batches
    # split mid-message: nothing until it is whole
    out, _ = f.feed(upd[:4], True)
    assert out == b""
    assert f.feed(upd[4:], True)[0] == upd


def test_input_only_when_allowed_and_never_forwarded() -> None:
    f = ready()
    out, batches = f.feed(key(True, ord("a")) + key(False, ord("a")) + pointer(1, 10, 10), False)
    assert out == b"" and batches == []
    out, batches = f.feed(key(True, ord("A")) + key(False, ord("A")), True)
    assert out == b""
    assert [b[0]["data"] for b in batches] == [
        {"down": True, "key": {"type": "qcode", "data": "a"}},
        {"down": False, "key": {"type": "qcode", "data": "a"}}]
    _, batches = f.feed(qkey(True, ord(">"), 0x34) + qkey(False, ord(">"), 0x34), True)
    assert batches[0][0]["data"]["key"] == {"type": "number", "data": 0x34}
    _, batches = f.feed(key(True, 0xFF0D) + key(True, 0x12345678), True)  # unknown: dropped
    assert [b[0]["data"]["key"]["data"] for b in batches] == ["ret"]


def test_pointer_scaled_buttons_from_mask_and_clamped() -> None:
    f = ready((800, 600))
    _, batches = f.feed(pointer(0, 799, 0), True)
    assert batches == [[{"type": "abs", "data": {"axis": "x", "value": 0x7FFF}},
                        {"type": "abs", "data": {"axis": "y", "value": 0}}]]
    _, batches = f.feed(pointer(1, 5000, 5000) + pointer(0, 1, 1), True)  # off screen: edge
    assert batches[0][0]["data"]["value"] == 0x7FFF and batches[0][1]["data"]["value"] == 0x7FFF
    assert batches[0][2] == {"type": "btn", "data": {"down": True, "button": "left"}}
    assert batches[1][2] == {"type": "btn", "data": {"down": False, "button": "left"}}
    with pytest.raises(BadRequest, match="extended pointer"):
        f.feed(pointer(0x81, 1, 1) + b"\x00", True)


def test_release_lets_go_of_what_was_held() -> None:
    f = ready()
    f.feed(key(True, 0xFFE1) + pointer(4, 1, 1), True)  # shift down, right button down
    _, batches = f.feed(pointer(4, 2, 2), False)  # the take-over ended: let go first
    events = batches[0]
    assert {"type": "key", "data": {"down": False, "key": {"type": "qcode", "data": "shift"}}} \
        in events
    assert {"type": "btn", "data": {"down": False, "button": "right"}} in events
    assert f.release() == []
    # a release whose press was never sent is not sent either
    _, batches = f.feed(key(False, ord("x")), True)
    assert batches == []


def test_clipboard_dropped_and_bounded() -> None:
    f = ready()
    text = b"secret" * 10
    upd = struct.pack(">BBHHHH", 3, 1, 0, 0, 1, 1)
    msg = struct.pack(">BxxxI", 6, len(text)) + text
    out = b""
    for i in range(0, len(msg), 7):  # the text arrives in pieces, then a message after it
        out += f.feed(msg[i:i + 7], True)[0]
    out += f.feed(upd, True)[0]
    assert out == upd
    with pytest.raises(BadRequest, match="clipboard"):
        ready().feed(struct.pack(">BxxxI", 6, rfb.MAX_CUT_TEXT + 1), True)
    with pytest.raises(BadRequest, match="clipboard"):
        ready().feed(struct.pack(">Bxxxi", 6, -8), True)  # extended clipboard: not negotiated


@pytest.mark.parametrize("bad, why", [
    (bytes([7]), "type 7"), (bytes([248, 0, 0, 0]), "type 248"), (bytes([150, 1]), "type 150"),
    (bytes([251, 0]), "type 251"), (bytes([255, 1]), "QEMU client message 1"),
    (struct.pack(">BxH", 2, rfb.MAX_ENCODINGS + 1), "encodings"),
])
def test_unknown_or_oversized_messages_end_the_stream(bad: bytes, why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        ready().feed(bad, True)


def server_start(w: int, h: int, types: bytes = b"\x01", result: int = 0) -> bytes:
    """QEMU's start of a stream: version, security types, SecurityResult, ServerInit."""
    return (rfb.VERSION + bytes([len(types)]) + types + struct.pack(">I", result)
            + struct.pack(">HH", w, h) + bytes(16) + struct.pack(">I", 4) + b"qemu")


def test_server_init_size_in_any_split() -> None:
    data = server_start(1280, 800) + b"\x00" * 64  # then a framebuffer update, unread
    for step in (1, 5, len(data)):
        s = rfb.ServerInit()
        for i in range(0, len(data), step):
            s.feed(data[i:i + step])
        assert s.size == (1280, 800) and s.done
    s = rfb.ServerInit()
    s.feed(data[:len(rfb.VERSION) + 8])
    assert s.size is None and not s.done  # not there yet


@pytest.mark.parametrize("data", [
    server_start(800, 600, types=b""),  # no security type: a failure reason follows
    server_start(800, 600, result=1),  # security failed
    server_start(800, 600, types=b"\x02"),  # VNC auth only: its challenge is not a size
    server_start(0, 600),
    b"RFB 003.003\n" + bytes(40),
    b"\xff" * 400,
])
def test_server_init_refused_leaves_no_size(data: bytes) -> None:
    s = rfb.ServerInit()
    s.feed(data)
    assert s.size is None and s.done
    s.feed(server_start(800, 600))  # stopped: nothing read after
    assert s.size is None


def test_server_init_bounded() -> None:
    s = rfb.ServerInit()
    s.feed(rfb.VERSION + b"\xff" + b"\x01" * 255)  # 255 types: the most a start holds
    s.feed(struct.pack(">I", 0) + struct.pack(">HH", 640, 480) + bytes(1 << 16))
    assert s.size == (640, 480) and len(s._buf) == 0


def test_pointer_events_counted_only_when_allowed() -> None:
    f = ready()
    f.feed(pointer(0, 1, 1) + key(True, ord("a")), False)
    assert f.pointers == 0
    f.feed(pointer(0, 1, 1) + pointer(1, 2, 2) + key(True, ord("a")), True)
    assert f.pointers == 2
