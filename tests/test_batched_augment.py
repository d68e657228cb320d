"""Batched random-resized-crop + flip + normalise on uint8 tensors (clipkit.data.batched_augment)."""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from clipkit.data.batched_augment import CROP_TRIES, BatchedAugment, centred_square_boxes, sample_crop_boxes
from clipkit.data.transforms import ImageTransform, random_resized_crop_box

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def augment(**options) -> BatchedAugment:
    options = {"image_size": 16, "mean": MEAN, "std": STD, "backend": "torch", **options}
    return BatchedAugment(**options)


def random_images(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=generator)


def smooth_images(batch: int, height: int, width: int) -> torch.Tensor:
    """Gradients plus a slow sinusoid: smooth enough that interpolation schemes nearly agree."""
    y = torch.arange(height, dtype=torch.float64)[:, None]
    x = torch.arange(width, dtype=torch.float64)[None, :]
    phases = torch.arange(batch, dtype=torch.float64)[:, None, None, None]
    channels = torch.stack(
        [255 * x / width + 0 * y, 255 * y / height + 0 * x, 127.5 + 100 * torch.sin((x + y) / 9)], dim=0
    )
    return (channels[None] + 3 * phases).clamp(0, 255).round().to(torch.uint8)


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """Reference normalisation of float pixels on the 0..255 scale, [B, 3, H, W]."""
    return (pixels / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


# --- box sampling -----------------------------------------------------------------------------


class ReplayRng:
    """Stands in for random.Random in transforms.random_resized_crop_box, replaying the draws that
    sample_crop_boxes takes from a torch generator (documented draw order), so the vectorised rule
    can be compared box by box with the scalar reference."""

    def __init__(self, area_fractions, log_ratios, offset_fractions):
        self.uniforms = [v for pair in zip(area_fractions, log_ratios, strict=True) for v in pair]
        self.offsets = list(offset_fractions)

    def uniform(self, low, high):
        value = self.uniforms.pop(0)
        assert low <= value <= high
        return value

    def randint(self, low, high):
        assert low == 0
        return math.floor(self.offsets.pop(0) * (high + 1))


@pytest.mark.parametrize(
    ("height", "width", "scale", "ratio"),
    [
        (48, 64, (0.08, 1.0), (3 / 4, 4 / 3)),
        (40, 40, (0.5, 1.0), (0.5, 2.0)),
        (12, 90, (0.3, 1.0), (3 / 4, 4 / 3)),
    ],
)
def test_boxes_follow_the_scalar_torchvision_rule_draw_for_draw(height, width, scale, ratio):
    batch = 300
    boxes = sample_crop_boxes(batch, height, width, scale, ratio, torch.Generator().manual_seed(3))
    # re-draw the same numbers in the documented order: area fractions, log ratios, offsets
    generator = torch.Generator().manual_seed(3)
    area = torch.empty(batch, CROP_TRIES, dtype=torch.float64).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(batch, CROP_TRIES, dtype=torch.float64).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    offsets = torch.rand(batch, 2, dtype=torch.float64, generator=generator)
    fallbacks = 0
    for i in range(batch):
        rng = ReplayRng(area[i].tolist(), log_ratio[i].tolist(), offsets[i].tolist())
        expected = random_resized_crop_box((width, height), scale, ratio, rng)
        assert tuple(boxes[i].tolist()) == expected, i
        fallbacks += len(rng.offsets) == 2  # no offset drawn: all 10 candidates failed, fallback taken
    if width / height > ratio[1]:  # the wide case never fits a large crop: fallbacks must occur
        assert fallbacks > 0


def test_boxes_lie_inside_the_image_with_area_and_ratio_in_range_up_to_rounding():
    height, width, scale, ratio = 64, 80, (0.25, 0.9), (3 / 4, 4 / 3)
    boxes = sample_crop_boxes(4000, height, width, scale, ratio, torch.Generator().manual_seed(0)).double()
    left, top, right, bottom = boxes.unbind(1)
    assert (left >= 0).all() and (top >= 0).all() and (right <= width).all() and (bottom <= height).all()
    w, h = right - left, bottom - top
    assert (w > 0).all() and (h > 0).all()
    # w and h are rounded from real values, so allow half a pixel each way
    fraction = w * h / (height * width)
    assert (fraction >= scale[0] * (1 - 0.5 / w) * (1 - 0.5 / h)).all()
    assert (fraction <= scale[1] * (1 + 0.5 / w) * (1 + 0.5 / h)).all()
    assert ((w + 0.5) / (h - 0.5) >= ratio[0]).all() and ((w - 0.5) / (h + 0.5) <= ratio[1]).all()
    # the offsets are spread over the whole free range, not stuck at a corner or the centre
    slack = (width - w).clamp(min=1)
    relative_left = left / slack
    assert (
        relative_left.min() < 0.05 and relative_left.max() > 0.95 and abs(relative_left.mean() - 0.5) < 0.05
    )


def test_fallback_is_the_centred_crop_with_clamped_ratio():
    # 200 × 10 image: no crop of >= 90 % of the area has a ratio <= 4/3, so all ten tries fail
    boxes = sample_crop_boxes(5, 10, 200, (0.9, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(0))
    crop_w = round(10 * 4 / 3)
    left = (200 - crop_w) // 2
    assert boxes.tolist() == [[left, 0, left + crop_w, 10]] * 5


def test_centred_square_boxes():
    assert centred_square_boxes(2, 30, 50).tolist() == [[10, 0, 40, 30]] * 2
    assert centred_square_boxes(1, 7, 7).tolist() == [[0, 0, 7, 7]]


# --- outputs ----------------------------------------------------------------------------------


def test_same_seed_same_output_and_another_seed_differs():
    images = random_images(6, 24, 20)
    module = augment(crop_scale=(0.3, 1.0), hflip=True)
    first = module(images, torch.Generator().manual_seed(7))
    again = module(images, torch.Generator().manual_seed(7))
    other = module(images, torch.Generator().manual_seed(8))
    assert first.shape == (6, 3, 16, 16) and first.dtype == torch.float32
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_identity_path_is_exactly_the_normalisation():
    images = random_images(4, 16, 16)
    out = augment()(images, torch.Generator().manual_seed(0))
    assert torch.equal(out, normalise(images.float()))


def test_identity_path_matches_the_per_sample_transform_bit_for_bit():
    images = random_images(2, 16, 16)
    transform = ImageTransform(image_size=16, mean=MEAN, std=STD)
    per_sample = [
        transform(Image.fromarray(image.permute(1, 2, 0).numpy()), random.Random(0)) for image in images
    ]
    assert torch.equal(augment()(images), torch.stack(per_sample))


def test_deterministic_path_on_a_larger_square_input_is_a_two_by_two_block_average():
    images = random_images(3, 32, 32)
    block_means = F.avg_pool2d(images.double(), 2).float()
    torch.testing.assert_close(augment()(images), normalise(block_means), atol=1e-5, rtol=0)


def test_deterministic_path_on_a_non_square_input_takes_the_centred_square():
    images = random_images(2, 16, 24)  # S = 16: the centred 16 × 16 square, columns 4..19, unresampled
    torch.testing.assert_close(augment()(images), normalise(images[..., 4:20].float()), atol=1e-5, rtol=0)


def test_downscaled_crop_is_the_block_average_of_the_crop():
    images = random_images(2, 48, 56)
    boxes = torch.tensor([[10, 6, 42, 38], [0, 16, 32, 48]])  # 32 × 32 crops -> 16 × 16
    out = augment().apply_params(images, boxes)
    for image, (left, top, right, bottom), result in zip(images, boxes.tolist(), out, strict=True):
        crop = image[:, top:bottom, left:right].double()
        expected = normalise(F.avg_pool2d(crop[None], 2).float())[0]
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)


def test_upscaled_crop_equals_interpolating_the_cropped_tensor():
    images = random_images(2, 40, 40)
    boxes = torch.tensor([[5, 7, 21, 19], [24, 0, 40, 14]])  # 16 × 12 and 16 × 14 crops -> 24 × 24
    out = augment(image_size=24).apply_params(images, boxes)
    for image, (left, top, right, bottom), result in zip(images, boxes.tolist(), out, strict=True):
        crop = image[None, :, top:bottom, left:right].float()
        resized = F.interpolate(crop, size=(24, 24), mode="bilinear", align_corners=False)
        torch.testing.assert_close(result, normalise(resized)[0], atol=1e-4, rtol=0)


def test_hflip_mirrors_the_flipped_images_only():
    images = random_images(16, 16, 16)
    module = augment(hflip=True)
    out = module(images, torch.Generator().manual_seed(5))
    _, flips = module.sample_params(16, 16, 16, torch.Generator().manual_seed(5))
    assert 0 < int(flips.sum()) < 16  # this seed gives both cases
    plain = normalise(images.float())
    expected = torch.where(flips.view(-1, 1, 1, 1), plain.flip(-1), plain)
    assert torch.equal(out, expected)
    _, many = module.sample_params(4000, 16, 16, torch.Generator().manual_seed(0))
    assert abs(many.double().mean().item() - 0.5) < 0.03


@pytest.mark.parametrize("backend", ["torch", "kornia"])
def test_hflip_of_a_resampled_crop_mirrors_the_unflipped_crop(backend):
    if backend == "kornia":
        pytest.importorskip("kornia")
    images = random_images(4, 40, 36)
    boxes = torch.tensor([[0, 0, 36, 40], [3, 5, 30, 33], [10, 20, 20, 32], [1, 2, 9, 7]])  # down and up
    flips = torch.tensor([True, False, True, True])
    module = augment(image_size=20, hflip=True, backend=backend)
    plain = module.apply_params(images, boxes)
    expected = torch.where(flips.view(-1, 1, 1, 1), plain.flip(-1), plain)
    tolerance = 0 if backend == "torch" else 2e-4  # torch reverses the same sample positions: exact
    torch.testing.assert_close(module.apply_params(images, boxes, flips), expected, atol=tolerance, rtol=0)


def test_forward_uses_the_boxes_of_sample_params():
    images = random_images(5, 30, 26)
    module = augment(crop_scale=(0.2, 0.8), hflip=True)
    boxes, flips = module.sample_params(5, 30, 26, torch.Generator().manual_seed(11))
    expected = module.apply_params(images, boxes, flips)
    assert torch.equal(module(images, torch.Generator().manual_seed(11)), expected)


def test_empty_batch():
    out = augment(crop_scale=(0.5, 1.0))(random_images(0, 20, 20), torch.Generator().manual_seed(0))
    assert out.shape == (0, 3, 16, 16)


# --- kornia backend -------------------------------------------------------------------------


def test_kornia_backend_agrees_with_the_torch_backend_on_the_same_boxes():
    pytest.importorskip("kornia")
    images = smooth_images(8, 40, 48)
    torch_backend = augment(image_size=32, crop_scale=(0.25, 1.0), hflip=True)
    kornia_backend = augment(image_size=32, crop_scale=(0.25, 1.0), hflip=True, backend="kornia")
    assert kornia_backend.backend == "kornia"
    expected = torch_backend(images, torch.Generator().manual_seed(2))
    out = kornia_backend(images, torch.Generator().manual_seed(2))
    assert out.shape == expected.shape and out.dtype == torch.float32
    # same sample points; only the outermost ring differs where a crop is upscaled (kornia does not
    # clamp to the crop and blends in the neighbouring pixels)
    interior = (slice(None), slice(None), slice(1, -1), slice(1, -1))
    torch.testing.assert_close(out[interior], expected[interior], atol=1e-4, rtol=0)
    assert (out - expected).abs().max() < 0.05  # < 0.05 std even at the edges of a smooth image


def test_kornia_backend_equals_torch_where_crops_are_only_downscaled():
    pytest.importorskip("kornia")
    images = random_images(3, 48, 48)  # noise: any misplaced sample point would show
    boxes = torch.tensor([[0, 0, 48, 48], [3, 5, 40, 45], [10, 2, 44, 38]])
    expected = augment(image_size=32).apply_params(images, boxes)
    out = augment(image_size=32, backend="kornia").apply_params(images, boxes)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=0)


