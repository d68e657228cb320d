"""Image preprocessing without torchvision: PIL in, normalised float tensor [3, S, S] out.

Training: random-resized-crop (area fraction in ``crop_scale``, aspect ratio in ``crop_ratio``,
torchvision's sampling rule), optional horizontal flip and SimCLR's colour distortion.
Evaluation: resize the shorter side to S, then centre-crop S × S (CLIP's eval preprocessing).

Every random choice comes from the ``random.Random`` the caller passes (one per sample, seeded
from (seed, epoch, global index)), so augmentations are reproducible and independent of the
worker that decodes the sample.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import torch

BICUBIC = 3  # PIL.Image.BICUBIC, without importing PIL at module import


@dataclass(frozen=True)
class ImageTransform:
    """PIL image -> normalised float tensor [3, S, S] (S = ``image_size``).

    crop_scale:   random-resized-crop area range (train); (1, 1) = no random crop, i.e. the
                  deterministic eval path (resize shorter side + centre crop).
    crop_ratio:   aspect-ratio range (width / height) of random crops, sampled log-uniformly.
    hflip:        random horizontal flip (off by default: captions may say "left"/"right").
    color_jitter: SimCLR colour-distortion strength s (0 = off): with probability 0.8 jitter
                  brightness, contrast, saturation by up to 0.8·s and hue by up to 0.2·s,
                  in random order (Chen et al. 2020, appendix A).
    grayscale:    probability of converting to grey (SimCLR: 0.2).
    """

    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_scale: tuple[float, float] = (1.0, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = False
    color_jitter: float = 0.0
    grayscale: float = 0.0

    def __post_init__(self) -> None:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < low <= high, got {self.crop_ratio}")
        if self.color_jitter < 0 or not 0 <= self.grayscale <= 1:
            raise ValueError("color_jitter must be >= 0 and grayscale a probability in [0, 1]")

    @property
    def random_crop(self) -> bool:
        return tuple(self.crop_scale) != (1.0, 1.0)

    def __call__(self, image, rng: random.Random) -> torch.Tensor:
        """PIL image (any mode) -> [3, S, S] float32, normalised by mean/std."""
        image = image.convert("RGB")
        if self.random_crop:
            box = random_resized_crop_box(image.size, self.crop_scale, self.crop_ratio, rng)
            image = image.resize((self.image_size, self.image_size), BICUBIC, box=box)
        else:
            image = resize_center_crop(image, self.image_size)
        if self.hflip and rng.random() < 0.5:
            image = image.transpose(0)  # PIL.Image.FLIP_LEFT_RIGHT
        if self.color_jitter > 0 and rng.random() < 0.8:
            image = jitter_colours(image, self.color_jitter, rng)
        if self.grayscale > 0 and rng.random() < self.grayscale:
            image = image.convert("L").convert("RGB")
        return self.to_tensor(image)

    def to_tensor(self, image) -> torch.Tensor:
        import numpy as np

        array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean, std = self.normalisation
        return (array - mean) / std

    @functools.cached_property
    def normalisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([3, 1, 1] mean, [3, 1, 1] std), built once rather than per image."""
        return torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)


@dataclass(frozen=True)
class ResizedUInt8:
    """PIL image -> uint8 tensor [3, size, size] (shorter side resized, centre crop), for
    ``data.augment: batched``, where the random crop, flip and normalisation run on the device."""

    size: int

    def __call__(self, image, rng: random.Random) -> torch.Tensor:
        import numpy as np

        image = resize_center_crop(image.convert("RGB"), self.size)
        return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


def resize_center_crop(image, size: int):
    """Resize so the shorter side is ``size`` (bicubic), then crop the central size × size."""
    width, height = image.size
    if (width, height) == (size, size):
        return image
    scale = size / min(width, height)
    new_width, new_height = max(size, round(width * scale)), max(size, round(height * scale))
    left, top = (new_width - size) // 2, (new_height - size) // 2
    return image.resize((new_width, new_height), BICUBIC).crop((left, top, left + size, top + size))


def random_resized_crop_box(
    size: tuple[int, int], scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a crop whose area fraction lies in ``scale`` and aspect ratio
    (width / height) in ``ratio``, log-uniform; torchvision's rule: 10 tries, then the largest
    centred crop whose ratio is clamped into ``ratio``."""
    width, height = size
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_low, log_high))
        crop_w = round(math.sqrt(target * aspect))
        crop_h = round(math.sqrt(target / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = rng.randint(0, width - crop_w)
            top = rng.randint(0, height - crop_h)
            return left, top, left + crop_w, top + crop_h
    if width / height < ratio[0]:  # too tall: full width, clamp the height
        crop_w, crop_h = width, round(width / ratio[0])
    elif width / height > ratio[1]:  # too wide: full height, clamp the width
        crop_w, crop_h = round(height * ratio[1]), height
    else:
        crop_w, crop_h = width, height
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return left, top, left + crop_w, top + crop_h


def jitter_colours(image, strength: float, rng: random.Random):
    """SimCLR's colour jitter: brightness, contrast, saturation (factors in [1 − 0.8s, 1 + 0.8s])
    and hue (shift in [−0.2s, 0.2s] of a turn, capped at 0.5), applied in a random order."""
    from PIL import ImageEnhance

    spread, hue_spread = 0.8 * strength, min(0.5, 0.2 * strength)
    operations = [
        lambda im: ImageEnhance.Brightness(im).enhance(rng.uniform(max(0.0, 1 - spread), 1 + spread)),
        lambda im: ImageEnhance.Contrast(im).enhance(rng.uniform(max(0.0, 1 - spread), 1 + spread)),
        lambda im: ImageEnhance.Color(im).enhance(rng.uniform(max(0.0, 1 - spread), 1 + spread)),
        lambda im: shift_hue(im, rng.uniform(-hue_spread, hue_spread)),
    ]
    rng.shuffle(operations)
    for operation in operations:
        image = operation(image)
    return image


def shift_hue(image, shift: float):
    """Rotate the hue of an RGB PIL image by ``shift`` turns (−0.5..0.5) through PIL's HSV mode."""
    import numpy as np
    from PIL import Image

    hsv = np.array(image.convert("HSV"))
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(shift * 255))) % 256
    return Image.fromarray(hsv, "HSV").convert("RGB")
