"""Hostile inputs from the wild: unusual image files and captions, pushed through sharding, the
training loader and evaluation.

* A 16-bit greyscale PNG with a transparency key (tRNS) is scaled to 8 bits like one without: PIL's
  RGBA conversion clipped the whole image to white, in training and evaluation alike.
* A centre crop of an extreme aspect ratio (a 1 x 20 000 spacer PNG of 161 bytes) resamples only
  the region it keeps: resized whole to 224 px wide it was 224 x 4 480 000 pixels (3 GB, 10 s per
  image) in evaluation and the batched loader; the loader and evaluation still agree exactly.
* Skipped rows are traceable: the manifest keeps the first row skipped for each reason
  (``info.skipped_examples``, kept across a resume) and ``clipkit shard`` prints it under the counts;
  PIL's ``<_io.BytesIO object at 0x...>`` is left out of them (a different address every run).
* ``clipkit eval`` over a raw table or folder (read, not sharded) said nothing of the rows it skipped:
  a score over 12 of 24 rows looked like one over the whole table; each task's result now carries
  a warning with the counts and the first row.
* A ``classes:`` or ``folder:`` source left out files named like images in formats the shards do
  not store (``.gif``, ``.tif``, ``.avif``, ``.svg``) without a count; they are now listed and counted
  (``unsupported_image``), and a ``.jfif`` (a JPEG) is stored. Two class folders that are one
  directory (a symbolic link to a sibling) are refused: their images were labelled twice.
* A caption of only invisible characters (zero-width spaces, a byte-order mark, a Hangul filler)
  was kept, the text tower reading nothing but its start and end tokens: ``empty_caption`` now.
  Captions with something visible keep their format characters (emoji joiners).
"""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.data.image_modes import to_rgb
from clipkit.data.shard import open_source, read_manifest
from clipkit.data.transforms import (
    MAX_RESIZED_SIDES,
    ImageTransform,
    ResizedUInt8,
    center_crop_geometry,
    decode_for_eval,
    decode_transformed,
    resize_center_crop,
)
from clipkit.errors import DataError


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def grey16_ramp(width: int = 64, height: int = 8) -> np.ndarray:
    """A [height, width] uint16 ramp from 0 to 65535 along the width."""
    return np.linspace(0, 65535, width, dtype=np.float64).round().astype(np.uint16)[None].repeat(height, 0)


def test_sixteen_bit_grey_with_a_transparency_key_is_scaled_not_white():
    ramp = grey16_ramp()
    data = encode(Image.fromarray(ramp), transparency=0)  # only the darkest column is transparent
    with Image.open(io.BytesIO(data)) as image:
        assert image.mode == "I;16" and image.info["transparency"] == 0
        rgb = np.asarray(to_rgb(image, background=(0, 0, 255)))
    expected = (ramp.astype(np.int64) * 255 + 32767) // 65535
    assert (rgb[:, 1:, 0] == expected[:, 1:]).all()  # opaque pixels: scaled grey
    assert (rgb[:, 0] == (0, 0, 255)).all()  # the key's pixels: the background
    transform = ImageTransform(8, (0.0,) * 3, (1.0,) * 3)
    shown = decode_for_eval(data, transform, "g16.png").mean().item() * 255
    (loaded,) = decode_transformed(data, ResizedUInt8(8), random.Random(0), "g16.png")
    assert 100 < shown < 160 and 100 < loaded.float().mean().item() < 160  # was 255: all white


def test_extreme_aspect_ratio_centre_crop_resamples_only_the_kept_region():
    side = 224
    _, resized, _ = center_crop_geometry((1, 20_000), side)
    assert resized == (side, side)  # was (224, 4 480 000)
    _, resized, _ = center_crop_geometry((1, MAX_RESIZED_SIDES), side)
    assert resized == (side, MAX_RESIZED_SIDES * side)  # up to the limit: torchvision's way, whole


def test_extreme_aspect_ratio_is_the_same_in_the_loader_and_evaluation():
    ramp = np.linspace(0, 255, 600).astype(np.uint8)[:, None, None].repeat(3, 1).repeat(3, 2)
    image = Image.fromarray(ramp)  # 3 x 600, dark at the top, light at the bottom
    data, side = encode(image), 8
    transform = ImageTransform(side, (0.0,) * 3, (1.0,) * 3)
    shown = decode_for_eval(data, transform, "strip.png")
    for decoder in ("auto", None):
        (loaded,) = decode_transformed(data, transform, random.Random(0), "strip.png", decoder=decoder)
        assert torch.equal(loaded, shown)
    (batched,) = decode_transformed(data, ResizedUInt8(side), random.Random(0), "strip.png")
    assert torch.equal(batched, torch.from_numpy(np.array(resize_center_crop(image, side))).permute(2, 0, 1))
    assert torch.equal(batched.float() / 255, shown)
    middle = np.asarray(image.resize((side, 1600), 3))[796:804].astype(int)  # the whole strip, cropped
    assert np.abs(shown.permute(1, 2, 0).numpy() * 255 - middle).max() <= 3