def test_missing_kornia(monkeypatch):
    monkeypatch.setitem(sys.modules, "kornia", None)  # makes `import kornia` raise ImportError
    with pytest.raises(ImportError, match="pip install kornia"):
        augment(backend="kornia")
    assert augment(backend="auto").backend == "torch"


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"image_size": 0}, "image_size"),
        ({"image_size": 16.0}, "image_size"),
        ({"mean": (0.5, 0.5)}, "mean"),
        ({"std": (0.2, 0.0, 0.3)}, "std"),
        ({"crop_scale": (0.0, 1.0)}, "crop_scale"),
        ({"crop_scale": (0.9, 0.5)}, "crop_scale"),
        ({"crop_scale": (0.5, 1.5)}, "crop_scale"),
        ({"crop_ratio": (2.0, 1.0)}, "crop_ratio"),
        ({"crop_ratio": 1.0}, "crop_ratio"),
        ({"hflip": "yes"}, "hflip"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_arguments_name_the_argument(options, name):
    with pytest.raises(ValueError, match=name):
        augment(**options)


@pytest.mark.parametrize(
    "images",
    [
        torch.zeros(2, 3, 8, 8, dtype=torch.float64),
        torch.zeros(2, 3, 8, 8, dtype=torch.float32),
        torch.zeros(3, 8, 8, dtype=torch.uint8),
        torch.zeros(2, 1, 8, 8, dtype=torch.uint8),
        np.zeros((2, 3, 8, 8), dtype=np.uint8),
    ],
)
def test_only_uint8_batches_are_accepted(images):
    with pytest.raises(ValueError, match="images must"):
        augment()(images, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "boxes",
    [
        torch.tensor([[0, 0, 8, 8]]),  # one box for two images
        torch.tensor([[0, 0, 8, 8], [0, 0, 9, 8]]),  # past the right edge
        torch.tensor([[0, 0, 8, 8], [4, 2, 4, 6]]),  # empty
        torch.tensor([[0.0, 0.0, 8.0, 8.0], [0.0, 0.0, 8.0, 8.0]]),  # not integer
    ],
)
def test_bad_boxes(boxes):
    with pytest.raises(ValueError, match="boxes must"):
        augment().apply_params(random_images(2, 8, 8), boxes)


def test_generator_must_be_a_torch_generator():
    with pytest.raises(ValueError, match="generator"):
        augment(hflip=True)(random_images(1, 16, 16), random.Random(0))


def test_from_image_transform():
    transform = ImageTransform(image_size=24, mean=MEAN, std=STD, crop_scale=(0.5, 1.0), hflip=True)
    module = BatchedAugment.from_image_transform(transform, backend="torch")
    assert (module.image_size, module.crop_scale, module.crop_ratio, module.hflip) == (
        24,
        (0.5, 1.0),
        (0.75, 4 / 3),
        True,
    )
    assert torch.equal(module.mean.flatten(), torch.tensor(MEAN)) and torch.equal(
        module.std.flatten(), torch.tensor(STD)
    )
    with pytest.raises(ValueError, match="color_jitter"):
        BatchedAugment.from_image_transform(
            ImageTransform(image_size=24, mean=MEAN, std=STD, color_jitter=0.5)
        )
