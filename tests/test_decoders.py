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
    assert SimpleJpegDecoder(min_factor=4).decode(data, 2)[1] == 1
    assert SimpleJpegDecoder(min_factor=4).decode(data, 4)[0].shape == (12, 16, 3)
    assert SimpleJpegDecoder().decode(data, 2)[0].shape == (24, 32, 3)  # default: 1/2 and smaller


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


def test_half_scale_boxes_placed_exactly_by_torch_match_pil_on_the_same_reduced_image():
    # 300 x 240 JPEG, 64 px output, crops of 50-90 % of the area: boxes shrink 2-4x, so a 1/2-scale
    # decode is asked for where every box starts (or, read mirrored, ends) on an even source pixel.
    # torch's kernel on that exact integer formulation against PIL's float-box resampling of the
    # same reduced pixels: the resampler-only difference (< 0.25, measured 0.03-0.06), where
    # placing the box half a reduced pixel off costs 4-9 grey levels on this texture.
    from clipkit.data.transforms import ViewPlan, decoder_factor, render, render_drafted, scaled_axes

    data = encode(textured_image(300, 240, period=37), "JPEG", quality=95)
    transform = ImageTransform(image_size=64, **LEVELS, crop_scale=(0.5, 0.9), hflip=True)
    half = SimpleJpegDecoder().decode(data, 2)[0]
    mirrored, full_decodes = set(), 0
    for seed in range(30):
        plan = transform.plan((300, 240), random.Random(seed))
        assert draft_factor(plan) == 2
        axes = scaled_axes(plan.box, 2)
        rng, pil_rng = random.Random(seed), random.Random(seed)
        (out,) = decode_transformed(data, transform, rng, "x")
        (pil_path,) = decode_transformed(data, transform, pil_rng, "x", decoder=None)
        assert rng.getstate() == pil_rng.getstate()
        if axes is None:  # both ends of an axis odd: decoded at full size instead
            assert decoder_factor([plan]) == 1
            assert (out - pil_path).abs().mean() < 2  # PIL drafts at 1/2: the DCT filter's difference
            full_decodes += 1
            continue
        assert decoder_factor([plan]) == 2
        assert (out - pil_path).abs().mean() < 0.25  # PIL drafts at 1/2 and resamples the float box
        mirrored.update(axis for axis, (_, _, backwards) in zip("xy", axes, strict=True) if backwards)
        exact = transform.from_uint8(render(half, plan, 2))
        assert torch.equal(out, exact)  # decode_transformed took the torch path at 1/2
        reference = transform.from_uint8(render_drafted(Image.fromarray(half, "RGB"), plan, 2))
        assert (exact - reference).abs().mean() < 0.25
        (full,) = decode_transformed(data, transform, random.Random(seed), "x", draft=False)
        assert (exact - full).abs().mean() < 2  # as the 1/8-scale bound above
    assert mirrored == {"x", "y"} and 0 < full_decodes < 30  # every case ran
    # An eval-style square cut after the resample, from a box read mirrored on both axes.
    plan = ViewPlan((3, 5, 292, 232), (90, 72), crop=(9, 4, 64), flip=True)
    assert scaled_axes(plan.box, 2) == ((1, 146, True), (2, 116, True))
    exact = transform.from_uint8(render(half, plan, 2))
    reference = transform.from_uint8(render_drafted(Image.fromarray(half, "RGB"), plan, 2))
    assert exact.shape == (3, 64, 64) and (exact - reference).abs().mean() < 0.25


def test_decoder_factor_only_halves_where_every_box_maps_onto_whole_pixels():
    from clipkit.data.transforms import ViewPlan, decoder_factor

    def plan(box, size=64):
        return ViewPlan(box, (size, size))

    assert decoder_factor([plan((2, 4, 200, 200))]) == 2  # even starts
    assert decoder_factor([plan((3, 5, 201, 201))]) == 1  # both ends odd on both axes
    assert decoder_factor([plan((3, 4, 200, 200))]) == 2  # x mirrored: ends on an even pixel
    assert decoder_factor([plan((2, 4, 200, 200)), plan((1, 1, 199, 199))]) == 1  # one view
    assert decoder_factor([plan((8, 8, 300, 300), 32)]) == 8
    assert decoder_factor([plan((2, 2, 262, 262), 32)]) == 2  # largest exact factor <= 8
    assert decoder_factor([plan((1, 1, 259, 259), 32)]) == 8  # none exact: PIL at 1/8 as before
    assert decoder_factor([plan((0, 0, 100, 100))]) == 1  # shrinks < 2x


def test_exif_segment_walks_the_header_markers():
    from clipkit.data.decoders import exif_segment, turned

    image = Image.new("RGB", (8, 4), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    plain = encode(image, "JPEG")
    with_exif = encode(image, "JPEG", exif=exif.tobytes())
    # Two 40 kB APP2 segments before the EXIF segment: past where a search of the first 64 KiB
    # used to look.
    app2 = b"\xff\xe2" + (40_002).to_bytes(2, "big") + b"\0" * 40_000
    late_exif = with_exif[:2] + 2 * app2 + with_exif[2:]
    assert exif_segment(plain) is False and exif_segment(with_exif) is True
    assert late_exif.index(b"Exif\0\0") > 65536 and exif_segment(late_exif) is True and turned(late_exif)
    assert exif_segment(b"\xff\xd8\xff\xe0\x00") is None and exif_segment(b"\xff\xd8junk") is None
    # A header that does not parse goes the PIL way (turned() says so), which reports the error.
    assert turned(b"\xff\xd8junk")


def test_from_uint8_is_the_reference_normalisation_bit_for_bit():
    transform = ImageTransform(image_size=16, mean=(0.48, 0.45, 0.40), std=(0.26, 0.26, 0.27))
    values = torch.arange(256, dtype=torch.uint8).repeat(3, 16, 1)  # every level in every channel
    mean, std = torch.tensor(transform.mean).view(3, 1, 1), torch.tensor(transform.std).view(3, 1, 1)
    expected = (values.float() / 255 - mean) / std
    for pixels in (values, values.permute(1, 2, 0).contiguous().permute(2, 0, 1)):  # channels-last
        out = transform.from_uint8(pixels)
        assert out.is_contiguous() and out.dtype == torch.float32 and torch.equal(out, expected)
