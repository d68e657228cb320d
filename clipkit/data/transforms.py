"""Image preprocessing without torchvision: PIL in, normalised float tensor [3, S, S] out.

Training: random-resized-crop (area fraction in ``crop_scale``, aspect ratio in ``crop_ratio``,
torchvision's sampling rule), optional horizontal flip and SimCLR's colour distortion.
Evaluation: resize the shorter side to S, then centre-crop S × S — pixel-identical to torchvision's
``Resize(S, BICUBIC, antialias=True) + CenterCrop(S) + ToTensor() + Normalize`` on a PIL image
(open_clip's and CLIP_benchmark's eval preprocessing): the same sizes (long side truncated), crop
offsets (rounded), PIL resampling call and float32 arithmetic. ``clipkit eval`` decodes with
:func:`decode_for_eval` (full size, PIL), ``clipkit.load``'s preprocess calls the transform on the
PIL image; tests/test_eval_preprocess.py compares both with torchvision's own output.

Every random choice comes from the ``random.Random`` the caller passes (one per sample, seeded
from (seed, epoch, global index)), so augmentations are reproducible and independent of the
worker that decodes the sample.

Two implementations share those choices (:meth:`ImageTransform.plan` draws them all up front):
``ImageTransform.__call__`` on a PIL image (PIL resampling, the reference), and
:func:`decode_transformed` from encoded bytes for the loader (torch's uint8 bicubic resampling,
JPEG draft decoding, one decode for both views; with the ``fastjpeg`` extra the JPEG is decoded
by simplejpeg straight into numpy, DCT-scaled where the crop allows, :mod:`clipkit.data.decoders`;
2-3x the images/s per core of a plain PIL loop, see docs/benchmarks.md). Evaluation never takes
that path: its pixels must be the field's, not approximately so.
"""

from __future__ import annotations

import functools
import io
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from clipkit.data.decoders import Decoder, default_decoder
from clipkit.data.image_modes import WHITE, exif_orientation, oriented_size, to_rgb
from clipkit.errors import DataError

