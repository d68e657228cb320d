"""Hostile inputs from the wild: unusual image files and captions, pushed through sharding, the
training loader and evaluation.

* A 16-bit greyscale PNG with a transparency key (tRNS) is scaled to 8 bits like one without: PIL's
  RGBA conversion clipped the whole image to white, in training and evaluation alike.
"""

from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image

from clipkit.data.image_modes import to_rgb
from clipkit.data.transforms import ImageTransform, ResizedUInt8, decode_for_eval, decode_transformed


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def grey16_ramp(width: int = 64, height: int = 8) -> np.ndarray:
    """A [height, width] uint16 ramp from 0 to 65535 along the width."""
    return np.linspace(0, 65535, width, dtype=np.float64).round().astype(np.uint16)[None].repeat(height, 0)


def test_sixteen_bit_grey_with_a_transparency_key_is_scaled_not_white():
    ramp = grey16_ramp()
    data = encode(Image.fromarray(ramp), transparency=0)  # only the darkest column is transparent
    with Image.open(io.BytesIO(data)) as image:
        assert image.mode == "I;16" and image.info["transparency"] == 0
        rgb = np.asarray(to_rgb(image, background=(0, 0, 255)))
    expected = (ramp.astype(np.int64) * 255 + 32767) // 65535
    assert (rgb[:, 1:, 0] == expected[:, 1:]).all()  # opaque pixels: scaled grey
    assert (rgb[:, 0] == (0, 0, 255)).all()  # the key's pixels: the background
    transform = ImageTransform(8, (0.0,) * 3, (1.0,) * 3)
    shown = decode_for_eval(data, transform, "g16.png").mean().item() * 255
    (loaded,) = decode_transformed(data, ResizedUInt8(8), random.Random(0), "g16.png")
    assert 100 < shown < 160 and 100 < loaded.float().mean().item() < 160  # was 255: all white
