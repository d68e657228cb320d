"""The loader's pluggable decoders (clipkit.data.decoders): simplejpeg (the ``fastjpeg`` extra) gives the
same random draws and stays within the PIL path's fidelity bounds, DCT-scaled decodes map the crop
exactly, and anything it does not take falls back to PIL with the generator untouched."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from clipkit.data.decoders import Decoder, default_decoder
from clipkit.data.transforms import ImageTransform, ResizedUInt8, decode_transformed, draft_factor
from clipkit.errors import DataError

simplejpeg = pytest.importorskip("simplejpeg")
from test_decode_transformed import encode, textured_image  # noqa: E402  (the same test images)

from clipkit.data.decoders import SimpleJpegDecoder  # noqa: E402

LEVELS = {"mean": (0.0, 0.0, 0.0), "std": (1 / 255, 1 / 255, 1 / 255)}  # outputs in grey levels


def test_default_decoder_is_simplejpeg_and_follows_the_protocol():
    assert isinstance(default_decoder(), SimpleJpegDecoder)
    assert isinstance(default_decoder(), Decoder)


@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_scaled_decode_has_the_ceil_size_and_the_pixels_of_a_full_decode(factor):
    data = encode(textured_image(203, 117, period=97), "JPEG", quality=95)
    decoder = SimpleJpegDecoder(min_factor=2)
    assert decoder.header(data) == (203, 117)
    pixels, applied = decoder.decode(data, factor)
    assert applied == factor and pixels.dtype == np.uint8
    assert pixels.shape == (-(-117 // factor), -(-203 // factor), 3)
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
    if factor == 1:  # the same libjpeg-turbo settings as PIL's decode: equal to a level or so
        assert np.abs(pixels.astype(np.float32) - full).mean() < 0.5
    else:  # a box average of the full decode, within the DCT filter's difference
        h, w = 117 // factor, 203 // factor
        pooled = full[: h * factor, : w * factor].reshape(h, factor, w, factor, 3).mean((1, 3))
        assert np.abs(pixels[:h, :w].astype(np.float32) - pooled).mean() < 3


def test_reductions_below_min_factor_decode_at_full_size():
    data = encode(textured_image(64, 48), "JPEG", quality=90)
    assert SimpleJpegDecoder().decode(data, 2)[1] == 1
    assert SimpleJpegDecoder().decode(data, 4)[0].shape == (12, 16, 3)


def test_jpeg_views_match_the_pil_path_with_the_same_draws():
    # No draft (boxes barely shrink): only the decoder differs (same libjpeg-turbo IDCT and
    # upsampling as PIL), so the bound is the PNG test's 0.25 levels of today's PIL-path tests.
    data = encode(textured_image(96, 72), "JPEG", quality=90)
    transform = ImageTransform(image_size=64, **LEVELS, crop_scale=(0.5, 1.0), hflip=True)
    for seed in range(6):
        pil_rng, rng = random.Random(seed), random.Random(seed)
        (expected,) = decode_transformed(data, transform, pil_rng, "x", decoder=None)
        (out,) = decode_transformed(data, transform, rng, "x")
        assert rng.getstate() == pil_rng.getstate()
        assert (out - expected).abs().mean() < 0.25


def test_dct_scaled_decode_keeps_the_crop_region():
    # As test_draft_decoding_keeps_the_crop_region: 1/8-scale decode against the full decode,
    # mean |diff| < 2, where moving the crop by a quarter output pixel costs > 4 on this texture.
    data = encode(textured_image(1024, 768, period=97), "JPEG", quality=95)
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    transform = ImageTransform(image_size=32, **LEVELS, crop_scale=(0.5, 0.9))
    for seed in range(4):
        view = transform.plan(decoded.size, random.Random(seed))
        assert draft_factor(view) == 8
        (scaled,) = decode_transformed(data, transform, random.Random(seed), "x")
        (full,) = decode_transformed(data, transform, random.Random(seed), "x", draft=False)
        assert not torch.equal(scaled, full)
        assert (scaled - full).abs().mean() < 2
        left, top, right, bottom = view.box
        quarter = (right - left) / 32 / 4 * (1 if right + 16 <= decoded.width else -1)
        moved = decoded.resize((32, 32), Image.BICUBIC, box=(left + quarter, top, right + quarter, bottom))
        moved = torch.from_numpy(np.asarray(moved, dtype=np.float32)).permute(2, 0, 1)
        assert (moved - full).abs().mean() > 4


def test_two_views_and_uint8_views_from_the_fast_decoder():
    data = encode(textured_image(120, 90), "JPEG", quality=92)
    transform = ImageTransform(image_size=24, **LEVELS, crop_scale=(0.2, 0.6), hflip=True)
    rng, pil_rng = random.Random("aug:0:0:5"), random.Random("aug:0:0:5")
    views = decode_transformed(data, [transform, transform], rng, "x")
    # Boxes shrink 2-4x: PIL would draft at 1/2, simplejpeg decodes in full (min_factor 4).
    expected = decode_transformed(data, [transform, transform], pil_rng, "x", decoder=None, draft=False)
    assert rng.getstate() == pil_rng.getstate()
    for view, reference in zip(views, expected, strict=True):
        assert (view - reference).abs().mean() < 0.25
    (small,) = decode_transformed(data, ResizedUInt8(64), random.Random(0), "x")
    assert small.dtype == torch.uint8 and small.shape == (3, 64, 64) and small.is_contiguous()


def test_truncated_jpeg_still_raises_data_error():
    data = encode(textured_image(64, 48), "JPEG", quality=90)
    with pytest.raises(DataError, match="sample 1: cannot decode image"):
        decode_transformed(
            data[: len(data) // 2], ImageTransform(image_size=16, **LEVELS), random.Random(0), "sample 1"
        )


def test_grey_and_cmyk_jpegs_come_out_rgb():
    base = textured_image(48, 40)
    transform = ImageTransform(image_size=16, **LEVELS, crop_scale=(0.5, 1.0))
    for image in (base.convert("L"), base.convert("CMYK")):
        data = encode(image, "JPEG", quality=95)
        (out,) = decode_transformed(data, transform, random.Random(3), "x", draft=False)
        (expected,) = decode_transformed(data, transform, random.Random(3), "x", decoder=None, draft=False)
        assert out.shape == (3, 16, 16) and (out - expected).abs().mean() < 0.25


class FailingDecoder:
    """Takes every header, fails every decode: the PIL path must redo the same draws."""

    def header(self, data):
        return Image.open(io.BytesIO(data)).size

    def decode(self, data, factor):
        raise RuntimeError("no")


def test_a_decoder_failure_falls_back_to_pil_with_the_generator_rewound():
    data = encode(textured_image(80, 60), "PNG")
    transform = ImageTransform(image_size=16, **LEVELS, crop_scale=(0.3, 1.0), hflip=True)
    rng, pil_rng = random.Random(7), random.Random(7)
    (out,) = decode_transformed(data, transform, rng, "x", decoder=FailingDecoder())
    (expected,) = decode_transformed(data, transform, pil_rng, "x", decoder=None)
    assert torch.equal(out, expected) and rng.getstate() == pil_rng.getstate()


def test_exif_turned_jpegs_go_the_pil_way():
    """simplejpeg ignores EXIF: a JPEG whose orientation asks for a turn must not take its path."""
    import io

    from PIL import Image

    from clipkit.data.decoders import turned

    image = Image.new("RGB", (8, 4), (200, 10, 10))
    plain, rotated = io.BytesIO(), io.BytesIO()
    image.save(plain, format="JPEG")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    image.save(rotated, format="JPEG", exif=exif.tobytes())
    assert not turned(plain.getvalue()) and turned(rotated.getvalue())
    exif[0x0112] = 1
    upright = io.BytesIO()
    image.save(upright, format="JPEG", exif=exif.tobytes())
    assert not turned(upright.getvalue())