BICUBIC = 3  # PIL.Image.BICUBIC, without importing PIL at module import
#: Longest resized side, in crop sides, that the centre crop resizes whole (torchvision's way, pixel
#: for pixel). Past it — aspect ratios beyond 64:1, spacer and banner images from web scrapes — only
#: the region the crop keeps is resampled: a 1 x 20 000 PNG of 161 bytes resized whole to 224 px
#: wide is 224 x 4 480 000 pixels (3 GB, 10 s), of which the crop keeps 224 x 224.
MAX_RESIZED_SIDES = 64


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
    background:   (r, g, b) transparent pixels are composited onto (:mod:`clipkit.data.image_modes`).
    """

    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_scale: tuple[float, float] = (1.0, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = False
    color_jitter: float = 0.0
    grayscale: float = 0.0
    background: tuple[int, int, int] = WHITE

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
        """PIL image (any mode) -> [3, S, S] float32, normalised by mean/std (PIL resampling: the
        reference path; :func:`decode_transformed` is the loader's faster path from bytes)."""
        return self.transform_rgb(to_rgb(image, self.background), rng)  # upright, transparency flattened

    def transform_rgb(self, image, rng: random.Random) -> torch.Tensor:
        """Upright RGB PIL image -> [3, S, S] float32 (:meth:`__call__` after the mode conversion).

        On the eval path (no random crop) this is torchvision's ``Resize(S, BICUBIC,
        antialias=True) + CenterCrop(S) + ToTensor() + Normalize(mean, std)`` on a PIL image,
        pixel for pixel: the same PIL resampling call, sizes and crop offsets
        (:func:`center_crop_geometry`) and float32 operations."""
        view = self.plan(image.size, rng)
        image = image.resize(view.resized, BICUBIC, box=view.box)
        if view.crop is not None:
            left, top, side = view.crop
            image = image.crop((left, top, left + side, top + side))
        return self.to_tensor(finish_pil(image, view))

    def plan(self, size: tuple[int, int], rng: random.Random) -> ViewPlan:
        """Every random choice of one view of an image of ``size`` (width, height), drawn from
        ``rng`` in a fixed order: crop box, flip, colour jitter, grayscale."""
        if self.random_crop:
            box = random_resized_crop_box(size, self.crop_scale, self.crop_ratio, rng)
            resized, crop = (self.image_size, self.image_size), None
        else:
            box, resized, crop = center_crop_geometry(size, self.image_size)
        flip = self.hflip and rng.random() < 0.5
        jitter = draw_jitter(self.color_jitter, rng) if self.color_jitter > 0 and rng.random() < 0.8 else ()
        grayscale = self.grayscale > 0 and rng.random() < self.grayscale
        return ViewPlan(box, resized, crop, flip, jitter, grayscale)

    def to_tensor(self, image) -> torch.Tensor:
        """RGB PIL image -> [3, H, W] float32, normalised."""
        import numpy as np

        return self.from_uint8(torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1))

    def from_uint8(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] uint8 (any strides) -> [3, H, W] float32 (contiguous), (pixels / 255 − mean) / std
        as one conversion and three in-place ops (bit-identical to BatchedAugment's normalisation)."""
        mean, std = self.normalisation
        # Channels-last input is made contiguous as uint8 first: transposing 1 byte per value costs
        # ~half of a transposing uint8 -> float32 conversion (measured on [3, 224, 224]).
        pixels = contiguous(pixels).to(torch.float32)
        return pixels.div_(255).sub_(mean).div_(std)

    @functools.cached_property
    def normalisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([3, 1, 1] mean, [3, 1, 1] std), built once rather than per image."""
        return torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)


@dataclass(frozen=True)
class ResizedUInt8:
    """PIL image -> uint8 tensor [3, size, size] (shorter side resized, centre crop), for
    ``data.augment: batched``, where the random crop, flip and normalisation run on the device."""

    size: int
    background: tuple[int, int, int] = WHITE

    def __call__(self, image, rng: random.Random) -> torch.Tensor:
        import numpy as np

        image = resize_center_crop(to_rgb(image, self.background), self.size)
        return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)

    def plan(self, size: tuple[int, int], rng: random.Random) -> ViewPlan:
        """The deterministic centre-crop geometry (no random draws)."""
        return ViewPlan(*center_crop_geometry(size, self.size))

    def from_uint8(self, pixels: torch.Tensor) -> torch.Tensor:
        return contiguous(pixels)


@dataclass(frozen=True)
class ViewPlan:
    """Every random choice of one view, drawn before any pixel is decoded (so the decoder can be
    told how far it may downscale; see :func:`decode_transformed`).

    box:       (left, top, right, bottom) region of the source image, in its own pixels (floats
               for a centre crop of an extreme aspect ratio, :func:`centre_region_geometry`).
    resized:   (width, height) the box is resampled to (bicubic, antialiased).
    crop:      (left, top, side) square cut from the resampled box (eval path), or None.
    flip:      mirror left-right after resampling.
    jitter:    colour operations applied in this order: (name, factor) with name one of
               brightness / contrast / saturation (enhance factor) or hue (shift in turns).
    grayscale: convert to grey (3 equal channels) last.
    """

    box: tuple[int, int, int, int]
    resized: tuple[int, int]
    crop: tuple[int, int, int] | None = None
    flip: bool = False
    jitter: tuple[tuple[str, float], ...] = ()
    grayscale: bool = False


def contiguous(pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` in contiguous memory: numpy's strided copy for a channels-last uint8 view on the
    CPU (measured ~0.85x the time of torch's for [3, 224, 224]), else ``Tensor.contiguous``."""
    if pixels.is_contiguous():
        return pixels
    if pixels.device.type != "cpu" or pixels.requires_grad:
        return pixels.contiguous()
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(pixels.numpy()))


def center_crop_geometry(
    size: tuple[int, int], side: int
) -> tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int] | None]:
    """(box, resized, crop) of :func:`resize_center_crop`: the whole image resized so its shorter
    side is ``side`` (:func:`shorter_side_size`), then the central side × side square
    (:func:`centred_offset`) — torchvision's ``Resize(side)`` + ``CenterCrop(side)`` geometry.

    The resized image is never smaller than the crop (its shorter side is ``side`` and its longer
    side ``int(side · long / short)`` >= ``side``), so torchvision's zero padding of a too-small
    image never applies here: an image smaller than ``side`` is upsampled first. Past
    :data:`MAX_RESIZED_SIDES` the crop's region alone is resampled (:func:`centre_region_geometry`)."""
    width, height = size
    new_width, new_height = shorter_side_size(size, side)
    if max(new_width, new_height) > MAX_RESIZED_SIDES * side:
        return centre_region_geometry(size, side, (new_width, new_height))
    crop = None
    if (new_width, new_height) != (side, side):
        crop = (centred_offset(new_width, side), centred_offset(new_height, side), side)
    return (0, 0, width, height), (new_width, new_height), crop


