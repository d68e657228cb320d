"""Batched image augmentation on tensors: uint8 [B, 3, H, W] in, normalised float32 [B, 3, S, S] out.

The per-sample path (:class:`clipkit.data.transforms.ImageTransform`) crops, flips and normalises every
image with PIL inside the DataLoader workers. This module does the same geometric augmentation for
a whole batch at once, on whatever device the batch lives on, so a GPU run can let the loader emit
fixed-size uint8 images and augment them next to the model:

1. one random-resized-crop box per image, torchvision's rule (area fraction ~ U(crop_scale),
   log-uniform aspect ratio, 10 tries, then the centred crop with its ratio clamped), vectorised:
   10 candidates per image are drawn at once and the first valid one is kept;
2. all boxes cropped and resized to S × S in one batched bilinear resampling;
3. optional horizontal flip (probability 1/2 per image);
4. ``(x / 255 − mean) / std``.

Boxes and flips are drawn on the CPU from a CPU ``torch.Generator``: the same seed gives the same
boxes whatever device the images are on (outputs then agree up to float rounding of the resampling).

Backends (same boxes, same sample positions; they differ only in interpolation details):

- ``"torch"``: an axis-aligned sampling grid per box and ``F.grid_sample(bilinear, align_corners=False)``,
  with sample positions clamped into the crop so that it equals crop-then-resize
  (``F.interpolate(crop, size=(S, S), mode="bilinear", align_corners=False)``), as torchvision does.
- ``"kornia"``: ``kornia.geometry.transform.crop_and_resize`` on the same boxes (kornia is optional,
  imported lazily; ``pip install kornia``). It does not clamp to the crop, so where a crop is upscaled
  the outermost half-pixel of the output blends in the pixels just outside the crop.
- ``"auto"``: kornia if importable, else torch.

Differences from the per-sample path: bilinear instead of PIL's antialiased bicubic, and no colour
jitter / grayscale. Bilinear without antialiasing reads only the 2 × 2 neighbours of each sample
point, so downscaling a crop by much more than 2× aliases (moiré, shimmering edges). With the
recommended input size (the loader emits about S · 8/7, e.g. 256 px for S = 224, and crops cover at
least half the area) the downscale factor stays below ~1.15 and aliasing is negligible; do not feed
much larger images (e.g. 512 px for S = 224) to this path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "kornia")
CROP_TRIES = 10  # torchvision's RandomResizedCrop.get_params tries 10 boxes before its fallback


class BatchedAugment(torch.nn.Module):
    """Random-resized-crop + horizontal flip + normalisation of a uint8 batch, as batched tensor ops.

    image_size: output side S.
    mean, std:  per-channel normalisation (3 values each, on the [0, 1] pixel scale).
    crop_scale: area-fraction range of the random crops; (1, 1) = deterministic path (no random crop:
                the centred largest square, i.e. the whole image when it is square, resized to S;
                for a square S × S input this is exactly the identity followed by normalisation).
    crop_ratio: aspect-ratio range (width / height) of the random crops, sampled log-uniformly.
    hflip:      flip each image horizontally with probability 1/2.
    backend:    "torch", "kornia" or "auto" (kornia if importable, else torch); see the module docstring.
    """

    def __init__(
        self,
        *,
        image_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        crop_scale: tuple[float, float] = (1.0, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {image_size!r}")
        self.image_size = image_size
        self.crop_scale = _checked_pair("crop_scale", crop_scale, upper=1.0)
        self.crop_ratio = _checked_pair("crop_ratio", crop_ratio, upper=math.inf)
        if not isinstance(hflip, bool):
            raise ValueError(f"hflip must be a bool, got {hflip!r}")
        self.hflip = hflip
        self.backend = _resolve_backend(backend)
        # [1, 3, 1, 1] so they broadcast over the batch; not persistent: they are config, not state.
        self.register_buffer("mean", _channel_values("mean", mean, positive=False), persistent=False)
        self.register_buffer("std", _channel_values("std", std, positive=True), persistent=False)

    @classmethod
    def from_image_transform(cls, transform, *, backend: str = "auto") -> BatchedAugment:
        """The batched equivalent of a :class:`clipkit.data.transforms.ImageTransform` (crop, flip and
        normalisation settings). Colour jitter and grayscale have no batched version here."""
        if transform.color_jitter or transform.grayscale:
            raise ValueError(
                "color_jitter and grayscale are not supported by BatchedAugment; "
                f"got color_jitter={transform.color_jitter}, grayscale={transform.grayscale}"
            )
        return cls(
            image_size=transform.image_size,
            mean=transform.mean,
            std=transform.std,
            crop_scale=tuple(transform.crop_scale),
            crop_ratio=tuple(transform.crop_ratio),
            hflip=transform.hflip,
            backend=backend,
        )

    @property
    def random_crop(self) -> bool:
        return self.crop_scale != (1.0, 1.0)

    def extra_repr(self) -> str:
        return (
            f"image_size={self.image_size}, crop_scale={self.crop_scale}, crop_ratio={self.crop_ratio}, "
            f"hflip={self.hflip}, backend={self.backend!r}"
        )

    def forward(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 [B, 3, H, W] (any device) -> normalised float32 [B, 3, S, S] on the same device.

        ``generator`` must be a CPU generator (None: torch's default CPU generator); boxes and flips
        are drawn from it on the CPU, so they do not depend on the images' device.
        """
        _check_images(images)
        batch, _, height, width = images.shape
        boxes, flips = self.sample_params(batch, height, width, generator)
        return self.apply_params(images, boxes, flips)

    def sample_params(
        self, batch: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(boxes int64 [B, 4] as (left, top, right, bottom), flips bool [B] or None), on the CPU.

        Draw order (fixed, so a seed pins everything): crop candidates, crop offsets, flips.
        """
        _check_generator(generator)
        if self.random_crop:
            boxes = sample_crop_boxes(batch, height, width, self.crop_scale, self.crop_ratio, generator)
        else:
            boxes = centred_square_boxes(batch, height, width)
        flips = torch.rand(batch, generator=generator) < 0.5 if self.hflip else None
        return boxes, flips

    def apply_params(
        self, images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Crop ``boxes`` (int64 [B, 4], CPU) out of uint8 ``images`` [B, 3, H, W], resize to S × S,
        flip where ``flips`` (bool [B]) is set, normalise -> float32 [B, 3, S, S]."""
        _check_images(images)
        batch, _, height, width = images.shape
        size = self.image_size
        boxes = _checked_boxes(boxes, batch, height, width)
        if flips is not None and tuple(flips.shape) != (batch,):
            raise ValueError(f"flips must be a bool tensor of shape [{batch}], got {tuple(flips.shape)}")
        flips = None if flips is None else flips.cpu().bool()
        whole_image = torch.tensor([0, 0, width, height], dtype=torch.int64)
        if (height, width) == (size, size) and bool((boxes == whole_image).all()):
            pixels = images.float()  # identity: no resampling, so the output is exact
            if flips is not None:
                flips = flips.to(images.device).view(-1, 1, 1, 1)
                pixels = torch.where(flips, pixels.flip(-1), pixels)
        elif batch == 0:
            pixels = images.new_zeros((0, 3, size, size), dtype=torch.float32)
        elif self.backend == "kornia":  # the flips are folded into the sampling: no extra pass
            pixels = _resample_kornia(images.float(), boxes, flips, size)
        else:
            pixels = _resample_torch(images.float(), boxes, flips, size)
        # in place: the same arithmetic as (pixels / 255 − mean) / std without two output-sized
        # temporaries (that expression cost as much as the resampling on CPU)
        mean, std = self.mean.to(images.device), self.std.to(images.device)
        return pixels.div_(255).sub_(mean).div_(std)


def sample_crop_boxes(
    batch: int,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """torchvision's random-resized-crop boxes for ``batch`` images of size height × width.

    Returns int64 [B, 4] (left, top, right, bottom) on the CPU. Per image: ``CROP_TRIES`` candidates
    (area fraction ~ U(scale), log(ratio) ~ U(log ratio)), w = round(sqrt(area · ratio)),
    h = round(sqrt(area / ratio)); the first candidate that fits is kept, with a uniform integer
    offset; if none fits, the centred crop whose ratio is clamped into ``ratio``
    (as :func:`clipkit.data.transforms.random_resized_crop_box`, vectorised over the batch).
    """
    area_fraction = torch.empty(batch, CROP_TRIES, dtype=torch.float64).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(batch, CROP_TRIES, dtype=torch.float64).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    offset_fraction = torch.rand(batch, 2, dtype=torch.float64, generator=generator)  # (left, top)

    target_area = height * width * area_fraction
    aspect = log_ratio.exp()
    widths = (target_area * aspect).sqrt().round().long()  # round half to even, like Python's round
    heights = (target_area / aspect).sqrt().round().long()
    fits = (widths > 0) & (widths <= width) & (heights > 0) & (heights <= height)
    first_fit = fits.int().argmax(dim=1, keepdim=True)  # index of the first True (0 when none)
    crop_w = widths.gather(1, first_fit).squeeze(1)
    crop_h = heights.gather(1, first_fit).squeeze(1)

    fallback_w, fallback_h = _fallback_size(height, width, ratio)
    any_fit = fits.any(dim=1)
    crop_w = torch.where(any_fit, crop_w, fallback_w)
    crop_h = torch.where(any_fit, crop_h, fallback_h)
    # uniform integer offsets in [0, size − crop] (randint's range), centred for the fallback
    left = (offset_fraction[:, 0] * (width - crop_w + 1)).floor().long().clamp(max=width - crop_w)
    top = (offset_fraction[:, 1] * (height - crop_h + 1)).floor().long().clamp(max=height - crop_h)
    left = torch.where(any_fit, left, (width - crop_w) // 2)
    top = torch.where(any_fit, top, (height - crop_h) // 2)
    return torch.stack([left, top, left + crop_w, top + crop_h], dim=1)


def centred_square_boxes(batch: int, height: int, width: int) -> torch.Tensor:
    """The deterministic path's box: the centred largest square (the whole image if square),
    int64 [B, 4] (left, top, right, bottom). Resized to S it matches "resize the shorter side to S,
    centre-crop S × S" (the per-sample eval path) up to rounding."""
    side = min(height, width)
    left, top = (width - side) // 2, (height - side) // 2
    return torch.tensor([left, top, left + side, top + side], dtype=torch.int64).expand(batch, 4)


def _fallback_size(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """torchvision's fallback crop (width, height): the whole image with its ratio clamped into ``ratio``."""
    if width / height < ratio[0]:  # too tall: full width, clamp the height
        return width, round(width / ratio[0])
    if width / height > ratio[1]:  # too wide: full height, clamp the width
        return round(height * ratio[1]), height
    return width, height


def _sample_positions(start: torch.Tensor, stop: torch.Tensor, size: int) -> torch.Tensor:
    """Source pixel coordinates (pixel centres at integers) of ``size`` output pixels spanning the crop
    [start, stop) along one axis: start + (j + 0.5) · extent / size − 0.5, i.e. the half-pixel
    convention of ``F.interpolate(align_corners=False)`` and PIL. float64 [B, size]."""
    start, stop = start.double()[:, None], stop.double()[:, None]
    centres = torch.arange(size, dtype=torch.float64) + 0.5
    return start + centres * (stop - start) / size - 0.5


def _resample_torch(
    pixels: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor | None, size: int
) -> torch.Tensor:
    """Bilinear crop-and-resize with ``F.grid_sample``: float [B, 3, H, W] -> float [B, 3, S, S];
    boxes int64 [B, 4] and flips bool [B] (or None) on the CPU.

    Sample positions are clamped into the crop (the first/last pixel centres), so each output equals
    resizing the cropped image on its own, as torchvision's ``resized_crop`` does. A flip reverses
    the column positions, which mirrors the output exactly at no cost.
    """
    height, width = pixels.shape[-2:]
    left, top, right, bottom = boxes.unbind(dim=1)
    xs = _sample_positions(left, right, size).clamp(left.double()[:, None], right.double()[:, None] - 1)
    ys = _sample_positions(top, bottom, size).clamp(top.double()[:, None], bottom.double()[:, None] - 1)
    if flips is not None:
        xs = torch.where(flips[:, None], xs.flip(-1), xs)
    # pixel coordinate -> grid_sample's normalised coordinate for align_corners=False
    grid_x = ((2 * xs + 1) / width - 1).float().to(pixels.device)
    grid_y = ((2 * ys + 1) / height - 1).float().to(pixels.device)
    batch = pixels.shape[0]
    grid = torch.stack(
        [grid_x[:, None, :].expand(batch, size, size), grid_y[:, :, None].expand(batch, size, size)], dim=-1
    )
    return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _resample_kornia(
    pixels: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor | None, size: int
) -> torch.Tensor:
    """The same crop-and-resize with ``kornia.geometry.transform.crop_and_resize``.

    kornia maps the box corners onto the first/last output pixel centres (align_corners=True), so the
    corners passed are the first/last sample positions of the half-pixel convention: both backends
    then sample the same points (kornia without the clamp into the crop). A flip swaps the left and
    right corners.
    """
    from kornia.geometry.transform import crop_and_resize

    left, top, right, bottom = boxes.unbind(dim=1)
    xs = _sample_positions(left, right, size)
    ys = _sample_positions(top, bottom, size)
    x0, x1, y0, y1 = xs[:, 0], xs[:, -1], ys[:, 0], ys[:, -1]
    if flips is not None:
        x0, x1 = torch.where(flips, x1, x0), torch.where(flips, x0, x1)
    corners = torch.stack(  # top-left, top-right, bottom-right, bottom-left; (x, y)
        [
            torch.stack([x0, y0], -1),
            torch.stack([x1, y0], -1),
            torch.stack([x1, y1], -1),
            torch.stack([x0, y1], -1),
        ],
        dim=1,
    )
    corners = corners.float().to(pixels.device)
    return crop_and_resize(
        pixels, corners, (size, size), mode="bilinear", padding_mode="border", align_corners=True
    )


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return backend
    try:
        import kornia.geometry.transform  # noqa: F401  (optional dependency, imported only here)
    except ImportError as error:
        if backend == "auto":
            return "torch"
        raise ImportError(
            'backend="kornia" needs the optional package kornia: `pip install kornia` '
            '(or use backend="torch")'
        ) from error
    return "kornia"


def _checked_pair(name: str, value, *, upper: float) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of numbers (low, high), got {value!r}") from None
    if not 0 < low <= high <= upper:
        bound = f" <= {upper:g}" if math.isfinite(upper) else ""
        raise ValueError(f"{name} must satisfy 0 < low <= high{bound}, got {value!r}")
    return low, high


def _channel_values(name: str, values, *, positive: bool) -> torch.Tensor:
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be 3 numbers (one per RGB channel), got {values!r}") from None
    if len(floats) != 3 or not all(math.isfinite(v) for v in floats):
        raise ValueError(f"{name} must be 3 finite numbers (one per RGB channel), got {values!r}")
    if positive and min(floats) <= 0:
        raise ValueError(f"{name} must be positive, got {values!r}")
    return torch.tensor(floats, dtype=torch.float32).view(1, 3, 1, 1)


def _check_images(images) -> None:
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 [B, 3, H, W] (0..255), got dtype {images.dtype}")
    if images.dim() != 4 or images.shape[1] != 3 or images.shape[2] < 1 or images.shape[3] < 1:
        raise ValueError(f"images must have shape [B, 3, H, W], got {tuple(images.shape)}")


def _checked_boxes(boxes, batch: int, height: int, width: int) -> torch.Tensor:
    """int64 [B, 4] (left, top, right, bottom) on the CPU, each a non-empty box inside the image."""
    if (
        not isinstance(boxes, torch.Tensor)
        or boxes.dtype.is_floating_point
        or tuple(boxes.shape) != (batch, 4)
    ):
        raise ValueError(f"boxes must be an integer tensor of shape [{batch}, 4] (left, top, right, bottom)")
    boxes = boxes.cpu().long()
    left, top, right, bottom = boxes.unbind(dim=1)
    inside = (left >= 0) & (top >= 0) & (right <= width) & (bottom <= height)
    if not bool((inside & (left < right) & (top < bottom)).all()):
        raise ValueError(f"boxes must be non-empty and lie inside the {height} × {width} images")
    return boxes


def _check_generator(generator) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator must be a CPU torch.Generator (boxes are drawn on the CPU so that they do not "
            f"depend on the device), got one on {generator.device}"
        )
