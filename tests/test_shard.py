"""Shards: round trip, manifest, atomic writes, the loader's index coverage and exact skipping."""

import json

import pytest
import torch

from clipkit.data import BatchStream, ImageTransform, skipped_by_worker
from clipkit.errors import DataError
from clipkit.plugins.synthetic_shapes import SyntheticShapes
from clipkit.plugins.tokenizers import HashedWordTokenizer
from clipkit.shard import ShardSource, read_manifest, sha256, write_shards
from clipkit.types import Sample

TRANSFORM = ImageTransform(image_size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


@pytest.fixture
def shards(tmp_path):
    source = SyntheticShapes(n=40, seed=3)
    write_shards(
        source,
        tmp_path / "shards",
        source="synthetic://shapes?n=40&seed=3",
        info=source.info(),
        samples_per_shard=16,
    )
    return tmp_path / "shards", source


def test_round_trip_bytes_captions_meta(shards):
    directory, source = shards
    read = list(ShardSource(directory))
    assert len(read) == 40
    for index, (original, copy) in enumerate(zip(source, read, strict=True)):
        assert copy.image == original.image and copy.captions == original.captions
        assert copy.meta == {"index": index, **original.meta}
        assert copy.key == original.key


def test_manifest_counts_and_checksums(shards):
    directory, _ = shards
    manifest = read_manifest(directory)
    assert manifest["n"] == 40 and [s["count"] for s in manifest["shards"]] == [16, 16, 8]
    for shard in manifest["shards"]:
        assert sha256(directory / shard["name"]) == shard["sha256"]
    assert manifest["info"]["labels"]["colour"]["classes"][0] == "red"
    assert {"png", "txt", "json"} <= set(manifest["fields"])


def test_failed_write_leaves_nothing_and_keeps_the_old_set(tmp_path, shards):
    directory, _ = shards
    before = (directory / "manifest.json").read_text()

    def broken():
        yield from SyntheticShapes(n=3)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        write_shards(broken(), directory, source="broken")
    assert (directory / "manifest.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sample_without_caption_names_the_sample(tmp_path):
    sample = Sample(key="row-7", image=b"x", image_ext="png", captions=())
    with pytest.raises(DataError, match="row-7"):
        write_shards([sample], tmp_path / "out", source="test")


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="manifest.json is missing"):
        read_manifest(tmp_path)


def stream(directory, **kwargs):
    options = {
        "batch_size": 8,
        "transform": TRANSFORM,
        "tokenizer": HashedWordTokenizer(64, 16),
        "seed": 0,
        "shuffle_buffer": 10,
    }
    options.update(kwargs)
    return BatchStream(directory, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_index_at_most_once_per_epoch(shards, workers):
    directory, _ = shards
    batches = stream(directory, num_workers=workers)
    seen = []
    iterator = iter(batches)
    while batches.epoch == 0:
        batch = next(iterator)
        if batches.epoch > 0:
            break
        seen += batch["index"].tolist()
        assert batch["image"].shape == (8, 3, 32, 32) and batch["text"].shape == (8, 16)
    assert len(seen) == len(set(seen))
    # Full batches only: each worker drops its incomplete tail batch.
    assert len(seen) >= 40 - 8 * max(1, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_restore_mid_epoch_continues_exactly(shards, workers):
    directory, _ = shards
    reference = stream(directory, num_workers=workers)
    it = iter(reference)
    expected = [next(it) for _ in range(6)]  # crosses into the next epoch
    resumed = stream(directory, num_workers=workers)
    skipped = stream(directory, num_workers=workers)
    it2 = iter(skipped)
    for _ in range(3):
        next(it2)
    resumed.restore(skipped.position())
    got = [batch for batch, _ in zip(resumed, range(3), strict=False)]
    for want, have in zip(expected[3:], got, strict=True):
        assert torch.equal(want["index"], have["index"])
        assert torch.equal(want["image"], have["image"]) and torch.equal(want["text"], have["text"])


def test_worker_skip_arithmetic():
    # global batches 0..4 with 2 workers: worker 0 owns 0, 2, 4; worker 1 owns 1, 3.
    assert [skipped_by_worker(5, w, 2) for w in (0, 1)] == [3, 2]
    assert [skipped_by_worker(0, w, 2) for w in (0, 1)] == [0, 0]
    assert skipped_by_worker(4, 0, 1) == 4


def test_too_few_samples_for_a_batch(shards):
    directory, _ = shards
    with pytest.raises(DataError, match="fewer than one batch"):
        stream(directory, batch_size=41)


def test_manifest_is_json(shards):
    directory, _ = shards
    json.loads((directory / "manifest.json").read_text())


def test_existing_shards_of_another_source_are_refused(shards):
    from clipkit.shard import ensure_shards

    directory, _ = shards
    assert ensure_shards(str(directory), "synthetic://shapes?n=40&seed=3") == directory
    assert ensure_shards(str(directory), "") == directory
    with pytest.raises(DataError, match="holds shards of 'synthetic://shapes\\?n=40&seed=3'"):
        ensure_shards(str(directory), "synthetic://shapes?n=41")
