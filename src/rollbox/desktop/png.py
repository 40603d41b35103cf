"""PNG in pure Python for the desktop demo: a bounded decoder for the screenshots its scripted
agent looks at, and an encoder for the step strip (docs/demo-desktop.png).

There is no image library in the venv (Pillow is not a dependency); the demo needs only 8-bit
RGB/RGBA, non-interlaced (what QEMU's ``screendump format=png`` writes). The decoder runs in
the demo's client process, the agent's side of the API (the platform itself never decodes a
screenshot: backends/vm/display.py), and treats its input as hostile: the size is capped
before anything is inflated, the inflated length must be exactly what the header says, and
any other kind of PNG is a typed :class:`~rollbox.errors.BadRequest`. Filters None, Sub and
Up are undone on whole rows as big integers (bytewise adds without carries); Average and
Paeth byte by byte.

Owns: :func:`decode`, :func:`encode`, :func:`downscale`, :func:`strip`. Touches nothing else.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from rollbox.errors import BadRequest

SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class Image:
    """8-bit RGB pixels, rows top to bottom."""
    width: int
    height: int
    rgb: bytes

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        i = (y * self.width + x) * 3
        return self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]

    def row(self, y: int) -> bytes:
        return self.rgb[y * self.width * 3:(y + 1) * self.width * 3]


def _masks(n: int) -> tuple[int, int, int]:
    return (int.from_bytes(b"\x7f" * n, "little"), int.from_bytes(b"\x80" * n, "little"),
            (1 << (8 * n)) - 1)


def _add(a: int, b: int, low: int, high: int) -> int:
    """Bytewise (a + b) mod 256 of two little-endian byte strings held as integers."""
    return ((a & low) + (b & low)) ^ ((a ^ b) & high)


def _unfilter(kind: int, line: bytes, prev: bytes, bpp: int,
              masks: tuple[int, int, int]) -> bytes:
    n = len(line)
    low, high, full = masks
    if kind == 0:
        return line
    if kind == 2:
        return _add(int.from_bytes(line, "little"), int.from_bytes(prev, "little"),
                    low, high).to_bytes(n, "little")
    if kind == 1:  # a prefix sum per channel: log2(n / bpp) shifted adds
        x, shift = int.from_bytes(line, "little"), bpp
        while shift < n:
            x = _add(x, (x << (8 * shift)) & full, low, high)
            shift *= 2
        return x.to_bytes(n, "little")
    out = bytearray(line)
    if kind == 3:
        for i in range(n):
            left = out[i - bpp] if i >= bpp else 0
            out[i] = (out[i] + ((left + prev[i]) >> 1)) & 0xFF
        return bytes(out)
    if kind == 4:
        for i in range(n):
            a = out[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            out[i] = (out[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        return bytes(out)
    raise BadRequest(f"PNG row filter {kind} is not one of PNG's five", reason="png")


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Image:
    """The pixels of an 8-bit RGB or RGBA non-interlaced PNG (alpha dropped); BadRequest for
    anything else, a truncated or oversized one."""
    if data[:8] != SIGNATURE:
        raise BadRequest("not a PNG (signature)", reason="png")
    pos, header, idat = 8, None, []
    while pos + 8 <= len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if len(body) != length:
            raise BadRequest("truncated PNG chunk", reason="png")
        pos += 12 + length
        if header is None and kind != b"IHDR":
            raise BadRequest("PNG without IHDR first", reason="png")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None:
        raise BadRequest("PNG without IHDR", reason="png")
    w, h, depth, color, comp, filt, interlace = header
    if depth != 8 or color not in (2, 6) or comp or filt or interlace:
        raise BadRequest(f"PNG kind not supported (depth {depth}, colour type {color}, "
                         f"interlace {interlace})", reason="png")
    if not 0 < w * h <= max_pixels:
        raise BadRequest(f"PNG of {w}x{h} pixels: over {max_pixels}", reason="png")
    bpp = 3 if color == 2 else 4
    stride = w * bpp
    want = h * (stride + 1)
    z = zlib.decompressobj()
    raw = z.decompress(b"".join(idat), want)
    if len(raw) != want or z.unconsumed_tail:
        raise BadRequest("PNG image data is not the size its header says", reason="png")
    masks = _masks(stride)
    prev = bytes(stride)
    rows = []
    for y in range(h):
        at = y * (stride + 1)
        prev = _unfilter(raw[at], raw[at + 1:at + 1 + stride], prev, bpp, masks)
        rows.append(prev)
    px = b"".join(rows)
    if bpp == 4:
        rgb = bytearray(w * h * 3)
        for c in range(3):
            rgb[c::3] = px[c::4]
        px = bytes(rgb)
    return Image(w, h, px)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


def encode(img: Image, level: int = 9) -> bytes:
    """``img`` as an 8-bit RGB PNG (filter None on every row, zlib ``level``)."""
    stride = img.width * 3
    raw = b"".join(b"\0" + img.rgb[y * stride:(y + 1) * stride] for y in range(img.height))
    return (SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", img.width, img.height, 8, 2,
                                                    0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, level)) + _chunk(b"IEND", b""))


def downscale(img: Image, factor: int) -> Image:
    """Each ``factor`` x ``factor`` block averaged into one pixel (the right and bottom
    remainders dropped)."""
    w, h = img.width // factor, img.height // factor
    n = factor * factor
    out = bytearray()
    for y in range(h):
        rows = [img.row(y * factor + k) for k in range(factor)]
        # per column of the output: the channel sums of the block, then the averages
        sums = [0] * (w * 3)
        for row in rows:
            for c in range(w * factor * 3):
                sums[(c // (3 * factor)) * 3 + c % 3] += row[c]
        out += bytes(v // n for v in sums)
    return Image(w, h, bytes(out))


def strip(images: list[Image], gap: int = 8, background: tuple[int, int, int] = (32, 32, 32),
          columns: int | None = None) -> Image:
    """The images in rows of ``columns`` (default: all in one row), top-left aligned in cells
    of the largest one's size, ``gap`` pixels of ``background`` around each."""
    if not images:
        raise ValueError("a strip of no images")
    cols = columns or len(images)
    cw, ch = max(i.width for i in images), max(i.height for i in images)
    nrows = -(-len(images) // cols)
    width, height = cols * cw + gap * (cols + 1), nrows * ch + gap * (nrows + 1)
    bg = bytes(background)
    rows = []
    for y in range(height):
        r, iy = divmod(y - gap, ch + gap) if y >= gap else (-1, -1)
        row = bytearray(bg * gap)
        for c in range(cols):
            k = r * cols + c
            img = images[k] if 0 <= r and k < len(images) and iy < ch else None
            line = img.row(iy) if img is not None and 0 <= iy < img.height else b""
            row += line + bg * (cw - len(line) // 3) + bg * gap
        rows.append(bytes(row))
    return Image(width, height, b"".join(rows))
