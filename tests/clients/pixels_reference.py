"""What the `pixels` test model (tests/models/pixels) should be fed for two generated images,
computed the way Hugging Face's image processors do it with Pillow: the shorter side resized
to `shortest_edge` (the longer one in proportion, rounded down), bicubic, then the centre
`width` x `height` cut out (offsets rounded down), scaled by 1/255, channels first.

Prints a JSON list of {"size", "png" (base64), "expected" (the flattened input)}.
"""

import base64
import io
import json
import tomllib
from pathlib import Path

import numpy as np
from PIL import Image

MODEL = Path(__file__).resolve().parents[1] / "models" / "pixels" / "model.toml"


def image(width, height):
    """Smooth gradients, different in each channel and direction."""
    img = Image.new("RGB", (width, height))
    px = img.load()
    for x in range(width):
        for y in range(height):
            px[x, y] = (x * 255 // (width - 1), y * 255 // (height - 1), (x * 3 + y * 4) % 256)
    return img


def resized_crop(img, edge, width, height, resample):
    """As Hugging Face's image processors: the shorter side to `edge`, the longer in proportion
    (transformers' int()), then the centre `width` x `height` (offsets rounded down)."""
    w, h = img.size
    size = (edge, int(edge * h / w)) if w <= h else (int(edge * w / h), edge)
    resized = img.resize(size, resample)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return resized.crop((left, top, left + width, top + height))


def expected(img, c):
    crop = resized_crop(img, c["shortest_edge"], c["width"], c["height"], Image.BICUBIC)
    return (np.asarray(crop, np.float32) / 255.0).transpose(2, 0, 1).reshape(-1)


def main():
    c = tomllib.loads(MODEL.read_text())["image"]
    cases = []
    for width, height in ((40, 20), (21, 45)):
        img = image(width, height)
        buf = io.BytesIO()
        img.save(buf, "PNG")
        cases.append({
            "size": f"{width}x{height}",
            "png": base64.b64encode(buf.getvalue()).decode(),
            "expected": [float(v) for v in expected(img, c)],
        })
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
