"""Tests for the embedded synthetic shapes dataset (clipkit.plugins.sources.synthetic_shapes)."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from clipkit.contract.types import Sample
from clipkit.plugins.sources import synthetic_shapes as ss


def tokens(text: str) -> list[str]:
    """Words and punctuation marks, the units a word-level tokenizer could see."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


def decode(sample: Sample) -> np.ndarray:
    with Image.open(io.BytesIO(sample.image)) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def train_vocabulary() -> set[str]:
    """Tokens of 500 training samples' captions (what a text encoder trained on them knows)."""
    source = ss.SyntheticShapes(n=500, split="train", seed=0)
    return {t for i in range(len(source)) for c in source.sample(i).captions for t in tokens(c)}


# --- attributes and splits -------------------------------------------------------------------


def test_attribute_constants():
    assert len(ss.COLOURS) == len(set(ss.COLOURS)) == 8
    assert len(ss.SHAPES) == len(set(ss.SHAPES)) == 5
    assert len(ss.POSITIONS) == 9 and "centre" in ss.POSITIONS
    assert ss.SIZES == ("small", "large")
    assert all(" " not in c for c in ss.COLOURS + ss.SHAPES)


def test_heldout_combos_cover_every_colour_once_and_each_shape_at_most_twice():
    assert len(ss.HELDOUT_COMBOS) == 8
    held_colours = [c for c, _ in ss.HELDOUT_COMBOS]
    assert sorted(held_colours) == sorted(ss.COLOURS)
    held_shapes = [s for _, s in ss.HELDOUT_COMBOS]
    assert max(held_shapes.count(s) for s in ss.SHAPES) <= 2


def test_split_combos():
    train, heldout, every = (set(ss.combos_for_split(s)) for s in ("train", "heldout", "all"))
    assert len(train) == 32 and len(heldout) == 8 and len(every) == 40
    assert train | heldout == every and not train & heldout


def test_train_split_never_shows_heldout_combos_and_covers_every_attribute():
    metas = [s.meta for s in ss.SyntheticShapes(n=400, split="train", seed=3)]
    assert not {(m["colour"], m["shape"]) for m in metas} & set(ss.HELDOUT_COMBOS)
    assert {m["colour"] for m in metas} == set(ss.COLOURS)
    assert {m["shape"] for m in metas} == set(ss.SHAPES)
    assert {m["position"] for m in metas} == set(ss.POSITIONS)
    assert {m["size"] for m in metas} == set(ss.SIZES)


def test_heldout_split_only_shows_heldout_combos():
    combos = {(s.meta["colour"], s.meta["shape"]) for s in ss.SyntheticShapes(n=200, split="heldout")}
    assert combos == set(ss.HELDOUT_COMBOS)


# --- determinism -----------------------------------------------------------------------------


def test_iteration_is_deterministic_and_matches_sample():
    source = ss.SyntheticShapes(n=20, seed=7)
    first, second = list(source), list(source)
    assert first == second
    assert list(ss.SyntheticShapes(n=20, seed=7)) == first
    assert len(source) == 20
    for i in (0, 5, 19):
        assert source.sample(i) == first[i]
    assert [s.key for s in first] == [f"train-7-{i:08d}" for i in range(20)]


def test_sample_is_independent_of_n_and_global_random_state():
    import random

    random.seed(123)
    a = ss.SyntheticShapes(n=10, seed=1).sample(4)
    random.seed(456)
    np.random.seed(0)
    assert ss.SyntheticShapes(n=1000, seed=1).sample(4) == a


def test_seeds_and_splits_differ():
    base = [s.image for s in ss.SyntheticShapes(n=10, seed=0)]
    assert base != [s.image for s in ss.SyntheticShapes(n=10, seed=1)]
    assert base != [s.image for s in ss.SyntheticShapes(n=10, split="all", seed=0)]
    assert len(set(base)) == len(base)  # samples within a source differ too


def test_sample_index_out_of_range():
    source = ss.SyntheticShapes(n=3)
    with pytest.raises(IndexError):
        source.sample(3)
    with pytest.raises(IndexError):
        source.sample(-1)


# --- samples -----------------------------------------------------------------------------------


