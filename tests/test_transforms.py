"""Image preprocessing: eval resize + centre crop, random-resized-crop geometry, SimCLR colour ops."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from clipkit.data.transforms import ImageTransform, random_resized_crop_box, resize_center_crop

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def gradient_image(width: int, height: int) -> Image.Image:
    """An image whose pixels encode their own coordinates (crops are recognisable)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    rgb = np.stack([x, y, 255 - x], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def denormalise(tensor: torch.Tensor) -> torch.Tensor:
    return tensor * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)


def test_constant_image_normalises_per_channel():
    image = Image.new("RGB", (10, 10), (51, 102, 204))
    out = ImageTransform(image_size=10, mean=MEAN, std=STD)(image, random.Random(0))
    expected = (torch.tensor([51, 102, 204]) / 255.0 - torch.tensor(MEAN)) / torch.tensor(STD)
    assert out.shape == (3, 10, 10) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 4, 4], expected)


def test_eval_path_resizes_the_shorter_side_then_centre_crops():
    image = gradient_image(90, 60)  # landscape: shorter side 60 -> 48, width 90 -> 72, crop 12 off each side
    out = ImageTransform(image_size=48, mean=MEAN, std=STD)(image, random.Random(0))
    reference = image.resize((72, 48), Image.BICUBIC).crop((12, 0, 60, 48))
    expected = torch.from_numpy(np.asarray(reference, dtype=np.float32) / 255).permute(2, 0, 1)
    torch.testing.assert_close(denormalise(out), expected, atol=1e-6, rtol=0)


def test_eval_path_of_a_square_image_of_the_right_size_is_identity():
    image = gradient_image(32, 32)
    assert resize_center_crop(image, 32) is image


def test_random_crop_boxes_respect_scale_and_ratio():
    rng = random.Random(0)
    scale, ratio = (0.3, 0.7), (3 / 4, 4 / 3)
    for _ in range(500):
        left, top, right, bottom = random_resized_crop_box((200, 150), scale, ratio, rng)
        width, height = right - left, bottom - top
        assert 0 <= left < right <= 200 and 0 <= top < bottom <= 150
        # Rounding each side to whole pixels moves area and ratio by at most ~1 px per side.
        assert scale[0] - 0.02 <= width * height / (200 * 150) <= scale[1] + 0.02
        assert ratio[0] - 0.02 <= width / height <= ratio[1] + 0.02


def test_impossible_crops_fall_back_to_the_centred_clamped_crop():
    # A 100x10 strip cannot hold a crop of aspect ratio <= 2 covering >= 90% of its area.
    box = random_resized_crop_box((100, 10), (0.9, 1.0), (0.5, 2.0), random.Random(0))
    assert box == (40, 0, 60, 10)


def test_training_crops_are_reproducible_from_the_sample_rng_and_differ_across_seeds():
    transform = ImageTransform(image_size=16, mean=MEAN, std=STD, crop_scale=(0.2, 0.5), hflip=True)
    image = gradient_image(64, 48)
    first = transform(image, random.Random("aug:0:0:7"))
    again = transform(image, random.Random("aug:0:0:7"))
    other = transform(image, random.Random("aug:0:0:8"))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_grayscale_with_probability_one_makes_equal_channels():
    transform = ImageTransform(image_size=16, mean=MEAN, std=STD, grayscale=1.0)
    pixels = denormalise(transform(gradient_image(16, 16), random.Random(0)))
    torch.testing.assert_close(pixels[0], pixels[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(pixels[1], pixels[2], atol=1e-6, rtol=0)


def test_colour_jitter_changes_colours_not_geometry():
    halves = np.zeros((16, 16, 3), dtype=np.uint8)
    halves[:, :8] = (200, 40, 40)
    halves[:, 8:] = (30, 90, 160)
    image = Image.fromarray(halves, "RGB")
    plain = ImageTransform(image_size=16, mean=MEAN, std=STD)(image, random.Random(0))
    jittered = ImageTransform(image_size=16, mean=MEAN, std=STD, color_jitter=1.0)
    outputs = [jittered(image, random.Random(seed)) for seed in range(6)]
    # Each draw jitters with probability 0.8; all six skipping has probability 6e-5.
    assert any(not torch.allclose(out, plain) for out in outputs)
    for out in outputs:  # colour ops are per pixel: each half stays uniform
        for half in (out[:, :, :8], out[:, :, 8:]):
            assert torch.allclose(half, half[:, :1, :1].expand_as(half), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"crop_scale": (0.0, 1.0)}, "crop_scale"),
        ({"crop_scale": (0.8, 0.5)}, "crop_scale"),
        ({"crop_ratio": (2.0, 1.0)}, "crop_ratio"),
        ({"grayscale": 1.5}, "grayscale"),
        ({"color_jitter": -1.0}, "color_jitter"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageTransform(image_size=8, mean=MEAN, std=STD, **kwargs)


def test_hflip_mirrors_the_image():
    image = gradient_image(8, 8)
    transform = ImageTransform(image_size=8, mean=MEAN, std=STD, hflip=True)
    outputs = {transform(image, random.Random(seed))[0, 0, 0].item() for seed in range(20)}
    assert len(outputs) == 2  # both the original and the mirrored left edge appear
    assert math.isclose(max(outputs) + min(outputs), 2 * (127.5 / 255 - MEAN[0]) / STD[0], abs_tol=1e-5)
