"""Images and a reference for the eval-preprocessing tests (tests/test_eval_preprocess.py) and for
tools/make_eval_preprocess_reference.py, which stored torchvision's own output for them once.

``torchvision_reference`` restates, with plain PIL and torch operations, what torchvision's
``Compose([Resize(S, BICUBIC, antialias=True), CenterCrop(S), ToTensor(), Normalize(mean, std)])``
computes on a PIL RGB image (torchvision 0.28, ``transforms/functional.py``): the shorter side
becomes S and the longer ``int(S * long / short)``; PIL's ``Image.resize(size, BICUBIC)`` unless
the size is unchanged; crop offsets ``int(round((length - S) / 2.0))``; then uint8 -> float32
/ 255, minus mean, divided by std. The stored torchvision arrays check this restatement, so the
live tests (other modes, real photos) can use it where torchvision cannot be imported.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's

#: name -> (width, height, S). Chosen so that each rule that differs between implementations shows:
#: landscape/portrait: truncated long side (640 × 427 at 24 -> 35 × 24, rounding gives 36; at 48
#: -> 71 × 48, the issue's example); odd sizes; smaller than the crop (upsampled); square (no
#: crop); already S × S (identity); short side already S (no resample) with a slack of 35 (offset
#: round(17.5) = 18, flooring gives 17) and 37 (round(18.5) = 18 half-to-even, half-up gives 19).
CASES = {
    "landscape_640x427": (640, 427, 24),
    "portrait_427x640": (427, 640, 24),
    "landscape_640x427_s48": (640, 427, 48),
    "odd_33x17": (33, 17, 24),
    "odd_17x33": (17, 33, 24),
    "small_7x5": (7, 5, 24),
    "square_50x50": (50, 50, 24),
    "exact_24x24": (24, 24, 24),
    "slack35_59x24": (59, 24, 24),
    "slack37_24x61": (24, 61, 24),
}


def case_image(name: str) -> Image.Image:
    """The RGB image of case ``name``: seeded uniform noise (every resampling or offset error shows)."""
    width, height, _ = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def reference_pixels(image: Image.Image, size: int) -> np.ndarray:
    """torchvision's Resize(size) + CenterCrop(size) of an RGB PIL image -> [size, size, 3] uint8."""
    width, height = image.size
    if width <= height:
        new_width, new_height = size, int(size * height / width)
    else:
        new_width, new_height = int(size * width / height), size
    if (new_width, new_height) != (width, height):
        image = image.resize((new_width, new_height), Image.BICUBIC)
    top, left = int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0))
    return np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)


def to_tensor_normalize(pixels: np.ndarray, mean=MEAN, std=STD) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, H, W] float32: ToTensor (/ 255) then Normalize, as torchvision orders them."""
    tensor = torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    return tensor.sub_(torch.as_tensor(mean).view(-1, 1, 1)).div_(torch.as_tensor(std).view(-1, 1, 1))


def torchvision_reference(image: Image.Image, size: int, mean=MEAN, std=STD) -> torch.Tensor:
    """The field's eval transform of a PIL image (converted to RGB first, as torchvision's and
    webdataset's loaders do) -> [3, size, size] float32."""
    return to_tensor_normalize(reference_pixels(image.convert("RGB"), size), mean, std)
