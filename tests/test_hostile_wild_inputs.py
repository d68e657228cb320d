"""Hostile inputs from the wild: unusual image files and captions, pushed through sharding, the
training loader and evaluation.

* A 16-bit greyscale PNG with a transparency key (tRNS) is scaled to 8 bits like one without: PIL's
  RGBA conversion clipped the whole image to white, in training and evaluation alike.
* A centre crop of an extreme aspect ratio (a 1 x 20 000 spacer PNG of 161 bytes) resamples only
  the region it keeps: resized whole to 224 px wide it was 224 x 4 480 000 pixels (3 GB, 10 s per
  image) in evaluation and the batched loader; the loader and evaluation still agree exactly.
"""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from PIL import Image

from clipkit.data.image_modes import to_rgb
from clipkit.data.transforms import (
    MAX_RESIZED_SIDES,
    ImageTransform,
    ResizedUInt8,
    center_crop_geometry,
    decode_for_eval,
    decode_transformed,
    resize_center_crop,
)


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


def test_extreme_aspect_ratio_centre_crop_resamples_only_the_kept_region():
    side = 224
    _, resized, _ = center_crop_geometry((1, 20_000), side)
    assert resized == (side, side)  # was (224, 4 480 000)
    _, resized, _ = center_crop_geometry((1, MAX_RESIZED_SIDES), side)
    assert resized == (side, MAX_RESIZED_SIDES * side)  # up to the limit: torchvision's way, whole


def test_extreme_aspect_ratio_is_the_same_in_the_loader_and_evaluation():
    ramp = np.linspace(0, 255, 600).astype(np.uint8)[:, None, None].repeat(3, 1).repeat(3, 2)
    image = Image.fromarray(ramp)  # 3 x 600, dark at the top, light at the bottom
    data, side = encode(image), 8
    transform = ImageTransform(side, (0.0,) * 3, (1.0,) * 3)
    shown = decode_for_eval(data, transform, "strip.png")
    for decoder in ("auto", None):
        (loaded,) = decode_transformed(data, transform, random.Random(0), "strip.png", decoder=decoder)
        assert torch.equal(loaded, shown)
    (batched,) = decode_transformed(data, ResizedUInt8(side), random.Random(0), "strip.png")
    assert torch.equal(batched, torch.from_numpy(np.array(resize_center_crop(image, side))).permute(2, 0, 1))
    assert torch.equal(batched.float() / 255, shown)
    middle = np.asarray(image.resize((side, 1600), 3))[796:804].astype(int)  # the whole strip, cropped
    assert np.abs(shown.permute(1, 2, 0).numpy() * 255 - middle).max() <= 3
