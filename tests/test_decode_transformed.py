"""The loader's fast path, decode_transformed(bytes, transforms, rng, where): same random choices as
ImageTransform.__call__, pixels within a stated tolerance of it, JPEG draft decoding that keeps the
crop region, deterministic, DataError for bad bytes, any PIL mode in."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from clipkit.data.transforms import ImageTransform, ResizedUInt8, decode_transformed, draft_factor
from clipkit.errors import DataError

# mean 0, std 1/255: the outputs are pixel values in [0, 255], so differences read as grey levels.
LEVELS = {"mean": (0.0, 0.0, 0.0), "std": (1 / 255, 1 / 255, 1 / 255)}


def textured_image(width: int, height: int, period: float = 41) -> Image.Image:
    """Smooth ramps plus stripes of about ``period`` px (0.7x, 1x, 1.6x it per channel): moving a
    crop by a fraction of an output pixel changes the output visibly; JPEG keeps it at quality 95."""
    x = np.arange(width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.arange(height, dtype=np.float32)[:, None].repeat(width, 1)
    red = 128 + 60 * np.sin(2 * np.pi * x / period) + 40 * np.cos(2 * np.pi * y / (0.7 * period))
    green = 127.5 * (x / width + y / height)
    blue = 128 + 90 * np.sin(2 * np.pi * (x + 2 * y) / (1.6 * period))
    return Image.fromarray(np.clip(np.stack([red, green, blue], -1), 0, 255).astype(np.uint8), "RGB")


def encode(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def reference(data: bytes, transform, rng: random.Random) -> torch.Tensor:
    """ImageTransform.__call__ on the fully decoded image (PIL resampling)."""
    return transform(Image.open(io.BytesIO(data)), rng)


def test_matches_the_pil_path_and_draws_the_same_random_numbers():
    # PNG: lossless and never drafted, so only the resampler differs (torch's uint8 bicubic vs
    # PIL's; torch reads the box only, PIL's filter also reaches just outside it). Measured mean
    # |diff| here is 0.02-0.11 grey levels; 0.25 leaves a margin, while any geometric error (a crop
    # off by a pixel, a missed flip) costs several levels on this texture.
    data = encode(textured_image(96, 72), "PNG")
    transform = ImageTransform(image_size=32, **LEVELS, crop_scale=(0.3, 1.0), hflip=True)
    for seed in range(8):
        expected_rng, rng = random.Random(seed), random.Random(seed)
        expected = reference(data, transform, expected_rng)
        (out,) = decode_transformed(data, transform, rng, "sample 0")
        assert out.shape == (3, 32, 32) and out.dtype == torch.float32
        assert (out - expected).abs().mean() < 0.25
        assert rng.getstate() == expected_rng.getstate()


def test_eval_path_matches_resize_and_centre_crop():
    data = encode(textured_image(90, 60), "PNG")
    transform = ImageTransform(image_size=48, **LEVELS)
    (out,) = decode_transformed(data, transform, random.Random(0), "x")
    # Full-image resize then crop: no box edges, so torch and PIL agree to one level at most.
    assert (out - reference(data, transform, random.Random(0))).abs().max() <= 1


def test_two_views_share_one_decode_and_follow_two_successive_calls():
    data = encode(textured_image(96, 72), "PNG")
    transform = ImageTransform(image_size=24, **LEVELS, crop_scale=(0.2, 0.6), hflip=True)
    expected_rng, rng = random.Random("aug:0:0:5"), random.Random("aug:0:0:5")
    first, second = reference(data, transform, expected_rng), reference(data, transform, expected_rng)
    view1, view2 = decode_transformed(data, [transform, transform], rng, "x")
    assert (view1 - first).abs().mean() < 0.25 and (view2 - second).abs().mean() < 0.25
    assert (view1 - view2).abs().mean() > 5  # two different crops of the texture
    assert rng.getstate() == expected_rng.getstate()  # the caption draw that follows is unchanged
    # One generator per view is accepted too.
    separate = decode_transformed(data, [transform, transform], [random.Random(1), random.Random(2)], "x")
    assert torch.equal(separate[1], decode_transformed(data, transform, random.Random(2), "x")[0])


def test_same_bytes_and_seed_give_identical_tensors():
    data = encode(textured_image(160, 120), "JPEG", quality=90)
    transform = ImageTransform(image_size=32, **LEVELS, crop_scale=(0.5, 1.0), hflip=True)
    first = decode_transformed(data, transform, random.Random("aug:1:2:3"), "x")[0]
    again = decode_transformed(data, transform, random.Random("aug:1:2:3"), "x")[0]
    other = decode_transformed(data, transform, random.Random("aug:1:2:4"), "x")[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_draft_decoding_keeps_the_crop_region():
    # 1024 x 768 JPEG, 32 px output of crops covering 50-90 % of the area: boxes are >= 256 px
    # wide and tall, so the decoder works at 1/8 scale and PIL resamples the box mapped exactly
    # (fractionally) into the reduced image. libjpeg's DCT downscaling is another low-pass filter
    # than PIL's antialiased bicubic: measured mean |diff| 0.6-0.9 grey levels here (0.4-0.8 on
    # COCO photos at 224 px). The bound of 2 is far below what moving the crop by a quarter of an
    # output pixel costs on this texture (>= 7 measured; asserted > 4 below), so a crop mapped to
    # the wrong region fails.
    data = encode(textured_image(1024, 768, period=97), "JPEG", quality=95)
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    transform = ImageTransform(image_size=32, **LEVELS, crop_scale=(0.5, 0.9))
    for seed in range(4):
        view = transform.plan(decoded.size, random.Random(seed))
        assert draft_factor(view) == 8
        (drafted,) = decode_transformed(data, transform, random.Random(seed), "x")
        (full,) = decode_transformed(data, transform, random.Random(seed), "x", draft=False)
        assert not torch.equal(drafted, full)  # the draft path really ran
        assert (drafted - full).abs().mean() < 2

        left, top, right, bottom = view.box
        quarter = (right - left) / 32 / 4 * (1 if right + 16 <= decoded.width else -1)
        moved = decoded.resize((32, 32), Image.BICUBIC, box=(left + quarter, top, right + quarter, bottom))
        moved = torch.from_numpy(np.asarray(moved, dtype=np.float32)).permute(2, 0, 1)
        assert (moved - full).abs().mean() > 4


def test_no_draft_when_a_box_is_not_downscaled_enough():
    # 300 px boxes to 224 px: a half-scale decode would have to be upsampled again.
    data = encode(textured_image(320, 320), "JPEG", quality=95)
    transform = ImageTransform(image_size=224, **LEVELS, crop_scale=(0.9, 1.0))
    assert draft_factor(transform.plan((320, 320), random.Random(0))) == 1
    drafted = decode_transformed(data, transform, random.Random(0), "x")[0]
    assert torch.equal(drafted, decode_transformed(data, transform, random.Random(0), "x", draft=False)[0])


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_truncated_bytes_raise_data_error_naming_the_sample(cut):
    data = encode(textured_image(64, 48), "JPEG", quality=90)
    transform = ImageTransform(image_size=16, **LEVELS)
    with pytest.raises(DataError, match=r"sample 7 \(abc\): cannot decode image"):
        decode_transformed(data[: int(len(data) * cut)], transform, random.Random(0), "sample 7 (abc)")


def test_bytes_that_are_no_image_raise_data_error():
    with pytest.raises(DataError, match="shard 3: cannot decode image"):
        decode_transformed(
            b"not an image", ImageTransform(image_size=8, **LEVELS), random.Random(0), "shard 3"
        )


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "I;16"])
def test_any_pil_mode_comes_out_rgb_like_the_pil_path(mode):
    base = textured_image(40, 30)
    image = base.quantize(16) if mode == "P" else base.convert(mode)
    data = encode(image, "PNG")
    transform = ImageTransform(image_size=16, **LEVELS, crop_scale=(0.5, 1.0))
    (out,) = decode_transformed(data, transform, random.Random(3), "x")
    assert out.shape == (3, 16, 16)
    assert (out - reference(data, transform, random.Random(3))).abs().mean() < 0.25
    if mode in ("L", "LA", "I;16"):
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_colour_ops_and_grayscale_follow_the_pil_path():
    data = encode(textured_image(64, 48), "PNG")
    transform = ImageTransform(
        image_size=24, **LEVELS, crop_scale=(0.5, 1.0), color_jitter=0.8, grayscale=0.5
    )
    for seed in range(6):
        (out,) = decode_transformed(data, transform, random.Random(seed), "x")
        # Colour ops amplify the resampler's ~0.03-level differences a little (contrast up to 1.64x).
        assert (out - reference(data, transform, random.Random(seed))).abs().mean() < 0.5


def test_resized_uint8_for_batched_augmentation():
    data = encode(textured_image(100, 80), "PNG")
    (out,) = decode_transformed(data, ResizedUInt8(64), random.Random(0), "x")
    expected = ResizedUInt8(64)(Image.open(io.BytesIO(data)), random.Random(0))
    assert out.dtype == torch.uint8 and out.shape == (3, 64, 64) and out.is_contiguous()
    assert (out.int() - expected.int()).abs().max() <= 1


def test_one_generator_per_view_or_one_for_all():
    data = encode(textured_image(32, 32), "PNG")
    transform = ImageTransform(image_size=8, **LEVELS)
    with pytest.raises(ValueError, match="2 transforms but 3 random generators"):
        decode_transformed(data, [transform, transform], [random.Random(0)] * 3, "x")


def test_a_loader_error_names_a_foreign_sample_by_key_and_shard():
    # Shards written elsewhere have no global index: the message said "sample None (s9)".
    from clipkit.contract.types import Sample
    from clipkit.data.loader import sample_name

    foreign = Sample(key="s9", image=b"", image_ext="jpg", captions=(), meta={"index": None})
    named = sample_name({"__url__": "/data/wds/000001.tar"}, foreign)
    assert named.startswith("sample 's9' in /data/wds/000001.tar") and "clipkit shard webdataset:" in named
    own = Sample(key="k", image=b"", image_ext="jpg", captions=(), meta={"index": 7})
    assert sample_name({}, own) == "sample 7 (k)"
