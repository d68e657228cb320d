"""Images as people store them -> the RGB pixels a model sees, by one deliberate rule.

``Image.convert("RGB")`` alone silently does the wrong thing for several common files:

- **transparency** (RGBA, LA, PA, P or L/RGB with a ``transparency`` key): convert drops alpha and
  keeps whatever colour sits under transparent pixels (often black, sometimes garbage). Here the
  image is composited onto a ``background`` colour (white by default), as a viewer shows it;
- **16-bit greyscale** (``I;16*``, and ``I`` holding values above 255): convert clips every value
  above 255 to white (with a transparency key, the whole image). Here values are scaled from
  0..65535 to 0..255, and a key's pixels are transparent;
- **EXIF orientation** (phone photos store pixels sideways plus a rotate tag): convert ignores it.
  Here the pixels are turned upright, as every viewer does;
- **CMYK** (print JPEGs): PIL's conversion without a colour profile (what convert does) is kept;
  colours are approximate, shapes exact.

Used by the loader (:mod:`clipkit.data.transforms`) and by sources at shard time (``-o background=``).
Torch is never imported here.
"""

from __future__ import annotations

import io
from typing import Any

from clipkit.errors import ClipkitError

WHITE = (255, 255, 255)
NAMED_COLOURS = {"white": WHITE, "black": (0, 0, 0), "grey": (128, 128, 128), "gray": (128, 128, 128)}
#: EXIF orientation tag value -> PIL transpose method (Image.Transpose values), as viewers apply them.
ORIENTATION_TRANSPOSE = {2: 0, 3: 3, 4: 1, 5: 5, 6: 4, 7: 6, 8: 2}
EXIF_ORIENTATION_TAG = 0x0112
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def parse_background(value: Any, where: str = "background") -> tuple[int, int, int]:
    """``"white"``, ``"black"``, ``"grey"``, ``"#rrggbb"``, ``"r,g,b"`` or ``[r, g, b]`` -> (r, g, b).

    Raises ClipkitError naming ``where`` (the option or recipe key) for anything else.
    """
    if isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, str) and value.strip().lower() in NAMED_COLOURS:
        return NAMED_COLOURS[value.strip().lower()]
    elif isinstance(value, str) and value.strip().startswith("#") and len(value.strip()) == 7:
        text = value.strip()
        try:
            return tuple(int(text[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]
        except ValueError:
            parts = []
    elif isinstance(value, str) and value.count(",") == 2:
        parts = value.split(",")
    else:
        parts = []
    try:
        rgb = tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        rgb = ()
    if len(rgb) != 3 or not all(0 <= c <= 255 for c in rgb):
        raise ClipkitError(
            f"{where}: {value!r} is not a colour; use white, black, grey, #rrggbb or r,g,b (0-255)"
        )
    return rgb  # type: ignore[return-value]


def exif_orientation(image) -> int:
    """The EXIF orientation (1-8) of an opened PIL image, read from its header only; 1 when absent
    or unreadable (a broken EXIF block must not make the image unusable)."""
    raw = image.info.get("exif")
    if not raw:
        return 1
    from PIL import Image

    try:
        exif = Image.Exif()
        exif.load(raw)
        value = int(exif.get(EXIF_ORIENTATION_TAG, 1))
    except Exception:  # PIL raises many types for malformed EXIF
        return 1
    return value if value in ORIENTATION_TRANSPOSE else 1


def oriented_size(image) -> tuple[int, int]:
    """(width, height) of the image as shown, i.e. after its EXIF orientation (5-8 swap them)."""
    width, height = image.size
    return (height, width) if exif_orientation(image) in (5, 6, 7, 8) else (width, height)


def has_alpha(image) -> bool:
    """Whether the image can hold transparent pixels (an alpha channel or a transparency key)."""
    return image.mode in ALPHA_MODES or "transparency" in image.info


def to_rgb(image, background: tuple[int, int, int] = WHITE, orientation: int | None = None):
    """A decoded PIL image (any mode) -> an upright RGB PIL image (see the module docs for the rule).

    ``orientation``: the EXIF value to apply (None: read it from ``image``). Pass 1 when the image
    was already turned (or its header was read before a draft decode).
    """
    orientation = exif_orientation(image) if orientation is None else orientation
    if has_alpha(image):
        rgb = flatten_alpha(image, background)
    elif is_sixteen_bit(image):
        rgb = sixteen_bit_to_rgb(image)
    elif image.mode == "RGB":
        rgb = image
    else:  # L, 1, P without transparency, CMYK (no colour profile), YCbCr, ...
        rgb = image.convert("RGB")
    if orientation in ORIENTATION_TRANSPOSE:
        rgb = rgb.transpose(ORIENTATION_TRANSPOSE[orientation])
    return rgb


def flatten_alpha(image, background: tuple[int, int, int]):
    """Composite an image with transparency onto ``background`` -> RGB (out = a·pixel + (1−a)·bg)."""
    from PIL import Image

    # PIL's RGBA conversion of 16-bit grey clips every value above 255 to white (the whole image,
    # not only the transparent pixels): scale it first, as without transparency.
    rgba = sixteen_bit_rgba(image) if is_sixteen_bit(image) else image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, tuple(background))
    flat.paste(rgba.convert("RGB"), mask=rgba.getchannel("A"))
    return flat


def is_sixteen_bit(image) -> bool:
    """Whether ``image`` is 16-bit greyscale (``I;16*``) or 32-bit integer ``I`` (PNG's 16-bit grey)."""
    return image.mode in SIXTEEN_BIT_MODES or image.mode == "I"


def sixteen_bit_rgba(image):
    """16-bit greyscale with a transparency key -> RGBA: grey scaled as :func:`sixteen_bit_to_rgb`
    does, alpha 0 where the raw (unscaled) value equals the key, 255 elsewhere."""
    import numpy as np
    from PIL import Image

    rgba = sixteen_bit_to_rgb(image).convert("RGBA")
    key = image.info.get("transparency")
    if isinstance(key, int):  # PNG's tRNS for grey images: one raw sample value
        alpha = np.where(np.asarray(image) == key, 0, 255).astype(np.uint8)
        rgba.putalpha(Image.fromarray(alpha, "L"))
    return rgba


def sixteen_bit_to_rgb(image):
    """16-bit greyscale (``I;16*``; ``I`` when any value exceeds 255) scaled to 8 bits -> RGB."""
    import numpy as np
    from PIL import Image

    values = np.asarray(image).astype(np.int64)
    if image.mode in SIXTEEN_BIT_MODES or values.max(initial=0) > 255:
        values = (np.clip(values, 0, 65535) * 255 + 32767) // 65535  # rounded 0..65535 -> 0..255
    grey = Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L")
    return grey.convert("RGB")


def describe(data: bytes) -> dict[str, Any]:
    """Header facts of encoded image bytes: ``mode``, ``alpha`` (bool), ``orientation`` (1-8)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return {"mode": image.mode, "alpha": has_alpha(image), "orientation": exif_orientation(image)}


def flatten_image_bytes(data: bytes, background: tuple[int, int, int]) -> bytes:
    """Encoded image with transparency -> PNG bytes of it composited onto ``background``, upright
    (its EXIF orientation applied: the re-encoded file carries no EXIF)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        rgb = to_rgb(image, background)
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    return out.getvalue()
