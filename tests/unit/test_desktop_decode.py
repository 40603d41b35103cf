"""``rollbox.desktop.episode``'s screenshot handling with Pillow: the bounded decode of an
untrusted PNG (a real QEMU screendump; refusals as typed errors, the size checked before
anything is inflated, a zlib bomb behind a small header inflated no further than the header's
pixels), the encode round trip, and the step strip's layout."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from rollbox.desktop import episode as ep
from rollbox.errors import BadRequest

REPO = Path(__file__).resolve().parents[2]
SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png(w: int, h: int, color: int, raw: bytes) -> bytes:
    """A PNG written by hand: the header says ``w`` x ``h``, the data is ``raw`` deflated."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0)
    return (SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def test_a_qemu_screendump_of_the_desktop() -> None:
    img = ep.decode_png((REPO / "docs" / "backends" / "vm-desktop.png").read_bytes())
    assert img.size == (1024, 768) and img.mode == "RGB"
    assert img.getpixel((900, 300)) == (0x3A, 0x6E, 0xA5)  # the desktop's colour
    assert img.getpixel((500, 300)) == (255, 255, 255)     # inside the editor's page


def test_rgba_and_round_trip() -> None:
    rgba = _png(2, 1, 6, b"\0" + bytes([1, 2, 3, 4, 5, 6, 7, 8]))
    img = ep.decode_png(rgba)
    assert img.mode == "RGB" and img.tobytes() == bytes([1, 2, 3, 5, 6, 7])  # alpha dropped
    a = Image.frombytes("RGB", (4, 2), bytes(range(24)))
    assert ep.decode_png(ep.encode_png(a, level=1)).tobytes() == a.tobytes()


def test_bad_pngs_are_typed_errors() -> None:
    ok = _png(2, 2, 2, (b"\0" + bytes(6)) * 2)
    assert ep.decode_png(ok).size == (2, 2)
    cases = {
        "signature": b"GIF89a" + ok[6:],
        "empty": b"",
        "truncated": ok[:40],
        "zero": _png(0, 0, 2, b""),
        "filter": _png(2, 2, 2, b"\x07" + bytes(6) + b"\0" + bytes(6)),
        "gif": b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",  # not a PNG: no other decoder tried
        "giant": _png(100000, 100000, 2, b""),          # over Pillow's own bomb limit
    }
    for name, data in cases.items():
        with pytest.raises(BadRequest):
            ep.decode_png(data)
        assert name
    with pytest.raises(BadRequest, match="over 3"):  # the bound is checked before the load
        ep.decode_png(ok, max_pixels=3)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_a_zlib_bomb_inflates_no_further_than_its_header() -> None:
    """200 MiB of zeros deflated behind a 2x2 header: the process's peak resident memory
    (VmHWM, reset through /proc/self/clear_refs) grows by far less than that."""
    bomb = _png(2, 2, 2, bytes(200 << 20))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _kib("VmHWM")
    assert ep.decode_png(bomb).size == (2, 2)
    assert _kib("VmHWM") - base < 16 << 10


def test_the_size_is_checked_before_the_load() -> None:
    """A well-formed 5000x5000 screenshot (25 Mpx, which Pillow alone decodes) is refused by
    the header's size, before its 75 MB are inflated."""
    big = _png(5000, 5000, 2, (b"\0" + bytes(5000 * 3)) * 5000)
    Path("/proc/self/clear_refs").write_text("5")
    base = _kib("VmHWM")
    with pytest.raises(BadRequest, match="over 16777216"):
        ep.decode_png(big)
    assert _kib("VmHWM") - base < 16 << 10


def test_strip() -> None:
    a = Image.frombytes("RGB", (4, 2), bytes(range(24)))
    small = Image.frombytes("RGB", (4, 4), bytes(range(48))).reduce(2)
    assert small.size == (2, 2)
    # reduce: each output pixel the channel averages of its 2x2 block (pixels 0, 1, 4, 5:
    # red (0 + 3 + 12 + 15) / 4 = 7.5, rounded)
    assert small.getpixel((0, 0)) == (8, 9, 10)
    bg = (9, 9, 9)
    s = ep.strip([a, small], gap=1, background=bg)
    assert s.size == (2 * 4 + 3, 2 + 2)  # cells of the largest image's size
    assert s.getpixel((0, 0)) == bg and s.getpixel((1, 1)) == a.getpixel((0, 0))
    assert s.getpixel((6, 1)) == small.getpixel((0, 0))
    assert s.getpixel((8, 1)) == bg and s.getpixel((6, 3)) == bg
    g = ep.strip([a, a, small], gap=1, background=bg, columns=2)
    assert g.size == (2 * 4 + 3, 2 * 2 + 3)
    assert g.getpixel((1, 4)) == small.getpixel((0, 0))
    assert g.getpixel((6, 4)) == bg and g.getpixel((1, 3)) == bg
    with pytest.raises(ValueError):
        ep.strip([])
