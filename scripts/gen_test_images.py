#!/usr/bin/env python3
"""Generates the test images in tests/fixtures/images/ for the `cnn` test model.

Run with the tooling venv (scripts/setup.sh makes it):

    .venv/bin/python scripts/gen_test_images.py

scripts/make_reference.py runs it too (before it computes
tests/fixtures/cnn_reference.json), so `make fixtures` covers it.

The output is byte-for-byte the same on every run: the noise comes from a fixed
seed, Pillow is pinned in scripts/requirements.txt (its PNG and JPEG encoders
carry their own zlib and libjpeg-turbo), and no metadata or timestamp is written.
An identical file is left alone.

Images the server must classify (tests/fixtures/cnn_reference.json has what
Pillow + onnxruntime make of them):

red.png     64x48 RGB PNG, red-dominant, diagonal stripes and noise
green.jpg   50x70 RGB JPEG (non-square), green-dominant, a vertical gradient
blue.png    40x36 RGBA PNG, blue-dominant, alpha from 255 down to 64 (the
            server drops alpha, it does not blend)
gray.jpg    48x32 single-channel (grayscale) JPEG, a horizontal gradient: the
            server must expand it to RGB

Inputs the server must refuse:

truncated.jpg     the first half of a valid 48x48 JPEG
not_an_image.txt  plain text
huge.png          80 bytes: a PNG signature, an IHDR chunk that declares
                  20000x20000 8-bit RGB (correct CRC), one small IDAT whose
                  zlib stream holds only the first 5 pixels and then stops,
                  and IEND. Decoding it would need 1.2 GB: a server must
                  refuse it from the header (400M pixels > max_pixels).
zero.png          0 bytes
"""

import io
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from gen_test_models import write_if_changed

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "images"

HUGE_SIDE = 20000
JPEG_QUALITY = 90


def encode(image, fmt):
    buf = io.BytesIO()
    if fmt == "PNG":
        image.save(buf, format="PNG", optimize=False, compress_level=9)
    else:
        image.save(buf, format="JPEG", quality=JPEG_QUALITY, optimize=False, progressive=False, subsampling=0)
    return buf.getvalue()


def noisy(base, height, width, amplitude, seed):
    """uint8 [height, width, len(base)]: base colour + uniform noise in [-amplitude, amplitude]."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(-amplitude, amplitude + 1, size=(height, width, len(base)))
    return np.asarray(base, np.int64) + noise


def to_uint8(values):
    return np.clip(values, 0, 255).astype(np.uint8)


def red_png():
    h, w = 48, 64
    pixels = noisy((200, 45, 50), h, w, 18, seed=1)
    y, x = np.mgrid[0:h, 0:w]
    stripes = ((x + y) // 6) % 2 == 0
    pixels[stripes] += np.array([40, 20, 10])
    return encode(Image.fromarray(to_uint8(pixels), "RGB"), "PNG")


def green_jpg():
    h, w = 70, 50
    pixels = noisy((45, 185, 60), h, w, 12, seed=2)
    pixels[:, :, 1] += (np.arange(h)[:, None] * 60 // (h - 1)) - 30
    return encode(Image.fromarray(to_uint8(pixels), "RGB"), "JPEG")


def blue_png():
    h, w = 36, 40
    rgb = noisy((40, 70, 210), h, w, 15, seed=3)
    alpha = np.broadcast_to((255 - np.arange(w) * 191 // (w - 1))[None, :, None], (h, w, 1))
    rgba = np.concatenate([to_uint8(rgb), alpha.astype(np.uint8)], axis=2)
    return encode(Image.fromarray(rgba, "RGBA"), "PNG")


def gray_jpg():
    h, w = 32, 48
    level = 70 + np.arange(w)[None, :] * 120 // (w - 1) + np.zeros((h, 1), np.int64)
    return encode(Image.fromarray(to_uint8(level), "L"), "JPEG")


def truncated_jpg():
    pixels = noisy((230, 140, 40), 48, 48, 25, seed=4)
    data = encode(Image.fromarray(to_uint8(pixels), "RGB"), "JPEG")
    return data[: len(data) // 2]


def png_chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def huge_png():
    # IHDR: width, height, bit depth 8, colour type 2 (RGB), deflate, filter 0, no interlace.
    ihdr = struct.pack(">IIBBBBB", HUGE_SIDE, HUGE_SIDE, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", huge_png_idat()) + png_chunk(b"IEND", b"")


def huge_png_idat():
    """The start of a zlib stream, written by hand so that no zlib version can change it:
    the header (deflate, 32K window, no dictionary), then one stored, non-final block of
    16 zero bytes (filter byte 0 and the first 5 black pixels of row 0). The stream
    just stops there: no final block, no Adler-32."""
    stored = b"\x00" * 16
    block = b"\x00" + struct.pack("<HH", len(stored), len(stored) ^ 0xFFFF) + stored
    return b"\x78\x01" + block


IMAGES = {
    "red.png": red_png,
    "green.jpg": green_jpg,
    "blue.png": blue_png,
    "gray.jpg": gray_jpg,
    "truncated.jpg": truncated_jpg,
    "huge.png": huge_png,
}
# Files the cnn model should classify, with the label it should give.
GOOD = {"red.png": "red", "green.jpg": "green", "blue.png": "blue", "gray.jpg": "gray"}

NOT_AN_IMAGE = (
    "This is not an image.\n"
    "inferd must answer 400 when a request's image is plain text like this file.\n"
).encode()


def check(path, name):
    """Pillow reads the good images with the expected mode and size, and refuses the bad ones."""
    if name in GOOD:
        with Image.open(path) as im:
            im.load()
            want = {"red.png": ("RGB", (64, 48)), "green.jpg": ("RGB", (50, 70)),
                    "blue.png": ("RGBA", (40, 36)), "gray.jpg": ("L", (48, 32))}[name]
            assert (im.mode, im.size) == want, (name, im.mode, im.size, want)
        return
    if name == "huge.png":
        # Pillow's own decompression-bomb guard refuses it from the header alone.
        try:
            Image.open(path)
        except Image.DecompressionBombError:
            return
        raise AssertionError("huge.png: Pillow opened it; expected DecompressionBombError")
    try:
        with Image.open(path) as im:
            im.load()
    except Exception:
        return
    raise AssertionError(f"{name}: Pillow decoded it, but it should be unreadable")


def main():
    written = {name: build() for name, build in IMAGES.items()}
    written["not_an_image.txt"] = NOT_AN_IMAGE
    written["zero.png"] = b""
    total = 0
    for name, data in written.items():
        path = OUT_DIR / name
        changed = write_if_changed(path, data)
        check(path, name)
        total += len(data)
        print(f"{path.relative_to(REPO)}: {'written' if changed else 'unchanged'} ({len(data)} bytes)")
    print(f"{OUT_DIR.relative_to(REPO)}: {len(written)} files, {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