def centre_region_geometry(
    size: tuple[int, int], side: int, resized: tuple[int, int]
) -> tuple[tuple[float, float, float, float], tuple[int, int], None]:
    """(box, (side, side), None) for an image whose ``resized`` size is too long to build: the
    fractional source region that the centre crop of the resized image shows, resampled straight
    to side × side. Same scale and same crop offsets as :func:`center_crop_geometry`'s geometry
    (PIL's box resampling differs from resizing whole then cropping by a few grey levels at most,
    in training and evaluation alike: both resample this box with PIL)."""
    (width, height), (new_width, new_height) = size, resized
    scale_x, scale_y = width / new_width, height / new_height
    left, top = centred_offset(new_width, side), centred_offset(new_height, side)
    box = (left * scale_x, top * scale_y, (left + side) * scale_x, (top + side) * scale_y)
    return box, (side, side), None


def shorter_side_size(size: tuple[int, int], side: int) -> tuple[int, int]:
    """(width, height) with the shorter side ``side`` and the longer side ``int(side · long /
    short)``: truncated, not rounded, and computed in that float order, as torchvision's resize
    does for an int size (640 × 427 at 48 -> 71 × 48, not 72 × 48). A square image -> side × side."""
    width, height = size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(side * long / short)
    return (side, new_long) if width <= height else (new_long, side)


def centred_offset(length: int, side: int) -> int:
    """Offset of a centred ``side`` window in ``length`` pixels: torchvision's CenterCrop rounds
    half the slack with Python's round (half to even: 23 -> 12, 25 -> 12), it does not floor it."""
    return int(round((length - side) / 2.0))


def resize_center_crop(image, size: int):
    """Resize so the shorter side is ``size`` (bicubic), then crop the central size × size."""
    box, resized, crop = center_crop_geometry(image.size, size)
    if (box, resized) != ((0, 0, *image.size), image.size):  # else PIL would return a copy
        image = image.resize(resized, BICUBIC, box=box)
    if crop is None:
        return image
    left, top, side = crop
    return image.crop((left, top, left + side, top + side))


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


def draw_jitter(strength: float, rng: random.Random) -> tuple[tuple[str, float], ...]:
    """SimCLR's colour jitter of strength s: brightness, contrast, saturation (factors in
    [1 − 0.8s, 1 + 0.8s]) and hue (shift in [−0.2s, 0.2s] of a turn, capped at 0.5), in a random
    order; the order is drawn first, then each factor in that order."""
    spread, hue_spread = 0.8 * strength, min(0.5, 0.2 * strength)
    names = ["brightness", "contrast", "saturation", "hue"]
    rng.shuffle(names)
    return tuple(
        (name, rng.uniform(-hue_spread, hue_spread))
        if name == "hue"
        else (name, rng.uniform(max(0.0, 1 - spread), 1 + spread))
        for name in names
    )


def apply_jitter(image, operations: tuple[tuple[str, float], ...]):
    from PIL import ImageEnhance

    enhancers = {
        "brightness": ImageEnhance.Brightness,
        "contrast": ImageEnhance.Contrast,
        "saturation": ImageEnhance.Color,
    }
    for name, factor in operations:
        image = shift_hue(image, factor) if name == "hue" else enhancers[name](image).enhance(factor)
    return image


def finish_pil(image, view: ViewPlan):
    """Flip, colour jitter and grayscale of ``view`` on a resampled RGB PIL image."""
    if view.flip:
        image = image.transpose(0)  # PIL.Image.FLIP_LEFT_RIGHT
    if view.jitter:
        image = apply_jitter(image, view.jitter)
    if view.grayscale:
        image = image.convert("L").convert("RGB")
    return image


def shift_hue(image, shift: float):
    """Rotate the hue of an RGB PIL image by ``shift`` turns (−0.5..0.5) through PIL's HSV mode."""
    import numpy as np
    from PIL import Image

    hsv = np.array(image.convert("HSV"))
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(shift * 255))) % 256
    return Image.fromarray(hsv, "HSV").convert("RGB")


