"""``rollbox.desktop.png``: the bounded PNG decoder (every row filter, RGB and RGBA, a real
QEMU screendump) and the encoder, downscale and strip the demo's step strip is made with."""
from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import pytest

from rollbox.desktop import png
from rollbox.errors import BadRequest

REPO = Path(__file__).resolve().parents[2]


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _filtered(rows: list[bytes], bpp: int, kinds: list[int]) -> bytes:
    """PNG's forward filters (the spec's definitions), one kind per row."""
    out = bytearray()
    prev = bytes(len(rows[0]))
    for row, kind in zip(rows, kinds):
        out.append(kind)
        for i, x in enumerate(row):
            a = row[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            pred = (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]
            out.append((x - pred) & 0xFF)
        prev = row
    return bytes(out)


def _png(w: int, h: int, color: int, raw: bytes, **hdr: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, hdr.get("depth", 8), color, 0, 0,
                       hdr.get("interlace", 0))
    return (png.SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("color,bpp", [(2, 3), (6, 4)])
def test_every_filter_decodes_to_the_pixels(color: int, bpp: int) -> None:
    rnd = random.Random(color)
    w, h = 37, 15
    rows = [bytes(rnd.randrange(256) for _ in range(w * bpp)) for _ in range(h)]
    kinds = [y % 5 for y in range(h)]
    img = png.decode(_png(w, h, color, _filtered(rows, bpp, kinds)))
    assert (img.width, img.height) == (w, h)
    want = b"".join(bytes(b for i, b in enumerate(r) if i % bpp < 3) for r in rows)
    assert img.rgb == want


def test_a_qemu_screendump_of_the_desktop() -> None:
    data = (REPO / "docs" / "backends" / "vm-desktop.png").read_bytes()
    img = png.decode(data)
    assert (img.width, img.height) == (1024, 768)
    assert img.pixel(900, 300) == (0x3A, 0x6E, 0xA5)  # the desktop's colour
    assert img.pixel(500, 300) == (255, 255, 255)     # inside the editor's page


def test_encode_round_trip_downscale_and_strip() -> None:
    a = png.Image(4, 2, bytes(range(24)))
    assert png.decode(png.encode(a)) == a
    big = png.Image(4, 4, bytes(range(48)))
    small = png.downscale(big, 2)
    assert (small.width, small.height) == (2, 2)
    # each output pixel: the channel averages of its 2x2 block (pixels 0, 1, 4, 5 -> 0)
    assert small.pixel(0, 0) == tuple(sum(big.pixel(x, y)[c] for x in (0, 1) for y in (0, 1))
                                      // 4 for c in range(3))
    assert small.pixel(1, 1) == tuple(sum(big.pixel(x, y)[c] for x in (2, 3) for y in (2, 3))
                                      // 4 for c in range(3))
    assert png.downscale(png.Image(5, 3, bytes(45)), 2).width == 2  # remainders dropped
    bg = (9, 9, 9)
    s = png.strip([a, small], gap=1, background=bg)
    assert (s.width, s.height) == (2 * 4 + 3, 2 + 2)  # cells of the largest image's size
    assert s.pixel(0, 0) == bg and s.pixel(1, 1) == a.pixel(0, 0)
    assert s.pixel(6, 1) == small.pixel(0, 0) and s.pixel(8, 1) == bg and s.pixel(6, 3) == bg
    g = png.strip([a, a, small], gap=1, background=bg, columns=2)
    assert (g.width, g.height) == (2 * 4 + 3, 2 * 2 + 3)
    assert g.pixel(1, 4) == small.pixel(0, 0) and g.pixel(6, 4) == bg and g.pixel(1, 3) == bg
    with pytest.raises(ValueError):
        png.strip([])


def test_bad_pngs_are_typed_errors() -> None:
    ok = _png(2, 2, 2, _filtered([bytes(6)] * 2, 3, [0, 0]))
    cases = {
        "signature": b"GIF89a" + ok[6:],
        "truncated": ok[:40],
        "kind": _png(2, 2, 3, b"\0\0\0" * 2),                         # palette
        "depth": _png(2, 2, 2, b"\0" * 26, depth=16),
        "interlace": _png(2, 2, 2, _filtered([bytes(6)] * 2, 3, [0, 0]), interlace=1),
        "size": _png(2, 3, 2, _filtered([bytes(6)] * 2, 3, [0, 0])),  # short data
        "filter": _png(2, 2, 2, b"\x07" + bytes(6) + b"\0" + bytes(6)),
        "huge": _png(5000, 5000, 2, b""),
    }
    for name, data in cases.items():
        with pytest.raises(BadRequest):
            png.decode(data)
        assert name
    # a header promising little and a zlib bomb behind it: inflation stops at the promise
    bomb = _png(2, 2, 2, bytes(10 << 20))
    with pytest.raises(BadRequest, match="size its header says"):
        png.decode(bomb)
