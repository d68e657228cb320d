"""Shards: round trip, manifest, atomic writes, the loader's index coverage and exact skipping."""

import hashlib
import json

import pytest
import torch

from clipkit.contract.types import Sample
from clipkit.data.loader import BatchStream, EpochPlan, ImageTransform
from clipkit.data.shard import ShardSource, read_manifest, sha256, verify_shards
from clipkit.data.shard_writer import write_shards
from clipkit.errors import DataError
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes
from clipkit.plugins.tokenizers.basic import HashedWordTokenizer

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


def test_failed_write_keeps_the_old_set_and_resumes(tmp_path, shards):
    directory, _ = shards
    before = (directory / "manifest.json").read_text()

    def broken():
        yield from SyntheticShapes(n=40, seed=3)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        write_shards(broken(), directory, source="synthetic://shapes?n=40&seed=3", samples_per_shard=16)
    assert (directory / "manifest.json").read_text() == before
    partial = tmp_path / "shards.partial"
    left = sorted(p.name for p in partial.iterdir())
    assert left == [
        "journal.json",
        "shard-000000.tar",
        "shard-000000.tar.idx",
        "shard-000001.tar",
        "shard-000001.tar.idx",
        "shard-000002.tar.tmp",
    ]
    # The rerun continues from the journal (2 finished shards) and ends with the same bytes.
    source = "synthetic://shapes?n=40&seed=3"
    manifest = write_shards(SyntheticShapes(n=40, seed=3), directory, source=source, samples_per_shard=16)
    assert not partial.exists()
    assert verify_shards(directory)["problems"] == []
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in json.loads(before)["shards"]]


def test_sample_without_caption_is_stored_without_txt(tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    sample = Sample(key="row-7", image=buffer.getvalue(), image_ext="png", captions=(), meta={"label": 3})
    manifest = write_shards([sample], tmp_path / "out", source="test")
    assert manifest["fields"] == ["json", "png"]
    (read,) = ShardSource(tmp_path / "out")
    assert read.captions == () and read.meta == {"index": 0, "label": 3}


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


def epoch_indices(directory, *, workers, rank=0, world_size=1, epoch=0, **kwargs) -> list[list[int]]:
    """The global indices of each batch rank ``rank`` sees in ``epoch``."""
    batches = stream(directory, num_workers=workers, rank=rank, world_size=world_size, **kwargs)
    batches.restore({"epoch": epoch, "batch_in_epoch": 0})
    return [batch["index"].tolist() for batch in batches.loader(epoch, 0)]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_index_exactly_once_per_epoch(shards, workers, world_size):
    # 40 samples in shards of 16, 16, 8; batch 4 and 2 ranks: 40 is a multiple of 2 x 4.
    directory, _ = shards
    seen = []
    for rank in range(world_size):
        batches = epoch_indices(directory, workers=workers, rank=rank, world_size=world_size, batch_size=4)
        assert len(batches) == 40 // world_size // 4  # the same on every rank
        seen += [index for batch in batches for index in batch]
    assert sorted(seen) == list(range(40))


@pytest.mark.parametrize("world_size", [1, 2])
def test_batches_do_not_depend_on_the_number_of_workers(shards, world_size):
    directory, _ = shards
    for rank in range(world_size):
        one = epoch_indices(directory, workers=0, rank=rank, world_size=world_size, epoch=1)
        two = epoch_indices(directory, workers=2, rank=rank, world_size=world_size, epoch=1)
        assert one == two and len(one) == 40 // world_size // 8


def test_epochs_differ_and_drop_fewer_than_world_times_batch(shards):
    directory, _ = shards
    # batch 8 on 3 ranks: 13 samples per rank, one batch each, 16 of 40 dropped (< 3 x 8).
    epochs = []
    for epoch in range(2):
        seen = [i for r in range(3) for b in epoch_indices(directory, workers=0, rank=r, world_size=3,
                                                           epoch=epoch) for i in b]  # fmt: skip
        assert len(seen) == len(set(seen)) == 24
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_plan_splits_the_epoch_stream_into_contiguous_rank_ranges():
    shards = [("a", 10), ("b", 10), ("c", 5)]
    plans = [EpochPlan.build(shards, seed=0, epoch=0, rank=r, world_size=2, batch_size=4) for r in range(2)]
    lengths = [sum(s.stop - s.start for s in plan.segments) for plan in plans]
    assert lengths == [12, 13] and [plan.batches for plan in plans] == [3, 3]
    # Each shard is covered exactly once by the two ranks together.
    covered = {}
    for plan in plans:
        for segment in plan.segments:
            covered.setdefault(segment.url, []).extend(range(segment.start, segment.stop))
    assert {url: sorted(rows) for url, rows in covered.items()} == {u: list(range(c)) for u, c in shards}


def test_resampled_epochs_draw_shards_with_replacement_reproducibly():
    shards = [(f"s{i}", 10) for i in range(8)]
    plans = [EpochPlan.build(shards, seed=1, epoch=e, rank=0, world_size=1, batch_size=5, resampled=True)
             for e in range(6)]  # fmt: skip
    urls = [[s.url for s in plan.segments] for plan in plans]
    assert any(len(set(u)) < len(u) for u in urls)  # some shard drawn twice in an epoch
    again = EpochPlan.build(shards, seed=1, epoch=3, rank=0, world_size=1, batch_size=5, resampled=True)
    assert again == plans[3]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_restore_mid_epoch_continues_exactly(shards, workers, world_size):
    directory, _ = shards
    for rank in range(world_size):
        options = {"num_workers": workers, "rank": rank, "world_size": world_size, "batch_size": 4}
        reference = stream(directory, **options)
        it = iter(reference)
        expected = [next(it) for _ in range(7)]  # crosses into the next epoch when world_size == 2
        skipped = stream(directory, **options)
        it2 = iter(skipped)
        for _ in range(3):
            next(it2)
        resumed = stream(directory, **{**options, "num_workers": 2 - workers})  # other worker count
        resumed.restore(skipped.position())
        got = [batch for batch, _ in zip(resumed, range(4), strict=False)]
        for want, have in zip(expected[3:], got, strict=True):
            assert torch.equal(want["index"], have["index"])
            assert torch.equal(want["image"], have["image"]) and torch.equal(want["text"], have["text"])


def test_too_few_samples_for_a_batch(shards):
    directory, _ = shards
    with pytest.raises(DataError, match="fewer than one batch"):
        stream(directory, batch_size=41)
    with pytest.raises(DataError, match="40 samples over 2 process"):
        stream(directory, batch_size=21, world_size=2, rank=0)


def test_manifest_describes_the_shards_on_disk(shards):
    directory, _ = shards
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["n"] == 40 == sum(shard["count"] for shard in manifest["shards"])
    for shard in manifest["shards"]:
        path = directory / shard["name"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"], shard["name"]


def test_existing_shards_of_another_source_are_refused(shards):
    from clipkit.data.shard_writer import ensure_shards

    directory, _ = shards
    assert ensure_shards(str(directory), "synthetic://shapes?n=40&seed=3") == directory
    assert ensure_shards(str(directory), "") == directory
    with pytest.raises(DataError, match="holds shards of 'synthetic://shapes\\?n=40&seed=3'"):
        ensure_shards(str(directory), "synthetic://shapes?n=41")