def write_table(directory, rows: list[dict]) -> str:
    """``directory/t.jsonl`` with one row per dict, each with its own small PNG (``image`` set to
    None in a row means no image file is written for it)."""
    lines = []
    for i, row in enumerate(rows):
        if row.get("image", "") == "":
            Image.new("RGB", (8, 8), (30 * i, 0, 0)).save(directory / f"{i}.png")
            row = {"image": f"{i}.png", **{k: v for k, v in row.items() if k != "image"}}
        lines.append(json.dumps(row))
    (directory / "t.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / "t.jsonl")


BAD_ROWS = [
    {"caption": "a red square"},
    {"caption": "   "},
    {"caption": "a red\u0000square"},
    {"image": "gone.png", "caption": "a missing picture"},
    {"caption": ""},
]


def test_shard_names_the_first_row_skipped_for_each_reason(tmp_path):
    table = write_table(tmp_path, BAD_ROWS)
    result = CliRunner().invoke(make_app(), ["shard", table, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "skipped 4 bad row(s): bad_caption 1, empty_caption 2, missing_image 1" in result.output
    examples = read_manifest(tmp_path / "out")["info"]["skipped_examples"]
    assert examples["empty_caption"].startswith(f"{table}: line 2: empty_caption")  # the first of two
    assert examples["bad_caption"].startswith(f"{table}: line 3: bad_caption: caption contains NUL")
    assert "gone.png" in examples["missing_image"]
    for example in examples.values():
        assert f"  e.g. {example}" in result.output


def test_skipped_row_examples_survive_a_resume(tmp_path):
    table = write_table(tmp_path, [*BAD_ROWS, {"caption": "late"}, {"caption": "later"}])
    rows = iter(source := open_source(table))
    next(rows), next(rows)  # rows 1 and 6: the four bad rows between them skipped
    state = json.loads(json.dumps(source.state()))  # as the shard journal stores it
    assert set(state["skipped_examples"]) == {"empty_caption", "bad_caption", "missing_image"}
    resumed = open_source(table)
    resumed.restore(state)
    assert len(list(resumed)) == 1  # row 7
    assert resumed.info()["skipped_examples"] == dict(sorted(source.skipped_examples.items()))


def test_eval_over_a_raw_table_says_which_rows_it_skipped(tmp_path):
    from clipkit.eval.evaluate import run_evals
    from clipkit.model import build_model

    registry = Registry(make_plugin_manager(autoload=False))
    table = write_table(tmp_path, [*BAD_ROWS, {"caption": "a dark square"}])
    torch.manual_seed(0)
    model = build_model(api.resolve("quickstart@smoke", [], registry), registry)
    [result] = run_evals(model, [{"name": "retrieval", "data": table}], registry)
    assert "failed" not in result, result
    assert result["n_images"] == 2
    (warning,) = [text for text in result["warnings"] if "skipped" in text]
    assert warning.startswith(
        f"{table}: 4 bad row(s) skipped (bad_caption 1, empty_caption 2, missing_image 1"
    )
    assert f"e.g. {table}: line 2: empty_caption" in warning and warning.endswith("scored on the 2 read")


def test_class_folders_count_images_in_formats_the_shards_do_not_store(tmp_path):
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "a.png")
    frames[0].save(tmp_path / "cat" / "b.gif", save_all=True, append_images=frames[1:])
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "c.tif")
    (tmp_path / "cat" / "d.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "e.jfif", format="JPEG")
    (tmp_path / "cat" / "._a.png").write_bytes(b"\x00\x05\x16\x07")  # macOS resource fork: not a row
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    source = open_source(f"classes:{tmp_path}")
    samples = list(source)
    assert [(sample.key, sample.image_ext) for sample in samples] == [("cat/a", "png"), ("cat/e", "jpg")]
    assert source.skipped == {"unsupported_image": 3}  # b.gif, c.tif, d.svg: were left out uncounted
    (tmp_path / "cat" / "f.txt").write_text("a caption")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "f.tif")
    folder = open_source(f"folder:{tmp_path}")
    assert list(folder) == [] and folder.skipped == {"missing_caption": 5, "unsupported_image": 1}


def test_two_class_folders_that_are_one_directory_are_refused(tmp_path):
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "a.png")
    os.symlink(tmp_path / "cat", tmp_path / "kitten")
    with pytest.raises(DataError, match="'cat' and 'kitten' are the same directory"):
        open_source(f"classes:{tmp_path}")


@pytest.mark.parametrize("caption", ["\u200b\u200b", "\ufeff", "\u3164", " \u2060\u200d "])
def test_a_caption_that_shows_nothing_is_an_empty_caption(tmp_path, caption):
    table = write_table(tmp_path, [{"caption": caption}, {"caption": "👨\u200d👩\u200d👧 a family"}])
    source = open_source(table)
    (kept,) = list(source)
    assert kept.captions == ("👨\u200d👩\u200d👧 a family",)  # joiners inside a caption are kept
    assert source.skipped == {"empty_caption": 1}


def test_skipped_examples_hold_no_memory_address(tmp_path):
    (tmp_path / "v.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    table = write_table(tmp_path, [{"image": "v.svg", "caption": "a vector"}, {"caption": "a square"}])
    source = open_source(table)
    list(source)
    (example,) = source.info()["skipped_examples"].values()
    assert example.endswith("is not a readable image (cannot identify image file)"), example
