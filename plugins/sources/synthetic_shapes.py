"""Synthetic "coloured shapes at positions" image-caption data: clipkit's embedded default dataset.

Every image shows one filled shape (colour x shape x position x size) on a dark, slightly noisy
background, and its captions state all four attributes, so a tiny CLIP trained for minutes on a
CPU learns them. Nothing is downloaded or read from disk: sample ``i`` is a pure function of
``(split, seed, i, image_size)``, which makes shards reproducible and lets any sample be rebuilt
on its own.

Compositional generalisation is measured with :data:`HELDOUT_COMBOS`: eight (colour, shape) pairs
that the ``train`` split never shows, although every colour and every shape appears in training
with other partners. Zero-shot evaluation on the ``heldout`` split then asks whether the model
composes "red" and "circle" into "red circle" without having seen one.

URI: ``synthetic://shapes?n=4096&split=train&seed=0&image_size=32`` (see :func:`parse_synthetic_uri`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np
from PIL import Image, ImageDraw

from clipkit.contract.types import Sample
from clipkit.errors import DataError


class ShapesError(DataError, ValueError):
    """A ``synthetic://shapes`` URI or argument that cannot be used: one line from the CLI (a
    DataError), still a ValueError for code that catches that."""


#: Colour names (single words, as they appear in captions) -> RGB. Hues are spread round the colour
#: wheel and kept bright, so each stays distinct from the others and from the dark background.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 200, 50),
    "blue": (40, 90, 255),
    "yellow": (245, 235, 40),
    "purple": (175, 50, 235),
    "orange": (255, 140, 0),
    "white": (245, 245, 245),
    "cyan": (30, 225, 235),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "star")
#: The 3x3 grid, row-major from the top left (index = 3 * row + column).
POSITIONS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "centre", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
SIZES: tuple[str, ...] = ("small", "large")

#: Shape extent (bounding-box side) as a fraction of the image side; a grid cell is 1/3.
SIZE_FRACTION = {"small": 0.2, "large": 0.3}

#: Held-out (colour, shape) pairs: colour i with shape (2 * i) % 5. Each colour is held out exactly
#: once (so it keeps 4 training shapes) and each shape at most twice (so it keeps >= 6 training
#: colours); step 2 is coprime with 5, so consecutive colours lose different shapes.
HELDOUT_COMBOS: tuple[tuple[str, str], ...] = tuple(
    (colour, SHAPES[(2 * i) % len(SHAPES)]) for i, colour in enumerate(COLOURS)
)
ALL_COMBOS: tuple[tuple[str, str], ...] = tuple((c, s) for c in COLOURS for s in SHAPES)
SPLITS: tuple[str, ...] = ("train", "heldout", "all")

NAME = "synthetic-shapes"
URI_SCHEME, URI_HOST = "synthetic", "shapes"

# Rendering constants. Shapes are drawn on a SUPERSAMPLE-times larger mask and box-filtered down,
# so edges are anti-aliased and a 6-pixel star still looks like a star rather than a blob.
SUPERSAMPLE = 4
BACKGROUND_LEVEL = (30, 55)  # grey level range of the background (dark, so all colours pop)
BACKGROUND_NOISE_STD = 3.0  # per-pixel noise, small enough never to look like a shape
COLOUR_JITTER = 12  # per-channel jitter of the shape colour
EXTENT_JITTER = (0.9, 1.0)  # shapes only shrink, so "large" still fits inside its cell


def combos_for_split(split: str) -> tuple[tuple[str, str], ...]:
    """The (colour, shape) pairs a split draws from: train = 32, heldout = 8, all = 40."""
    _check_split(split)
    if split == "heldout":
        return HELDOUT_COMBOS
    if split == "train":
        return tuple(c for c in ALL_COMBOS if c not in HELDOUT_COMBOS)
    return ALL_COMBOS


def combo_name(colour: str, shape: str) -> str:
    """The combo label as it reads in captions, e.g. ``"red circle"``."""
    return f"{colour} {shape}"


def captions(colour: str, shape: str, position: str, size: str) -> tuple[str, str]:
    """Two phrasings stating all four attributes (<= 8 words, fits a 16-token text context)."""
    where = "in the centre" if position == "centre" else f"at the {position}"
    return (
        f"a {size} {colour} {shape} {where}",
        f"{position}: {_article(colour)} {colour} {shape}, {size}",
    )


def _article(word: str) -> str:
    """The indefinite article for ``word``: "an orange star" but "a red star"."""
    return "an" if word[0] in "aeiou" else "a"


def zero_shot_labels(combos: tuple[tuple[str, str], ...]) -> dict[str, dict[str, list[str]]]:
    """Zero-shot tasks: label -> classes and prompt templates (one ``{}`` each).

    Templates only use words and word orders of the training captions, because the text encoder
    knows nothing else. Colour and position prompts are ensembled over shapes (and sizes), shape
    prompts over colours and sizes, so the nuisance attributes average out instead of biasing a
    class embedding. A size word always sits between the article and a colour, as in the
    captions, so "a" never needs to become "an" (orange) and every class gets the same words.
    """
    return {
        "colour": {
            "classes": list(COLOURS),
            "templates": [f"a {size} {{}} {shape}" for size in SIZES for shape in SHAPES],
        },
        "shape": {
            "classes": list(SHAPES),
            # Captions always put a colour before the shape, so the prompts do too (ensembled
            # over colours): "a circle" alone is a word order the text encoder never saw.
            "templates": [f"a {size} {colour} {{}}" for size in SIZES for colour in COLOURS],
        },
        "position": {
            # The "<position>: a <shape>" phrasing names every position the same way, centre
            # included (the other phrasing says "in the centre" but "at the <position>").
            "classes": list(POSITIONS),
            "templates": [f"{{}}: a {shape}" for shape in SHAPES],
        },
        "combo": {
            "classes": sorted(combo_name(c, s) for c, s in combos),
            "templates": ["a small {}", "a large {}"],
        },
    }


# --------------------------------------------------------------------------------------------
# Rendering


def _shape_polygon(shape: str, cx: float, cy: float, extent: float) -> list[tuple[float, float]]:
    """Polygon vertices of ``shape`` centred on (cx, cy) inside an ``extent``-sided box."""
    r = extent / 2
    if shape == "square":
        r *= 0.85  # a full-box square would look larger than the circle of the same size
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # apex up, filling the box, so it differs clearly from a square
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "cross":  # a plus sign with arms a third of the extent thick
        t = r / 3
        return [
            (cx - t, cy - r), (cx + t, cy - r), (cx + t, cy - t), (cx + r, cy - t),
            (cx + r, cy + t), (cx + t, cy + t), (cx + t, cy + r), (cx - t, cy + r),
            (cx - t, cy + t), (cx - r, cy + t), (cx - r, cy - t), (cx - t, cy - t),
        ]  # fmt: skip
    if shape == "star":
        return _star(cx, cy, r)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """A five-pointed star, point up, vertically centred on its bounding box.

    The inner radius is half the outer one: fatter than a geometric star, so the points survive
    down-sampling to a few pixels.
    """
    inner = 0.5 * r
    # Lowest points sit at r*cos(36deg) below the centre, the top point at r above: shift down to
    # centre the box.
    cy += r * (1 - np.cos(np.pi / 5)) / 2
    points = []
    for k in range(10):
        angle = -np.pi / 2 + k * np.pi / 5
        radius = r if k % 2 == 0 else inner
        points.append((cx + radius * float(np.cos(angle)), cy + radius * float(np.sin(angle))))
    return points


def _shape_mask(shape: str, cx: float, cy: float, extent: float, image_size: int) -> np.ndarray:
    """Anti-aliased coverage in [0, 1], ``[image_size, image_size]``, of the shape."""
    big = image_size * SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    s = SUPERSAMPLE
    if shape == "circle":
        r = extent / 2
        draw.ellipse([(cx - r) * s, (cy - r) * s, (cx + r) * s, (cy + r) * s], fill=255)
    else:
        draw.polygon([(x * s, y * s) for x, y in _shape_polygon(shape, cx, cy, extent)], fill=255)
    small = mask.resize((image_size, image_size), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def _cell_centre(position: str, image_size: int) -> tuple[float, float]:
    """Pixel centre of the grid cell named ``position``."""
    index = POSITIONS.index(position)
    row, col = divmod(index, 3)
    cell = image_size / 3
    return (col + 0.5) * cell, (row + 0.5) * cell


def _check_attributes(colour: str, shape: str, position: str, size: str) -> None:
    for kind, value, known in (
        ("colour", colour, COLOURS),
        ("shape", shape, SHAPES),
        ("position", position, POSITIONS),
        ("size", size, SIZES),
    ):
        if value not in known:
            raise ShapesError(f"unknown {kind} {value!r}; known: {', '.join(known)}")


def render(
    colour: str, shape: str, position: str, size: str, rng: random.Random, image_size: int = 32
) -> Image.Image:
    """Draw one RGB image: ``shape`` in ``colour`` centred (with jitter) in the ``position`` cell.

    All randomness (background level and noise, colour, extent and offset jitter) comes from
    ``rng``, so the same rng state gives the same image.
    """
    return render_with_geometry(colour, shape, position, size, rng, image_size)[0]


def render_with_geometry(
    colour: str, shape: str, position: str, size: str, rng: random.Random, image_size: int = 32
) -> tuple[Image.Image, dict[str, float]]:
    """:func:`render`, also returning the continuous geometry actually drawn: ``extent`` (shape
    extent / image side) and ``x``, ``y`` (centre / image side) — continuous proxy labels for
    y-Aware-style meta-data kernels."""
    _check_attributes(colour, shape, position, size)
    extent = SIZE_FRACTION[size] * image_size * rng.uniform(*EXTENT_JITTER)
    # Jitter the centre by at most the slack between the shape and its cell, so it never leaves it.
    slack = max(0.0, (image_size / 3 - extent) / 2 - 0.5)
    cx, cy = _cell_centre(position, image_size)
    cx += rng.uniform(-slack, slack)
    cy += rng.uniform(-slack, slack)

    noise_rng = np.random.default_rng(rng.getrandbits(64))
    level = rng.uniform(*BACKGROUND_LEVEL)
    background = level + noise_rng.normal(0.0, BACKGROUND_NOISE_STD, (image_size, image_size, 1))
    rgb = np.array(
        [min(255, max(0, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in PALETTE[colour]],
        dtype=np.float32,
    )
    alpha = _shape_mask(shape, cx, cy, extent, image_size)[..., None]
    pixels = background * (1 - alpha) + rgb * alpha
    image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
    geometry = {"extent": extent / image_size, "x": cx / image_size, "y": cy / image_size}
    return image, {k: round(v, 6) for k, v in geometry.items()}


def _png_bytes(image: Image.Image) -> bytes:
    """Lossless PNG at zlib level 1: the pixels are the same at every level, and level 1 encodes these
    noisy images in 0.3-0.5x the CPU of Pillow's default (6) for 4-9 % more bytes (48 and 224 px;
    benchmarks/shapes_png.py, docs/benchmarks.md)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# The source


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ShapesError(f"synthetic shapes: split must be one of {', '.join(SPLITS)}, got {split!r}")


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    # bool is an int subclass; n=True is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ShapesError(f"synthetic shapes: {name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ShapesError(f"synthetic shapes: {name} must be >= {minimum}, got {value}")