def decode_transformed(
    data: bytes,
    transforms: ImageTransform | ResizedUInt8 | Sequence[ImageTransform | ResizedUInt8],
    rng: random.Random | Sequence[random.Random],
    where: str,
    *,
    draft: bool = True,
    decoder: Decoder | None | str = "auto",
) -> list[torch.Tensor]:
    """Encoded image bytes -> one tensor per view: ``transform(image, rng)`` for each transform,
    decoding the bytes once (two-view mode shares the decode).

    Same random choices as :meth:`ImageTransform.__call__` on the decoded image: every view's
    parameters are drawn from the header's image size before decoding, view after view from
    ``rng`` (one ``random.Random`` consumed in order, as two successive ``__call__`` would, or one
    per view). Two speed-ups change pixels slightly, not geometry or randomness:

    - resampling is torch's uint8 antialiased bicubic (the same a = −0.5 kernel as PIL, several
      times faster on one core); it reads the crop box only, where PIL's filter also reaches pixels
      just outside the box, so the outermost output rows/columns differ a little;
    - with ``draft``, a JPEG is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, PIL's
      ``Image.draft``) when every view's box is downscaled at least that much anyway; the boxes are
      mapped exactly into the reduced image and resampled there by PIL (fractional box), or, on
      the decoder path, by torch where the box maps onto whole reduced pixels (:func:`scaled_axis`;
      :func:`decoder_factor` picks the scale).

    ``decoder``: a :class:`~clipkit.data.decoders.Decoder` tried first (``"auto"``: simplejpeg when the
    ``fastjpeg`` extra is installed; ``None``: PIL only). It decodes straight into a uint8 array,
    DCT-scaled by :func:`decoder_factor` (1/2 only where torch can take every box exactly, 1/4 and
    1/8 as draft decoding); bytes it does not take (not a JPEG, CMYK, a decoder error) go the PIL
    way, which raises the DataError.

    ``transforms``: one transform or one per view (anything with ``plan(size, rng)`` and
    ``from_uint8(pixels)``: ImageTransform, ResizedUInt8). Returns [3, S, S] float32 per
    ImageTransform view (uint8 for ResizedUInt8). Raises :class:`DataError` naming ``where`` when
    the bytes do not decode (unreadable header, truncated or corrupt data).
    """
    views = [transforms] if hasattr(transforms, "plan") else list(transforms)
    rngs = [rng] * len(views) if isinstance(rng, random.Random) else list(rng)
    if len(rngs) != len(views):
        raise ValueError(f"{len(views)} transforms but {len(rngs)} random generators")
    fast = default_decoder() if decoder == "auto" else decoder
    size = fast.header(data) if fast is not None else None
    if size is not None:
        states = [view_rng.getstate() for view_rng in rngs]
        plans = [view.plan(size, view_rng) for view, view_rng in zip(views, rngs, strict=True)]
        factor = decoder_factor(plans) if draft else 1
        try:
            pixels, applied = fast.decode(data, factor)
        except Exception:  # the decoder's own errors (truncation, warnings): PIL decides below
            for view_rng, state in zip(rngs, states, strict=True):
                view_rng.setstate(state)  # the PIL path draws the same plans again
        else:
            return render_decoded(pixels, applied, views, plans)
    image = open_image(data, where)
    # Planned on the image as shown (EXIF orientation applied), read from the header before decoding.
    orientation, shown = exif_orientation(image), oriented_size(image)
    background = getattr(views[0], "background", WHITE)
    plans = [view.plan(shown, view_rng) for view, view_rng in zip(views, rngs, strict=True)]
    factor = min((draft_factor(plan) for plan in plans), default=1) if draft else 1
    # PIL picks the largest power of 2 <= min(width // w, height // h): exactly ``factor`` here.
    # Formats other than JPEG ignore it (None).
    if factor > 1 and image.draft(None, (image.width // factor, image.height // factor)):
        image = decoded(image, where, background, orientation)
        return [
            view.from_uint8(render_drafted(image, plan, factor))
            for view, plan in zip(views, plans, strict=True)
        ]
    image = decoded(image, where, background, orientation)
    pixels = as_array(image)
    return [
        view.from_uint8(render_full(pixels, image, plan)) for view, plan in zip(views, plans, strict=True)
    ]


def decode_for_eval(data: bytes, transform: ImageTransform, where: str) -> torch.Tensor:
    """Encoded image bytes -> [3, S, S] float32 by the eval transform, exactly as torchvision's
    ``Resize(S, BICUBIC, antialias=True) + CenterCrop(S) + ToTensor() + Normalize`` on the image
    PIL decodes (open_clip's and CLIP_benchmark's eval preprocessing).

    Unlike :func:`decode_transformed` (the training loader's path) nothing is traded for speed:
    the image is decoded at full size by PIL (no JPEG draft / DCT scaling, no other decoder) and
    resampled by PIL's bicubic filter (not torch's uint8 kernel). The mode conversion is
    :func:`~clipkit.data.image_modes.to_rgb`. Raises :class:`DataError` naming ``where`` when the
    bytes do not decode."""
    image = open_image(data, where)
    # The orientation is read from the header, before decoding, as the loader does.
    image = decoded(image, where, transform.background, exif_orientation(image))
    return transform.transform_rgb(image, random.Random(0))  # the eval transform draws nothing


def render_full(pixels, image, plan: ViewPlan) -> torch.Tensor:
    """One view from a full-size decode: torch's resampler on ``pixels``, or PIL's on ``image``
    (the same pixels) for a fractional box (:func:`centre_region_geometry`), as evaluation does."""
    pixels_out = render(pixels, plan)
    return render_drafted(image, plan, 1) if pixels_out is None else pixels_out


def render_decoded(pixels, factor: int, views, plans: list[ViewPlan]) -> list[torch.Tensor]:
    """Every view from a decoder's [H', W', 3] uint8 array decoded at 1/``factor`` scale: by
    torch's uint8 resampler where the box maps onto whole reduced pixels (:func:`scaled_axis`),
    else by PIL, which resamples a fractional box exactly (see render_drafted)."""
    out, image = [], None
    for view, plan in zip(views, plans, strict=True):
        pixels_out = render(pixels, plan, factor)
        if pixels_out is None:
            if image is None:
                from PIL import Image

                image = Image.fromarray(pixels, "RGB")
            pixels_out = render_drafted(image, plan, factor)
        out.append(view.from_uint8(pixels_out))
    return out


def open_image(data: bytes, where: str):
    """PIL image with its header parsed, pixels not yet decoded."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Exception as error:  # PIL raises many types for unreadable data
        raise DataError(f"{where}: cannot decode image ({error})") from error


def decoded(image, where: str, background=WHITE, orientation: int = 1):
    """The pixels of an opened PIL image, decoded, as an upright RGB PIL image (transparency
    composited onto ``background``, 16-bit scaled, ``orientation`` applied: :func:`to_rgb`)."""
    try:
        image.load()
        return to_rgb(image, background, orientation)  # an upright RGB image is returned as is
    except Exception as error:  # truncated or corrupt data: OSError, SyntaxError, ValueError, ...
        raise DataError(f"{where}: cannot decode image ({error})") from error


def as_array(image):
    """RGB PIL image -> [H, W, 3] uint8 numpy array (a writable copy)."""
    import numpy as np

    return np.array(image, dtype=np.uint8)


def draft_factor(view: ViewPlan) -> int:
    """Largest of 8, 4, 2 by which the box shrinks along both axes on its way to ``resized`` (so a
    decode at 1/factor scale loses no detail the output keeps), else 1."""
    left, top, right, bottom = view.box
    width, height = view.resized
    for factor in (8, 4, 2):
        if right - left >= factor * width and bottom - top >= factor * height:
            return factor
    return 1


def decoder_factor(plans: list[ViewPlan]) -> int:
    """The DCT scale 1/factor to ask a :class:`~clipkit.data.decoders.Decoder` for: the largest
    power of 2 <= every view's :func:`draft_factor` at which every box maps exactly onto whole
    reduced pixels (so torch resamples them); else the common draft factor when it is >= 4 (PIL
    resamples the fractional boxes of that small image), else 1: PIL's resampler is so much slower
    than torch's uint8 kernel that a 1/2-scale decode (~20 % faster than a full one on web JPEGs)
    plus PIL costs more than a full decode plus torch."""
    common = min((draft_factor(plan) for plan in plans), default=1)
    factor = common
    while factor > 1:
        if all(scaled_axes(plan.box, factor) is not None for plan in plans):
            return factor
        factor //= 2
    return common if common >= 4 else 1


def scaled_axis(start: int, end: int, factor: int) -> tuple[int, int, bool] | None:
    """Source span [start, end) of one axis in an image decoded at 1/``factor`` (reduced pixel i
    covers source [i·factor, (i+1)·factor)) as (first, stop, backwards): the reduced pixels
    [first, stop) read backwards or not, such that the span starts exactly at reduced pixel
    ``first`` (read forwards) or ends exactly at ``stop`` (read backwards, the axis mirrored).
    torch's kernel places output pixel i's centre at (i + 0.5)·scale from the region's first
    pixel, and its filter is symmetric, so a mirrored region resampled and mirrored back is the
    same resampling. None when neither end falls on a reduced pixel boundary (the box is
    fractional at both ends: only a resampler taking a float box can place it exactly)."""
    if start % factor == 0:
        return start // factor, -(-end // factor), False
    if end % factor == 0:
        return start // factor, end // factor, True
    return None


def scaled_axes(box: tuple[int, int, int, int], factor: int):
    """(x axis, y axis) of :func:`scaled_axis`, or None when either is fractional at both ends
    (or the box itself is: :func:`centre_region_geometry`'s are resampled by PIL)."""
    if not all(isinstance(coordinate, int) for coordinate in box):
        return None
    left, top, right, bottom = box
    x_axis, y_axis = scaled_axis(left, right, factor), scaled_axis(top, bottom, factor)
    return None if x_axis is None or y_axis is None else (x_axis, y_axis)


def render(pixels, view: ViewPlan, factor: int = 1) -> torch.Tensor | None:
    """One view from decoded [H, W, 3] uint8 ``pixels`` (a numpy array at 1/``factor`` scale):
    crop box, bicubic antialiased resample (torch's uint8 kernel), eval crop, flip, colour ops ->
    [3, h, w] uint8, contiguous. None when the box cannot be placed exactly at this scale."""
    import numpy as np
    import torch.nn.functional as F

    axes = scaled_axes(view.box, factor)
    if axes is None:
        return None
    (x0, x1, x_back), (y0, y1, y_back) = axes
    region = pixels[y0:y1, x0:x1]
    region = region[:: -1 if y_back else 1, :: -1 if x_back else 1]
    left, top, right, bottom = view.box
    width, height = view.resized
    if factor > 1 or (right - left, bottom - top) != (width, height):
        # torch's uint8 kernel is ~1.3-2x slower on a strided view than on contiguous
        # channels-last memory (250-600 px boxes): the copy (which also mirrors) pays for itself.
        region = torch.from_numpy(np.ascontiguousarray(region)).permute(2, 0, 1).unsqueeze(0)
        if factor == 1:
            region = F.interpolate(
                region, size=(height, width), mode="bicubic", antialias=True, align_corners=False
            )
        else:  # the box's exact scale: its ends need not fall on the region's pixel boundaries
            scales = (height * factor / (bottom - top), width * factor / (right - left))
            region = torch.ops.aten._upsample_bicubic2d_aa(region, [height, width], False, *scales)
        region = region[0].permute(1, 2, 0).numpy()  # [h, w, 3] view
    region = region[:: -1 if y_back else 1, :: -1 if x_back else 1]  # mirrored back (views)
    if view.crop is not None:
        crop_left, crop_top, side = view.crop
        region = region[crop_top : crop_top + side, crop_left : crop_left + side]
    if view.flip:
        region = region[:, ::-1]
    pixels_out = torch.from_numpy(np.ascontiguousarray(region.transpose(2, 0, 1)))
    if view.jitter or view.grayscale:
        return finish_in_pil(pixels_out, replace(view, flip=False))
    return pixels_out


def render_drafted(image, view: ViewPlan, factor: int) -> torch.Tensor:
    """One view from an RGB PIL image decoded at 1/``factor`` scale -> [3, h, w] uint8.

    Source coordinate x is reduced coordinate x / factor (reduced pixel i covers source pixels
    [i·factor, (i+1)·factor)), so the box maps to fractional reduced coordinates; PIL resamples a
    fractional box exactly (torch's kernel takes whole pixels only, and rounding there would move
    the crop by up to half an output pixel)."""
    import numpy as np

    box = tuple(coordinate / factor for coordinate in view.box)
    image = image.resize(view.resized, BICUBIC, box=box)
    if view.crop is not None:
        left, top, side = view.crop
        image = image.crop((left, top, left + side, top + side))
    image = finish_pil(image, view)
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


def finish_in_pil(pixels: torch.Tensor, view: ViewPlan) -> torch.Tensor:
    """Flip and colour ops of ``view`` on [3, h, w] uint8 through PIL (the colour ops are PIL's,
    as in :meth:`ImageTransform.__call__`) -> [3, h, w] uint8."""
    import numpy as np
    from PIL import Image

    image = finish_pil(Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), "RGB"), view)
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
