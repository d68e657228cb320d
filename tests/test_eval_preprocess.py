"""The eval transform (``clipkit eval``, ``clipkit.load``'s preprocess) is pixel-identical to
torchvision's ``Resize(S, BICUBIC, antialias=True) + CenterCrop(S) + ToTensor() + Normalize`` on
PIL images — open_clip's and CLIP_benchmark's eval preprocessing.

References: tests/golden/eval_preprocess_torchvision.npz holds torchvision 0.28.0's own output
(Pillow 13.0.0) for the synthetic cases of tests/eval_preprocess_cases.py, produced once by
tools/make_eval_preprocess_reference.py; it checks ``torchvision_reference`` (a restatement of
torchvision's arithmetic with PIL), which the live tests then use on real photos and other modes.
With the ``interop`` extra installed, open_clip's own eval preprocess is compared too.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_preprocess_cases import (
    CASES,
    MEAN,
    STD,
    case_image,
    reference_pixels,
    to_tensor_normalize,
    torchvision_reference,
)
from interop_support import import_open_clip
from PIL import Image
from shared_data_path import SHARED_DATA

from clipkit.artifacts.loading import Preprocess
from clipkit.data.image_modes import to_rgb
from clipkit.data.transforms import (
    ImageTransform,
    centred_offset,
    decode_for_eval,
    decode_transformed,
    shorter_side_size,
)

GOLDEN = Path(__file__).parent / "golden" / "eval_preprocess_torchvision.npz"


def eval_transform(size: int) -> ImageTransform:
    return ImageTransform(image_size=size, mean=MEAN, std=STD)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as arrays:
        return dict(arrays)


# --- geometry -----------------------------------------------------------------------------------


def test_long_side_is_truncated_and_crop_offsets_round_half_to_even():
    assert shorter_side_size((640, 427), 48) == (71, 48)  # 71.94: torchvision truncates
    assert shorter_side_size((427, 640), 48) == (48, 71)
    assert shorter_side_size((33, 17), 24) == (46, 24) and shorter_side_size((7, 5), 24) == (33, 24)
    assert shorter_side_size((50, 50), 24) == (24, 24)
    assert [centred_offset(length, 24) for length in (59, 61, 24, 25)] == [18, 18, 0, 0]  # 17.5, 18.5, 0, 0.5


def test_resized_image_is_never_smaller_than_the_crop():
    # torchvision pads an image smaller than the crop; after Resize(S) that cannot happen.
    for side in (1, 24, 224, 336):
        for short in range(1, 80):
            for long in range(short, short + 40):
                width, height = shorter_side_size((long, short), side)
                assert height == side and width >= side


# --- against torchvision's stored output ----------------------------------------------------------


def test_restatement_reproduces_torchvision(golden):
    for name, (_, _, size) in CASES.items():
        np.testing.assert_array_equal(reference_pixels(case_image(name), size), golden[f"pixels/{name}"])
    for key in (key for key in golden if key.startswith("tensor/")):
        name = key.removeprefix("tensor/")
        assert torch.equal(
            torchvision_reference(case_image(name), CASES[name][2]), torch.from_numpy(golden[key])
        )


def test_eval_transform_is_pixel_identical_to_torchvision(golden):
    for name, (_, _, size) in CASES.items():
        out = eval_transform(size)(case_image(name), random.Random(0))
        assert torch.equal(out, to_tensor_normalize(golden[f"pixels/{name}"])), name
        if f"tensor/{name}" in golden:  # ToTensor + Normalize too, bit for bit
            assert torch.equal(out, torch.from_numpy(golden[f"tensor/{name}"])), name


def test_clipkit_load_preprocess_is_the_same_transform(golden):
    preprocess = Preprocess(eval_transform(24))
    assert torch.equal(preprocess(case_image("odd_33x17")), torch.from_numpy(golden["tensor/odd_33x17"]))


# --- from encoded bytes: clipkit eval's decode ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_eval_decode_matches_torchvision_on_the_decoded_image(fmt):
    for name in ("landscape_640x427", "portrait_427x640", "odd_33x17", "small_7x5"):
        data = encode(case_image(name), fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        size = CASES[name][2]
        out = decode_for_eval(data, eval_transform(size), "x")
        assert torch.equal(out, torchvision_reference(Image.open(io.BytesIO(data)), size)), name


def test_large_jpeg_is_decoded_at_full_size():
    # 640 × 427 -> 24 px: the training loader decodes this JPEG at 1/8 scale (DCT scaling) and
    # resamples with torch's kernel; the eval decode must not (the 82-166 level gaps).
    data = encode(case_image("landscape_640x427"), "JPEG", quality=90)
    expected = torchvision_reference(Image.open(io.BytesIO(data)), 24)
    assert torch.equal(decode_for_eval(data, eval_transform(24), "x"), expected)
    (fast,) = decode_transformed(data, eval_transform(24), random.Random(0), "x")
    assert not torch.equal(fast, expected)  # the loader's trade-off, kept out of evaluation


# --- real photos (../shared/data) ---------------------------------------------------------------


def test_real_coco_photos_match_torchvision(shared_data):
    paths = sorted((SHARED_DATA / "coco-mini-cc-by" / "images").glob("*.jpg"))
    assert len(paths) >= 50
    transform = eval_transform(224)
    for path in paths:
        data = path.read_bytes()
        expected = torchvision_reference(Image.open(io.BytesIO(data)), 224)
        assert torch.equal(decode_for_eval(data, transform, path.name), expected), path.name


def test_scikit_image_photos_match_torchvision():
    data = pytest.importorskip("skimage.data")
    for name in ("astronaut", "chelsea", "coffee", "rocket"):  # 512², 451 × 300, 600 × 400, 640 × 427
        image = Image.fromarray(getattr(data, name)())
        png = encode(image, "PNG")
        assert torch.equal(decode_for_eval(png, eval_transform(224), name), torchvision_reference(image, 224))


# --- image modes ----------------------------------------------------------------------------------


def mode_images() -> dict[str, Image.Image]:
    """Opaque non-RGB images whose conversion to RGB clipkit does exactly as ``convert("RGB")``."""
    rng = np.random.default_rng(7)
    grey = rng.integers(0, 256, (17, 33), dtype=np.uint8)
    palette = Image.fromarray(rng.integers(0, 16, (17, 33), dtype=np.uint8), "P")
    palette.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tolist())
    cmyk = Image.fromarray(rng.integers(0, 256, (17, 33, 4), dtype=np.uint8), "CMYK")
    opaque = np.dstack([rng.integers(0, 256, (17, 33, 3), dtype=np.uint8), np.full((17, 33), 255, np.uint8)])
    return {
        "L": Image.fromarray(grey, "L"),
        "1": Image.fromarray(grey > 127),
        "P": palette,
        "CMYK": cmyk,
        "RGBA opaque": Image.fromarray(opaque, "RGBA"),
    }


def test_opaque_modes_convert_like_open_clip():
    for mode, image in mode_images().items():
        assert torch.equal(eval_transform(24)(image, random.Random(0)), torchvision_reference(image, 24)), (
            mode
        )
        fmt = "JPEG" if mode == "CMYK" else "PNG"
        decoded_image = Image.open(io.BytesIO(encode(image, fmt)))
        out = decode_for_eval(encode(image, fmt), eval_transform(24), mode)
        assert torch.equal(out, torchvision_reference(decoded_image, 24)), mode


def test_transparency_16_bit_and_exif_follow_clipkit_rule_with_torchvision_geometry():
    # Deliberate differences from convert("RGB") (clipkit.data.image_modes): transparent pixels are
    # composited onto the background, 16-bit grey is scaled (convert clips it), EXIF turns upright.
    # The geometry and arithmetic after that conversion are still torchvision's.
    rng = np.random.default_rng(3)
    rgba = np.dstack(
        [rng.integers(0, 256, (17, 33, 3), dtype=np.uint8), rng.integers(0, 256, (17, 33), dtype=np.uint8)]
    )
    sixteen = Image.fromarray(rng.integers(0, 65536, (17, 33), dtype=np.uint16))  # I;16
    rotated = case_image("odd_33x17")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown rotated 90° clockwise
    for image, fmt, options in [
        (Image.fromarray(rgba, "RGBA"), "PNG", {}),
        (sixteen, "PNG", {}),
        (rotated, "PNG", {"exif": exif.tobytes()}),
    ]:
        data = encode(image, fmt, **options)
        shown = to_rgb(Image.open(io.BytesIO(data)))
        expected = torchvision_reference(shown, 24)
        assert torch.equal(decode_for_eval(data, eval_transform(24), "x"), expected)
        assert not torch.equal(expected, torchvision_reference(Image.open(io.BytesIO(data)), 24))
    assert shown.size == (17, 33)  # the EXIF case was turned upright


# --- open_clip's own eval preprocess (interop extra) --------------------------------------------


def test_open_clip_eval_preprocess_gives_identical_tensors():
    import_open_clip()  # skips without the interop extra
    from open_clip.transform import image_transform

    cases = [(case_image(name), size) for name, (_, _, size) in CASES.items()]
    cases.append((mode_images()["L"], 24))  # open_clip resizes before converting: same pixels for L
    photos = sorted((SHARED_DATA / "coco-mini-cc-by" / "images").glob("*.jpg"))[:12]
    cases += [(Image.open(path), 224) for path in photos]  # none when the shared data is absent
    for image, size in cases:
        theirs = image_transform(size, is_train=False, mean=MEAN, std=STD)(image)
        assert torch.equal(eval_transform(size)(image, random.Random(0)), theirs), image.size


# --- the same model through both paths ----------------------------------------------------------


def two_colour_images(count: int) -> list[Image.Image]:
    """Seeded odd-sized images of one coloured rectangle on another colour, every other one on a dark
    background. The noise cases all look alike to a random model (it gives them one class); these
    differ in brightness, colour and layout, so the model tells some apart without the shared photos."""
    rng = np.random.default_rng(7)
    images = []
    for i in range(count):
        width, height = (int(side) for side in rng.integers(19, 97, size=2))
        pixels = np.empty((height, width, 3), dtype=np.uint8)
        pixels[:] = rng.integers(0, 32 if i % 2 == 0 else 256, size=3)
        top, left = int(rng.integers(0, height // 2)), int(rng.integers(0, width // 2))
        pixels[top : top + height // 2, left : left + width // 2] = rng.integers(0, 256, size=3)
        images.append(Image.fromarray(pixels, "RGB"))
    return images


def class_folders(root: Path) -> str:
    """A ``classes:`` source of odd-sized JPEGs (the synthetic cases, two-colour images, and the COCO
    photos when the shared data is present) spread over three classes -> its URI."""

    photos = [Image.open(path) for path in sorted(SHARED_DATA.glob("coco-*/images/*.jpg"))]
    images = [case_image(name) for name in CASES] + two_colour_images(12) + photos
    for i, image in enumerate(images):
        folder = root / ("cat", "dog", "bus")[i % 3]
        folder.mkdir(parents=True, exist_ok=True)
        image.convert("RGB").save(folder / f"{i:03d}.jpg", quality=90)
    return f"classes:{root}"


def test_zero_shot_gives_the_same_predictions_as_the_reference_pipeline(tmp_path, registry):
    from clipkit.config.recipe import load_recipe, validate_or_raise
    from clipkit.eval.evaluate import encode_images, image_text_logits, load_samples, run_evals, topk_accuracy
    from clipkit.model import build_model
    from clipkit.plugins.evals.zero_shot import ZeroShot

    overrides = ["model.tokenizer.name=clip_bpe", "model.tokenizer.context_length=16"]
    recipe = validate_or_raise(load_recipe("clip@tiny", overrides, registry=registry), registry)
    torch.manual_seed(0)
    model = build_model(recipe, registry).eval()
    data = class_folders(tmp_path / "data")

    task = ZeroShot(data=data)
    samples, info = load_samples(data, registry=registry)
    classnames, templates = task.prompts(info, samples)
    labels = torch.tensor([task.class_index(sample, classnames) for sample in samples])
    class_points = task.class_points(model, task.prompt_names(classnames), templates)
    ours = image_text_logits(model, encode_images(model, samples), class_points)  # clipkit eval's path
    size, mean, std = model.transform.image_size, model.transform.mean, model.transform.std
    with torch.no_grad():
        reference = torch.stack(
            [torchvision_reference(Image.open(io.BytesIO(s.image)), size, mean, std) for s in samples]
        )
        theirs = image_text_logits(model, model.encode_image(reference).float(), class_points)

    assert torch.equal(ours.argmax(dim=1), theirs.argmax(dim=1))  # every image's prediction
    assert torch.equal(ours, theirs)
    (result,) = run_evals(model, [{"name": "zero_shot", "data": data}], registry)
    assert result["top1"] == topk_accuracy(theirs, labels, 1)


def test_open_clip_end_to_end_predicts_what_clipkit_eval_predicts(tmp_path, registry):
    """An open_clip model with open_clip's own eval preprocess and zero-shot classifier (what
    CLIP_benchmark runs) vs the same weights converted into clipkit through the zero_shot task's
    code: the same prediction for every odd-sized image, the same top-1."""
    open_clip = import_open_clip()
    from open_clip.transform import PreprocessCfg, image_transform_v2
    from open_clip.zero_shot_classifier import build_zero_shot_classifier
    from test_interop_open_clip import VIT, open_clip_model, save_open_clip_dir

    from clipkit.eval.evaluate import encode_images, image_text_logits, load_samples
    from clipkit.plugins.evals.zero_shot import ZeroShot
    from clipkit.plugins.interop.layouts import load_model

    original = open_clip_model(VIT, seed=1)
    ours, _ = load_model(save_open_clip_dir(original, VIT, tmp_path / "oc"), registry)
    data = class_folders(tmp_path / "data")
    templates = ["a photo of a {}.", "a {}"]
    task = ZeroShot(data=data, templates=templates)
    samples, info = load_samples(data, registry=registry)
    classnames, _ = task.prompts(info, samples)
    labels = torch.tensor([task.class_index(sample, classnames) for sample in samples])
    class_points = task.class_points(ours, task.prompt_names(classnames), templates)
    clipkit_images = encode_images(ours, samples)
    clipkit_predictions = image_text_logits(ours, clipkit_images, class_points).argmax(dim=1)

    config = {**open_clip.get_model_preprocess_cfg(original), "size": VIT["vision_cfg"]["image_size"]}
    preprocess = image_transform_v2(PreprocessCfg(**config), is_train=False)  # bicubic, shortest side
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=VIT["text_cfg"]["context_length"])
    with torch.no_grad():
        images = torch.stack([preprocess(Image.open(io.BytesIO(sample.image))) for sample in samples])
        classifier = build_zero_shot_classifier(original, tokenizer, task.prompt_names(classnames), templates)
        open_clip_images = original.encode_image(images, normalize=True)
        open_clip_predictions = (open_clip_images @ classifier).argmax(dim=1)

    # Same pixels, so the embeddings agree to the two implementations' float error (the loader's
    # approximate path missed this by up to 8e-3 yet gave the same predictions: they alone are weak).
    torch.testing.assert_close(clipkit_images.points[:, 0], open_clip_images, atol=1e-5, rtol=1e-5)

    assert len(set(open_clip_predictions.tolist())) > 1  # a model that predicts one class would prove little
    assert torch.equal(clipkit_predictions, open_clip_predictions)
    assert task(ours, registry)["top1"] == float((open_clip_predictions == labels).double().mean())
