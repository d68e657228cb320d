"""Image decoders for the loader's fast path (:func:`clipkit.data.transforms.decode_transformed`).

One small interface, :class:`Decoder`, so another decoder (a GPU one, say nvJPEG) can slot in:
``header(data)`` reads the size without decoding, ``decode(data, factor)`` returns the pixels as
an RGB uint8 array [H', W', 3] decoded at 1/``factor`` of the size where the decoder can scale
(libjpeg's DCT scaling: H' = ceil(H / factor)), and which factor it applied. Rules shared by all:

- pixel i of a 1/f decode covers source pixels [i·f, (i+1)·f), so a box maps to box / f exactly;
- a decoder that cannot handle some bytes (not a JPEG, CMYK, a libjpeg warning) answers ``None``
  from ``header`` or raises from ``decode``, and the caller falls back to the PIL path, which is
  the reference and raises :class:`~clipkit.errors.DataError` for bytes that really do not decode.

:class:`SimpleJpegDecoder` (the ``fastjpeg`` extra: ``pip install "clipkit-contrastive[fastjpeg]"``) decodes
JPEGs with simplejpeg's bundled libjpeg-turbo straight into a numpy array: no PIL image and no
PIL → numpy copy. :func:`default_decoder` returns it when simplejpeg is installed, else None
(PIL only). PyTurboJPEG was evaluated too: its wheel is pure Python and needs a system
libturbojpeg, which a plain ``pip install`` does not bring (docs/benchmarks.md, "Loader").
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import numpy as np

JPEG_MAGIC = b"\xff\xd8\xff"


@runtime_checkable
class Decoder(Protocol):
    """Encoded bytes -> RGB uint8 pixels, optionally DCT-downscaled."""

    def header(self, data: bytes) -> tuple[int, int] | None:
        """(width, height) from the header, or None when this decoder does not handle ``data``."""

    def decode(self, data: bytes, factor: int) -> tuple[np.ndarray, int]:
        """([H', W', 3] uint8 RGB, applied factor) with applied factor in {1, ..., ``factor``} a
        power of 2 and H' = ceil(H / applied factor); raises on data it cannot decode."""


class SimpleJpegDecoder:
    """JPEG decoding with simplejpeg (libjpeg-turbo, statically linked in its wheel).

    ``fast``: libjpeg's fast integer IDCT and nearest-neighbour chroma upsampling (``fastdct``,
    ``fastupsample``): ~20 % less decode time for up to ~1 grey level of mean difference on
    photos; off by default, so pixels stay within the same bounds as PIL's decode.

    ``min_factor``: the smallest reduction worth a scaled decode (below it, decode at full size).
    :func:`~clipkit.data.transforms.decode_transformed` asks for 1/2 only where torch's resampler
    can place every crop box exactly in the reduced image: a 1/2-scale decode takes ~0.8x the
    time of a full one on q85 4:2:0 web JPEGs, and the resampling then reads a quarter of the
    pixels.
    """

    def __init__(self, fast: bool = False, min_factor: int = 2):
        import simplejpeg

        self.simplejpeg = simplejpeg
        self.fast = fast
        self.min_factor = min_factor

    def header(self, data: bytes) -> tuple[int, int] | None:
        if not data.startswith(JPEG_MAGIC):
            return None
        try:
            height, width, colourspace, _ = self.simplejpeg.decode_jpeg_header(data)
        except ValueError:  # unreadable header: let the PIL path report it
            return None
        if colourspace not in ("YCbCr", "Gray"):  # CMYK / YCCK: PIL converts those
            return None
        if turned(data):  # an EXIF orientation: the PIL path shows the image upright
            return None
        return width, height

    def decode(self, data: bytes, factor: int) -> tuple[np.ndarray, int]:
        height, width, _, _ = self.simplejpeg.decode_jpeg_header(data)
        factor = factor if factor >= self.min_factor else 1
        # libjpeg-turbo's scaled sizes are ceil(size * M / 8); asking for exactly the 1/factor
        # size (and factor as the minimum reduction) selects M = 8 / factor and nothing between.
        pixels = self.simplejpeg.decode_jpeg(
            data,
            colorspace="RGB",
            fastdct=self.fast,
            fastupsample=self.fast,
            min_width=-(-width // factor),
            min_height=-(-height // factor),
            min_factor=float(factor),
        )
        applied = round(width / pixels.shape[1]) if pixels.shape[1] != width else 1
        if -(-width // applied) != pixels.shape[1] or -(-height // applied) != pixels.shape[0]:
            raise ValueError(f"unexpected scaled size {pixels.shape[:2]} of {height}x{width}")
        return pixels, applied


def turned(data: bytes) -> bool:
    """Whether a JPEG's EXIF orientation asks for a turn or flip (simplejpeg ignores EXIF). Only
    files with an EXIF segment (an APP1 segment starting ``Exif\\0\\0`` before the scan, where PIL
    reads it) pay for reading it; a header that does not parse goes the PIL way too."""
    segment = exif_segment(data)
    if segment is False:
        return False
    import io

    from PIL import Image

    from clipkit.data.image_modes import exif_orientation

    try:
        with Image.open(io.BytesIO(data)) as image:
            return exif_orientation(image) != 1
    except Exception:  # unreadable: the PIL path reports it
        return True


def exif_segment(data: bytes) -> bool | None:
    """Whether the JPEG header holds an APP1 EXIF segment, by walking the segment markers from SOI
    to the start of scan (a few steps, where searching the bytes for ``Exif`` took ~40 µs per
    image); None when the marker structure does not parse."""
    i, end = 2, len(data)
    while i + 4 <= end:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker in (0xDA, 0xD9):  # start of scan / end of image: no header segment follows
            return False
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            i += 2
        else:
            if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
                return True
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


@functools.cache
def default_decoder() -> Decoder | None:
    """:class:`SimpleJpegDecoder` when simplejpeg is installed (the ``fastjpeg`` extra), else None."""
    try:
        return SimpleJpegDecoder()
    except ImportError:
        return None
