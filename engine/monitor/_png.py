"""A dependency-free RGB canvas that saves PNG files (zlib + crc32 from the stdlib).

Enough for line plots: pixels, thick lines, rectangles and text in a 3x5 pixel font (upper
case, digits and ``.-/_:+=()%``), scaled up. Used when matplotlib is not installed.
"""
from __future__ import annotations

import struct
import zlib
from typing import Sequence

__all__ = ["Canvas", "encode_png", "decode_png_header", "Color"]

Color = tuple[int, int, int]

_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001010010",
    "8": "111101111101111", "9": "111101111001111",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111101101101", "N": "110101101101101", "O": "010101101101010", "P": "110101110100100",
    "Q": "010101101110011", "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101101111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "/": "001001010100100", "_": "000000000000111",
    ":": "000010000010000", "+": "000010111010000", "=": "000111000111000", "(": "010100100100010",
    ")": "010001001001010", "%": "101001010100101", " ": "000000000000000", "?": "111001010000010",
}


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """PNG bytes of an 8-bit RGB image given as ``height`` rows of ``3 * width`` bytes."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"expected {3 * width * height} bytes of RGB, got {len(rgb)}")
    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))


def decode_png_header(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of PNG bytes; ``ValueError`` if they are not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return struct.unpack(">II", data[16:24])


class Canvas:
    """A ``width`` x ``height`` RGB pixel buffer; (0, 0) is the top-left corner."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for x0_, y0_, x1_, y1_ in ((x0, y0, x1, y0), (x0, y1, x1, y1), (x0, y0, x0, y1), (x1, y0, x1, y1)):
            self.line(x0_, y0_, x1_, y1_, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        """Bresenham line, ``thickness`` pixels wide (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        lo, hi = -((thickness - 1) // 2), thickness // 2
        while True:
            for ox in range(lo, hi + 1):
                for oy in range(lo, hi + 1):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def polyline(self, points: Sequence[tuple[int, int]], color: Color, thickness: int = 1) -> None:
        if len(points) == 1:
            x, y = points[0]
            self.fill_rect(x - 1, y - 1, x + 1, y + 1, color)
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            self.line(xa, ya, xb, yb, color, thickness)

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return len(text) * 4 * scale - scale if text else 0

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 2) -> None:
        """Draw ``text`` (upper-cased) with its top-left corner at (x, y)."""
        for k, ch in enumerate(text.upper()):
            bits = _GLYPHS.get(ch, _GLYPHS["?"])
            ox = x + k * 4 * scale
            for r in range(5):
                for c in range(3):
                    if bits[3 * r + c] == "1":
                        self.fill_rect(ox + c * scale, y + r * scale, ox + (c + 1) * scale - 1,
                                       y + (r + 1) * scale - 1, color)

    def to_png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))
