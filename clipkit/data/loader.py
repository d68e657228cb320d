"""Training batches from shards: an exact epoch plan, split by node, read with WebDataset.

Not passed through ``accelerator.prepare`` (its dispatcher would read rank 0's stream only).
Instead each epoch is planned from the manifest's per-shard counts, identically on every rank:

1. the shards are put in a seeded order (a permutation, or with ``resampled`` a draw with
   replacement), giving one stream of samples;
2. rank r of W takes the contiguous range [r·N/W, (r+1)·N/W) of that stream (so each tar is read
   by at most two ranks), shuffles it with a buffer seeded by (seed, epoch, rank), and cuts it
   into ``(N // W) // B`` full batches — the same count on every rank, so collectives never wait;
3. global batch j of the rank goes to DataLoader worker (j − skip) mod workers. Every worker reads
   the rank's records (tar I/O only) but decodes only its own batches, so the batches — and a
   resumed run — are the same for any number of workers.

Every global index therefore appears at most once per epoch, and exactly once when N is a
multiple of W·B (otherwise fewer than W·B samples, different ones each epoch, wait for the next).
A resumed run skips the batches it already consumed before decoding them.

With ``holdout`` > 0 (``data.holdout``, set by ``clipkit train --data``) the samples of the held-out
split (:func:`clipkit.own_data.is_held_out` of each sample's key) are dropped as the tars are read,
and every count above is of the samples kept (counted once, from the tars' json members).
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from clipkit.errors import DataError
from clipkit.data.shard import decode_record, read_manifest
from clipkit.data.transforms import ImageTransform, decode_transformed

__all__ = ["BatchStream", "EpochDataset", "EpochPlan", "ImageTransform"]


@dataclass(frozen=True)
class Segment:
    """Samples [start, stop) (positions within the tar) of one shard."""

    url: str
    start: int
    stop: int


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: shard segments and the number of full batches."""

    segments: tuple[Segment, ...]
    batches: int

    @classmethod
    def build(cls, shards, *, seed, epoch, rank, world_size, batch_size, resampled=False) -> EpochPlan:
        """``shards``: [(url, count)] from the manifest; the plan is a pure function of the arguments."""
        # Seeded by (seed, epoch) only, never by rank: every rank must compute the *same* shard order,
        # or the contiguous ranges below would overlap or leave gaps between ranks.
        rng = random.Random(f"shards:{seed}:{epoch}")
        if resampled:
            ordered = rng.choices(list(shards), k=len(shards))
        else:
            ordered = list(shards)
            rng.shuffle(ordered)
        total = sum(count for _, count in ordered)
        # Split by samples, not by shards: shards differ in size, so a shard-wise split would give
        # ranks different batch counts and the collectives of the last steps would wait forever.
        # A contiguous range also keeps each tar read by at most two ranks (sequential tar I/O).
        low, high = rank * total // world_size, (rank + 1) * total // world_size
        segments, offset = [], 0
        for url, count in ordered:
            start, stop = max(low - offset, 0), min(high - offset, count)
            if start < stop:
                segments.append(Segment(url, start, stop))
            offset += count
        # The same count on every rank (from total, not from this rank's range, which may be one
        # sample longer): every rank steps the same number of times per epoch. The samples left
        # over (fewer than a global batch) wait for a later epoch, whose new order leaves out others.
        return cls(tuple(segments), (total // world_size) // batch_size)


def read_segments(segments, holdout: float = 0.0) -> Iterator[dict[str, Any]]:
    """Raw WebDataset records (bytes per field) of each segment, in order; with ``holdout``, the
    positions count the kept samples only (the held-out ones are skipped before slicing)."""
    import webdataset as wds

    for segment in segments:
        # Positions count records from the start of the tar, so a segment is reached by reading
        # (not decoding) the records before it: tars have no index to seek with.
        records = wds.tarfile_to_samples()(iter([{"url": segment.url}]))
        kept = (r for r in records if not record_held_out(r, holdout)) if holdout > 0 else records
        try:
            yield from itertools.islice(kept, segment.start, segment.stop)
        finally:
            records.close()  # stop reading the tar (and close it) past the segment


def record_key(json_bytes: bytes, fallback: str) -> str:
    """The source key stored in a record's json (the key the held-out split hashes)."""
    try:
        return str(json.loads(json_bytes).get("key", fallback))
    except (ValueError, AttributeError):
        return fallback


def record_held_out(record: dict[str, Any], holdout: float) -> bool:
    from clipkit.own_data import is_held_out

    return is_held_out(record_key(record.get("json", b"{}"), record.get("__key__", "")), holdout)


@dataclass(frozen=True)
class TrainingSplit:
    """What training sees of a shard set: ``counts`` [(tar path, samples it gives training)] in
    manifest order, and the sorted global indices of the ``held_out`` samples (``data.holdout``)."""

    counts: list[tuple[str, int]]
    held_out: tuple[int, ...] = ()

    @property
    def num_samples(self) -> int:
        return sum(count for _, count in self.counts)

    def position(self, index: int) -> int:
        """A kept sample's global index -> its place among the training samples, so per-sample
        state (NUCLR's ζ, SogCLR's u) is indexed 0 .. num_samples - 1 with a held-out split too."""
        return index - bisect.bisect_left(self.held_out, index)


def training_split(shards, holdout: float = 0.0) -> TrainingSplit:
    """The :class:`TrainingSplit` of ``shards``; with a ``holdout`` each tar's json members are read."""
    manifest = read_manifest(shards)
    counts = [(str(Path(shards) / s["name"]), int(s["count"])) for s in manifest["shards"]]
    if holdout <= 0:
        return TrainingSplit(counts)
    kept_counts, held_out = [], []
    for url, _ in counts:
        kept, held = split_tar(url, holdout)
        kept_counts.append((url, kept))
        held_out += held
    return TrainingSplit(kept_counts, tuple(sorted(held_out)))


def split_tar(url: str, holdout: float) -> tuple[int, list[int]]:
    """(samples of one tar outside the held-out split, global indices of those inside it); reads
    only the json members."""
    import tarfile

    from clipkit.own_data import is_held_out

    kept, held = 0, []
    with tarfile.open(url) as tar:
        for member in tar:
            name, _, field = member.name.partition(".")
            if member.isfile() and field == "json":
                record = tar.extractfile(member).read()
                if is_held_out(record_key(record, name), holdout):
                    held.append(record_index(record, name))
                else:
                    kept += 1
    return kept, held


def record_index(json_bytes: bytes, name: str) -> int:
    try:
        return int(json.loads(json_bytes)["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"{name}: its json has no integer `index` (shards from `clipkit shard` do)") from error


class EpochDataset(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches (a torch IterableDataset over a WebDataset tar reader)."""

    def __init__(
        self,
        plan: EpochPlan,
        *,
        batch_size,
        transform,
        tokenizer,
        seed,
        epoch,
        skip_batches,
        shuffle_buffer,
        views,
        meta_keys=None,
        rank=0,
        holdout=0.0,
        held_out=(),
    ):
        self.plan, self.batch_size, self.transform, self.tokenizer = plan, batch_size, transform, tokenizer
        self.seed, self.epoch, self.skip_batches, self.rank = seed, epoch, skip_batches, rank
        self.shuffle_buffer, self.views = shuffle_buffer, views
        self.meta_keys = dict(meta_keys or {})
        self.holdout, self.positions = holdout, TrainingSplit([], tuple(held_out))

    def record_batches(self) -> Iterator[list[dict[str, Any]]]:
        """The rank's batches of raw records, in order (identical in every worker)."""
        import webdataset as wds

        records = read_segments(self.plan.segments, self.holdout)
        if self.shuffle_buffer > 1:
            # One stream per rank (every worker computes the same); the trailing ":0" keeps the seed
            # string of the earlier per-worker loader, so single-process order is unchanged.
            rng = random.Random(f"samples:{self.seed}:{self.epoch}:{self.rank}:0")
            records = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(records)
        for _ in range(self.plan.batches):
            yield list(itertools.islice(records, self.batch_size))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        # Every worker walks the whole (cheap, undecoded) record stream and keeps every num_workers-th
        # batch: the batch order then depends only on the plan and seeds, never on the worker count,
        # and DataLoader's round-robin over workers hands the batches back in that order. Counting
        # from skip_batches (a resumed run) keeps worker 0 first, as DataLoader expects.
        for position, records in enumerate(self.record_batches()):
            if position >= self.skip_batches and (position - self.skip_batches) % num_workers == worker:
                yield self.collate(records)

    def collate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Decode raw records into a batch: image [B,3,S,S] (and image2 in two-view mode),
        text [B,L] token ids, index [B] places among the training samples (the global indices when
        nothing is held out), meta {name: list}."""
        samples = [decode_record(record, "shards") for record in records]
        # One generator per (sample, epoch), not per worker or batch: a sample's crops and caption
        # are the same whichever worker decodes it and wherever a resumed run restarts.
        rngs = [random.Random(f"aug:{self.seed}:{self.epoch}:{s.meta['index']}") for s in samples]
        # One decode per sample for all its views; each sample's rng draws view 1, view 2, caption.
        transforms = [self.transform] * self.views
        views = [
            decode_transformed(s.image, transforms, rng, f"sample {s.meta['index']} ({s.key})")
            for s, rng in zip(samples, rngs, strict=True)
        ]
        batch: dict[str, Any] = {
            "image": torch.stack([v[0] for v in views]),
            # Places among the training samples (0 .. n-1 also when a held-out split is left out).
            "index": torch.tensor([self.positions.position(int(s.meta["index"])) for s in samples]),
            "meta": batch_meta(samples, self.meta_keys),
        }
        if self.views == 2:
            batch["image2"] = torch.stack([v[1] for v in views])
        if self.tokenizer is not None:
            for sample in samples:
                if not sample.captions:
                    raise DataError(
                        f"sample {sample.meta['index']} ({sample.key}) has no caption, but the recipe has a "
                        "text tower: shard an image-caption source (label-only sets are for evaluation)"
                    )
            # One caption per sample per epoch, chosen reproducibly among the sample's captions.
            batch["text"] = self.tokenizer(
                [rng.choice(s.captions) for s, rng in zip(samples, rngs, strict=True)]
            )
        return batch


def batch_meta(samples, meta_keys: dict[str, str]) -> dict[str, list]:
    """{key: [value per sample]} for every meta-data key of the first sample (but ``index``), plus
    each ``name: source`` of ``meta_keys`` as ``name`` holding the values of ``source``."""
    present = [k for k in samples[0].meta if k != "index"]
    meta = {k: [s.meta.get(k) for s in samples] for k in present}
    for name, source in meta_keys.items():
        if source not in samples[0].meta:
            raise DataError(
                f"data.meta_keys: {name} <- {source!r}, but the shards' meta-data has only {sorted(present)}; "
                f"the loss reads `{name}`: name the column it comes from with data.meta_keys.{name}=COLUMN"
            )
        meta[name] = meta[source]
    return meta


class BatchStream:
    """Endless batches over epochs; ``position`` is saved in checkpoints for exact resume.

    ``rank``/``world_size`` are this process's place in the launch (the trainer passes the
    runtime's; the loader never asks torch.distributed itself); ``resampled`` draws each epoch's
    shards with replacement (the WebDataset "resampled" mode, but seeded); ``holdout`` leaves
    the held-out split out (see the module docs); ``split`` is its :func:`training_split` when the
    caller has it already.
    """

    def __init__(
        self,
        shards,
        *,
        batch_size,
        transform,
        tokenizer,
        seed,
        num_workers=0,
        shuffle_buffer=1000,
        views=1,
        meta_keys=None,
        resampled=False,
        rank=0,
        world_size=1,
        holdout=0.0,
        split=None,
    ):
        self.holdout = float(holdout)
        self.split = split if split is not None else training_split(shards, self.holdout)
        self.shards, self.num_samples = self.split.counts, self.split.num_samples
        self.batch_size, self.transform, self.tokenizer = batch_size, transform, tokenizer
        self.seed, self.num_workers, self.shuffle_buffer = seed, num_workers, shuffle_buffer
        self.views, self.resampled = views, resampled
        self.meta_keys = dict(meta_keys or {})
        self.rank, self.world_size = rank, world_size
        self.epoch, self.batch_in_epoch = 0, 0
        per_rank = self.num_samples // self.world_size
        if per_rank < batch_size:
            raise DataError(
                f"{shards}: {self.num_samples} samples over {self.world_size} process(es) are fewer than "
                f"one batch of {batch_size} each; lower data.batch_size"
            )

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def restore(self, position: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(position["epoch"]), int(position["batch_in_epoch"])

    def plan(self, epoch: int) -> EpochPlan:
        return EpochPlan.build(
            self.shards,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            resampled=self.resampled,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A fresh DataLoader per epoch: the epoch's plan and seeds are baked into its dataset, and
        # (epoch, batch_in_epoch) — what a checkpoint saves — is all a resumed run needs to rebuild it.
        while True:
            produced = False
            for batch in self.loader(self.epoch, self.batch_in_epoch):
                produced = True
                self.batch_in_epoch += 1
                yield batch
            if not produced and self.batch_in_epoch == 0:
                raise DataError(f"epoch {self.epoch} yielded no full batch; lower data.batch_size")
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def loader(self, epoch: int, skip_batches: int):
        dataset = EpochDataset(
            self.plan(epoch),
            batch_size=self.batch_size,
            transform=self.transform,
            tokenizer=self.tokenizer,
            seed=self.seed,
            epoch=epoch,
            skip_batches=skip_batches,
            shuffle_buffer=self.shuffle_buffer,
            views=self.views,
            meta_keys=self.meta_keys,
            rank=self.rank,
            holdout=self.holdout,
            held_out=self.split.held_out,
        )
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.num_workers)