class SyntheticShapes:
    """A deterministic, in-memory source of ``n`` shape images with captions (see module docs).

    Iterating yields :class:`clipkit.contract.types.Sample` records; ``sample(i)`` rebuilds record ``i``
    alone. Attributes are drawn uniformly: a (colour, shape) pair from the split's combos, then a
    position and a size.
    """

    def __init__(self, n: int = 4096, split: str = "train", seed: int = 0, image_size: int = 32) -> None:
        _check_int("n", n, 1)
        _check_split(split)
        _check_int("seed", seed, None)
        _check_int("image_size", image_size, 16)
        self.n, self.split, self.seed, self.image_size = n, split, seed, image_size
        self.combos = combos_for_split(split)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Sample]:
        for i in range(self.n):
            yield self.sample(i)

    def __repr__(self) -> str:
        return (
            f"SyntheticShapes(n={self.n}, split={self.split!r}, seed={self.seed}, "
            f"image_size={self.image_size})"
        )

    def attributes(self, i: int) -> dict[str, str]:
        """The attributes of sample ``i`` (cheap: no rendering)."""
        return self._draw(self._rng(i))

    def sample(self, i: int) -> Sample:
        """Sample ``i``: a pure function of (split, seed, i, image_size)."""
        rng = self._rng(i)
        attrs = self._draw(rng)
        colour, shape, position, size = attrs["colour"], attrs["shape"], attrs["position"], attrs["size"]
        image, geometry = render_with_geometry(colour, shape, position, size, rng, self.image_size)
        return Sample(
            key=f"{self.split}-{self.seed}-{i:08d}",
            image=_png_bytes(image),
            image_ext="png",
            captions=captions(colour, shape, position, size),
            meta={**attrs, "combo": combo_name(colour, shape), **geometry},
        )

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description for the shard manifest, including the zero-shot tasks."""
        return {
            "name": NAME,
            "split": self.split,
            "n": self.n,
            "seed": self.seed,
            "image_size": self.image_size,
            "heldout_combos": [combo_name(c, s) for c, s in HELDOUT_COMBOS],
            "labels": zero_shot_labels(self.combos),
        }

    def _rng(self, i: int) -> random.Random:
        if not 0 <= i < self.n:
            raise IndexError(f"sample index {i} out of range for {self.n} samples")
        # A string seed is hashed with SHA-512 by random.Random: stable across processes and
        # Python runs (unlike hash()), and independent of any global random state. image_size is
        # left out on purpose, so the same index has the same attributes at every resolution.
        return random.Random(f"{NAME}:{self.split}:{self.seed}:{i}")

    def _draw(self, rng: random.Random) -> dict[str, str]:
        colour, shape = rng.choice(self.combos)
        return {
            "colour": colour,
            "shape": shape,
            "position": rng.choice(POSITIONS),
            "size": rng.choice(SIZES),
        }


# --------------------------------------------------------------------------------------------
# URIs

_URI_PARAMS = {"n": int, "split": str, "seed": int, "image_size": int}


def parse_synthetic_uri(uri: str) -> SyntheticShapes | None:
    """``synthetic://shapes[?n=..&split=..&seed=..&image_size=..]`` -> a source; None if not ours.

    Raises ValueError for a malformed query: an unknown or repeated key, or a non-integer value
    for an integer parameter.
    """
    parts = urlsplit(uri)
    if parts.scheme.lower() != URI_SCHEME or parts.netloc.lower() != URI_HOST or parts.path not in ("", "/"):
        return None
    kwargs: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _URI_PARAMS:
            raise ShapesError(
                f"{uri}: unknown query parameter {key!r}; known parameters: {', '.join(_URI_PARAMS)}"
            )
        if key in kwargs:
            raise ShapesError(f"{uri}: query parameter {key!r} given more than once")
        try:
            kwargs[key] = _URI_PARAMS[key](value)
        except ValueError:
            raise ShapesError(f"{uri}: query parameter {key!r} must be an integer, got {value!r}") from None
    return SyntheticShapes(**kwargs)