@pytest.mark.parametrize("image_size", [32, 64])
def test_png_decodes_to_the_right_size(image_size):
    for sample in ss.SyntheticShapes(n=5, image_size=image_size):
        assert sample.image_ext == "png"
        assert decode(sample).shape == (image_size, image_size, 3)


def test_captions_state_every_attribute():
    for sample in ss.SyntheticShapes(n=100, split="all", seed=2):
        m = sample.meta
        assert len(sample.captions) == 2 and sample.captions[0] != sample.captions[1]
        assert m["combo"] == f"{m['colour']} {m['shape']}"
        for caption in sample.captions:
            assert len(caption.split()) <= 12
            words = f" {' '.join(tokens(caption))} "
            for attribute in ("colour", "shape", "position", "size"):
                assert f" {m[attribute]} " in words, (caption, attribute)


def test_articles_agree_with_the_next_word():
    texts = [c for s in ss.SyntheticShapes(n=200, split="all") for c in s.captions]
    for label in ss.SyntheticShapes(n=1, split="all").info()["labels"].values():
        texts += [t.format(c) for t in label["templates"] for c in label["classes"]]
    assert any(" an orange " in f" {t} " for t in texts)
    for text in texts:
        words = tokens(text)
        for article, word in zip(words, words[1:], strict=False):
            if article in ("a", "an"):
                assert (article == "an") == (word[0] in "aeiou"), text


def test_meta_is_json_serialisable():
    sample = ss.SyntheticShapes(n=1).sample(0)
    keys = {"colour", "shape", "position", "size", "combo", "extent", "x", "y"}
    assert set(json.loads(json.dumps(dict(sample.meta)))) == keys


def test_continuous_geometry_matches_the_stated_attributes():
    source = ss.SyntheticShapes(n=200, image_size=48)
    for sample in source:
        meta = sample.meta
        row, col = divmod(ss.POSITIONS.index(meta["position"]), 3)
        assert col / 3 <= meta["x"] <= (col + 1) / 3 and row / 3 <= meta["y"] <= (row + 1) / 3
        nominal = ss.SIZE_FRACTION[meta["size"]]
        assert 0.9 * nominal - 1e-6 <= meta["extent"] <= nominal + 1e-6  # EXTENT_JITTER only shrinks


def _nearest_colour(pixels: np.ndarray) -> np.ndarray:
    palette = np.array([ss.PALETTE[c] for c in ss.COLOURS], dtype=np.float32)
    distances = np.linalg.norm(pixels[:, None, :].astype(np.float32) - palette[None], axis=-1)
    return distances.argmin(axis=1)


@pytest.mark.parametrize("image_size", [32, 64])
def test_shape_is_drawn_in_its_colour_inside_its_cell(image_size):
    """Non-background pixels lie in the stated cell, and the stated colour dominates them."""
    cell = image_size / 3
    for sample in ss.SyntheticShapes(n=60, split="all", seed=5, image_size=image_size):
        pixels = decode(sample).astype(np.int32)
        background = np.median(pixels.reshape(-1, 3), axis=0)
        foreground = np.abs(pixels - background).max(axis=-1) > 60
        row, col = divmod(ss.POSITIONS.index(sample.meta["position"]), 3)
        rows = slice(int(row * cell), int(np.ceil((row + 1) * cell)))
        cols = slice(int(col * cell), int(np.ceil((col + 1) * cell)))
        inside = np.zeros_like(foreground)
        inside[rows, cols] = True
        assert foreground[inside].sum() >= 0.08 * cell**2, sample.captions
        assert not foreground[~inside].any(), sample.captions  # nothing outside the cell
        # Anti-aliased edges blend the colour with the background (half-cyan can be nearer blue),
        # so judge the shape's core: pixels at least 70% as far from the background as the most
        # distant one.
        deviation = np.linalg.norm(pixels - background, axis=-1)
        core = deviation >= 0.7 * deviation[inside].max()
        nearest = _nearest_colour(pixels[core & inside])
        share = np.mean(nearest == ss.COLOURS.index(sample.meta["colour"]))
        assert share >= 0.9, (sample.captions, share)


def test_large_shapes_cover_more_pixels_than_small_ones():
    covered = {"small": [], "large": []}
    for sample in ss.SyntheticShapes(n=80, split="all", seed=9):
        pixels = decode(sample).astype(np.int32)
        background = np.median(pixels.reshape(-1, 3), axis=0)
        covered[sample.meta["size"]].append((np.abs(pixels - background).max(axis=-1) > 60).sum())
    assert max(covered["small"]) < np.mean(covered["large"])


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "split"),
        ({"n": 0}, "n must be >= 1"),
        ({"n": 2.5}, "n must be an integer"),
        ({"image_size": 8}, "image_size must be >= 16"),
        ({"seed": "0"}, "seed must be an integer"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ss.SyntheticShapes(**kwargs)


def test_render_rejects_unknown_attributes():
    import random

    with pytest.raises(ValueError, match="unknown colour 'mauve'"):
        ss.render("mauve", "circle", "top", "small", random.Random(0))


# --- info and zero-shot prompts ----------------------------------------------------------------


@pytest.mark.parametrize("split", ss.SPLITS)
def test_info_is_json_serialisable(split):
    source = ss.SyntheticShapes(n=3, split=split, seed=4, image_size=48)
    info = json.loads(json.dumps(source.info()))
    assert info["name"] == "synthetic-shapes"
    assert (info["split"], info["n"], info["seed"], info["image_size"]) == (split, 3, 4, 48)
    assert info["heldout_combos"] == [f"{c} {s}" for c, s in ss.HELDOUT_COMBOS]
    labels = info["labels"]
    assert set(labels) == {"colour", "shape", "position", "combo"}
    assert labels["colour"]["classes"] == list(ss.COLOURS)
    assert labels["shape"]["classes"] == list(ss.SHAPES)
    assert labels["position"]["classes"] == list(ss.POSITIONS)
    assert labels["combo"]["classes"] == sorted(f"{c} {s}" for c, s in ss.combos_for_split(split))
    for label in labels.values():
        assert label["templates"] and all(t.count("{}") == 1 for t in label["templates"])


@pytest.mark.parametrize("split", ss.SPLITS)
def test_prompts_only_use_training_vocabulary(split, train_vocabulary):
    labels = ss.SyntheticShapes(n=1, split=split).info()["labels"]
    for name, label in labels.items():
        for template in label["templates"]:
            for cls in label["classes"]:
                unknown = set(tokens(template.format(cls))) - train_vocabulary
                assert not unknown, (name, template.format(cls), unknown)


def test_combo_meta_matches_combo_classes():
    source = ss.SyntheticShapes(n=50, split="heldout")
    classes = set(source.info()["labels"]["combo"]["classes"])
    assert {s.meta["combo"] for s in source} <= classes


# --- URIs --------------------------------------------------------------------------------------


def test_uri_defaults():
    for uri in ("synthetic://shapes", "synthetic://shapes/", "synthetic://shapes?"):
        source = ss.parse_synthetic_uri(uri)
        assert isinstance(source, ss.SyntheticShapes)
        assert (source.n, source.split, source.seed, source.image_size) == (4096, "train", 0, 32)


def test_uri_query_values():
    source = ss.parse_synthetic_uri("synthetic://shapes?n=100&split=heldout&seed=3&image_size=64")
    assert (source.n, source.split, source.seed, source.image_size) == (100, "heldout", 3, 64)
    assert len(source) == 100


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("synthetic://shapes?colour=red", r"unknown query parameter 'colour'.*n, split, seed, image_size"),
        ("synthetic://shapes?n=ten", "'n' must be an integer"),
        ("synthetic://shapes?n=1&n=2", "more than once"),
        ("synthetic://shapes?split=val", "split must be one of"),
        ("synthetic://shapes?n=0", "n must be >= 1"),
    ],
)
def test_uri_errors(uri, message):
    with pytest.raises(ValueError, match=message):
        ss.parse_synthetic_uri(uri)


@pytest.mark.parametrize(
    "uri",
    ["data/shards", "/tmp/shapes", "file://shapes", "synthetic://digits", "synthetic://shapes/extra", ""],
)
def test_uri_not_ours(uri):
    assert ss.parse_synthetic_uri(uri) is None
