"""Training batches from shards: an exact epoch plan, split by node, read with WebDataset.

Not passed through ``accelerator.prepare`` (its dispatcher would read rank 0's stream only).
Instead each epoch is planned from the manifest's per-shard counts, identically on every rank:

1. the shards are put in a seeded order (a permutation, or with ``resampled`` a draw with
   replacement), giving one stream of samples;
2. rank r of W takes the contiguous range [r·N/W, (r+1)·N/W) of that stream (so each tar is read
   by at most two ranks) and makes ``K = (N // W) // B`` full batches of it — the same count on
   every rank, so collectives never wait;
3. the range is cut into L lanes, contiguous parts holding exactly the samples of their batches:
   batch j is lane (j mod L)'s (:func:`~clipkit.data.epoch_plan.lane_range`; cuts fall between
   tar members). Each lane is shuffled with a buffer seeded by (seed, epoch, rank, lane);
4. batch j goes to DataLoader worker (j − skip) mod workers, which reads only the lanes of its
   batches: with the workers dividing L, every byte is read once per epoch. L is the number of
   workers the run started with, saved in the position, so the batches — and a resumed run —
   are the same for any number of workers; with one lane this is the loader from before lanes.

Every global index therefore appears at most once per epoch, and exactly once when N is a
multiple of W·B (otherwise fewer than W·B samples, different ones each epoch, wait for the next).
A resumed run skips the batches it already consumed before decoding them.

With ``holdout`` > 0 (``data.holdout``, set by ``clipkit train --data``) the samples of the held-out
split (:func:`clipkit.app.own_data.is_held_out` of each sample's key) are dropped as the tars are read,
and every count above is of the samples kept (counted once, from the tars' json members).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import math
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from clipkit.data.captions import draw_caption_index
from clipkit.data.epoch_plan import (
    EpochPlan,
    Faults,
    ReadPolicy,
    Segment,
    lane_quotas,
    read_segments,
    record_key,
    record_meta,
)
from clipkit.data.remote import redact
from clipkit.data.shard import decode_record, read_manifest
from clipkit.data.tar_stream import Traffic
from clipkit.data.teacher_shards import DistillInputs, stored_view
from clipkit.data.transforms import ImageTransform, decode_transformed
from clipkit.errors import ClipkitError, DataError

__all__ = [
    "BatchStream",
    "EpochDataset",
    "EpochPlan",
    "ImageTransform",
    "ReadPolicy",
    "Segment",
    "read_segments",
]


#: The key of the marker batch that carries a loader error to the main process (see EpochDataset).
WORKER_ERROR = "__clipkit_error__"


def raise_worker_error(batch: dict[str, Any]) -> None:
    """Raise the error a marker batch carries, as the class and message it was raised with."""
    cls, message = batch[WORKER_ERROR]
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    raise error


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


def is_clipkit_directory(shards) -> bool:
    from clipkit.data.shard_sets import is_streamed

    return not is_streamed(str(shards)) and (Path(shards) / "manifest.json").is_file()


def training_split(shards, holdout: float = 0.0) -> TrainingSplit:
    """The :class:`TrainingSplit` of ``shards``; with a ``holdout`` (a fraction, or a
    :class:`clipkit.app.own_data.Holdout` grouped by a column) each tar's json members are read."""
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

    from clipkit.app.own_data import holdout_rule

    kept, held, rule = 0, [], holdout_rule(holdout)
    try:
        with tarfile.open(url) as tar:
            for member in tar:
                name, _, field = member.name.partition(".")
                if member.isfile() and field == "json":
                    record = tar.extractfile(member).read()
                    if rule.holds(record_key(record, name), record_meta(record)):
                        held.append(record_index(record, name))
                    else:
                        kept += 1
    except (tarfile.TarError, OSError, EOFError) as error:
        # As the loader does with a damaged or missing shard (it skips what it cannot read, counted
        # as corrupt_tar / unreachable): the samples read before the damage are split, the rest lost.
        import logging

        logging.getLogger("clipkit.data").warning(
            "%s: cannot be read whole (%s: %s); its %d sample(s) before the damage are used, the rest "
            "skipped — `clipkit shard --verify %s` checks the set",
            url, type(error).__name__, error, kept + len(held), Path(url).parent,
        )  # fmt: skip
    return kept, held


def sample_name(record: dict[str, Any], sample) -> str:
    """How an error names a sample: its global index (clipkit shards), key and shard; a shard set
    made elsewhere (no index) is read as it is, so the message says how to check it."""
    shard = record.get("__url__")
    where = f" in {redact(str(shard))}" if shard else ""
    index = sample.meta.get("index")
    if index is not None:
        return f"sample {index} ({sample.key}){where}"
    return (
        f"sample {sample.key!r}{where} (a shard set not written by `clipkit shard` is read as it is; "
        "`clipkit shard webdataset:DIR OUT` copies it with bad samples skipped and counted)"
    )


def record_index(json_bytes: bytes, name: str) -> int:
    try:
        return int(json.loads(json_bytes)["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{name}: its json has no integer `index` (shards from `clipkit shard` do)"
        ) from error


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
        policy=None,
        require_index=False,
        lanes=1,
        distill=None,
    ):
        self.distill = distill or DistillInputs()
        self.plan, self.batch_size, self.transform, self.tokenizer = plan, batch_size, transform, tokenizer
        self.seed, self.epoch, self.skip_batches, self.rank = seed, epoch, skip_batches, rank
        self.shuffle_buffer, self.views = shuffle_buffer, views
        self.meta_keys = dict(meta_keys or {})
        self.holdout, self.positions = holdout, TrainingSplit([], tuple(held_out))
        self.policy, self.require_index = policy or ReadPolicy(), require_index
        self.lanes = max(1, int(lanes))

    def lane_batches(self, lane: int, traffic: Traffic) -> Iterator[tuple[list[dict[str, Any]], list]]:
        """Lane ``lane``'s batches of raw records, in order, each with the shard faults met while
        it was filled (the lane's quota of batches; with one lane, the rank's)."""
        import webdataset as wds

        faults = Faults()  # this lane's failed shards this epoch (each fetched and reported once)
        records = self.plan.lane_records(
            lane, self.lanes, self.batch_size, self.holdout, self.policy, faults, traffic.meter
        )
        if self.shuffle_buffer > 1:
            # One stream per (rank, lane), the same in every worker reading the lane; with one lane
            # the seed string is the rank's of the loader before lanes ("…:0": its worker 0).
            rng = random.Random(f"samples:{self.seed}:{self.epoch}:{self.rank}:{lane}")
            records = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(records)
        reported = 0
        for _ in range(lane_quotas(self.plan.batches, self.lanes)[lane]):
            batch = list(itertools.islice(records, self.batch_size))
            met, reported = faults[reported:], len(faults)
            yield batch, met

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # The one error boundary of the loader: a user-facing error raised here — in a worker
        # process or not — travels to the main process as a marker batch and is raised there as
        # the same error with the same one line (torch would wrap it in "Caught DataError in
        # DataLoader worker process 0" and the worker's traceback).
        try:
            yield from self.batches()
        except ClipkitError as error:
            yield {WORKER_ERROR: (type(error), str(error))}

    def batches(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        # Batch j of the epoch is lane (j mod L)'s, and DataLoader takes batch j from worker
        # (j - skip) mod W (round robin, counting from the resumed position). So worker w needs the
        # lanes congruent to skip + w modulo gcd(W, L): with W dividing L each lane is read by one
        # worker (every byte once); otherwise W / gcd workers read each lane and decode only their
        # own batches. Either way the batches depend on the plan, the seeds and L, never on W.
        sharing = math.gcd(num_workers, self.lanes)
        group = (self.skip_batches + worker) % sharing
        traffic = Traffic()
        lanes = {
            lane: self.lane_batches(lane, traffic) for lane in range(self.lanes) if lane % sharing == group
        }
        mine = range(self.skip_batches + worker, self.plan.batches, num_workers)
        for position in range(mine[-1] + 1 if mine else 0):  # nothing is read past this worker's last batch
            lane = position % self.lanes
            if lane not in lanes:
                continue
            records, faults = next(lanes[lane])
            if len(records) < self.batch_size:
                return  # an unreadable shard cut the epoch short (already counted)
            # A lane's faults are reported once, with the batch being filled, by its worker.
            if position in mine:
                batch = self.collate(records)
                batch["data_stats"] = {
                    "sources": source_counts(records),
                    "faults": faults,
                    "bytes": traffic.take(),
                }
                yield batch

    def collate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Decode raw records into a batch: image [B,3,S,S] (and image2 in two-view mode),
        text [B,L] token ids, index [B] places among the training samples (the global indices when
        nothing is held out), meta {name: list}."""
        samples = [decode_record(record, "shards") for record in records]
        indices = [self.sample_index(record, sample) for record, sample in zip(records, samples, strict=True)]
        sample_ids = [augment_id(record, sample) for record, sample in zip(records, samples, strict=True)]
        stored = self.stored_views(records, samples) if self.distill.stored else None
        # One generator per (sample, epoch), not per worker or batch: a sample's crops are the same
        # whichever worker decodes it and wherever a resumed run restarts. Stored teacher views
        # replay the seed their embedding was made with (clipkit.data.teacher_shards).
        seeds = [view.seed for view in stored] if stored else [
            f"aug:{self.seed}:{self.epoch}:{sample_id}" for sample_id in sample_ids
        ]  # fmt: skip
        rngs = [random.Random(seed) for seed in seeds]
        # One decode per sample for all its views; each sample's rng draws view 1, then view 2.
        transforms = [self.transform] * self.views
        views = [
            decode_transformed(s.image, transforms, rng, sample_name(record, s))
            for record, s, rng in zip(records, samples, rngs, strict=True)
        ]
        batch: dict[str, Any] = {
            "image": torch.stack([v[0] for v in views]),
            # Places among the training samples (0 .. n-1 also when a held-out split is left out).
            "index": torch.tensor(indices),
            "meta": batch_meta(samples, self.meta_keys),
        }
        if self.views == 2:
            batch["image2"] = torch.stack([v[1] for v in views])
        if self.tokenizer is not None:
            for record, sample in zip(records, samples, strict=True):
                if not sample.captions:
                    raise DataError(
                        f"{sample_name(record, sample)} has no caption, but the recipe has a text tower: "
                        "shard an image-caption source (label-only sets are for evaluation)"
                    )
            # One caption per sample per epoch: a pure function of (seed, epoch, the sample's id: its
            # global index for clipkit shards), never of the augmentation, worker or rank.
            drawn = [
                draw_caption_index(len(s.captions), seed=self.seed, epoch=self.epoch, index=sample_id)
                for s, sample_id in zip(samples, sample_ids, strict=True)
            ]
            captions = [s.captions[i] for s, i in zip(samples, drawn, strict=True)]
            batch["text"] = self.tokenizer(captions)
            if self.distill.tokenizer is not None:  # a live teacher with its own vocabulary
                batch["teacher_tokens"] = self.distill.tokenizer(captions)
            if stored:
                batch.update(stored_embeddings(stored, drawn, samples))
        return batch

    def stored_views(self, records: list[dict[str, Any]], samples) -> list:
        """Each sample's stored teacher view for this epoch (``train.distill.stored``)."""
        return [
            stored_view(record, self.epoch, f"sample {s.meta.get('index')} ({s.key})")
            for record, s in zip(records, samples, strict=True)
        ]

    def sample_index(self, record: dict[str, Any], sample) -> int:
        """The sample's place among the training samples (``__index__`` when the stream numbered
        it, else its json index less the held-out ones before it); -1 when it has none."""
        index = record.get("__index__")
        if index is None:
            index = (
                -1 if sample.meta.get("index") is None else self.positions.position(int(sample.meta["index"]))
            )
        if index < 0 and self.require_index:
            raise DataError(
                f"sample {sample.key!r} of {redact(record.get('__url__', '?'))} has no global "
                "index, which the "
                "loss's per-sample state needs: serve a sizes.json or manifest.json beside the shards "
                "(or use clipkit shards, whose json carries the index)"
            )
        return index


def stored_embeddings(stored: list, drawn: list[int], samples) -> dict[str, torch.Tensor]:
    """The batch's stored teacher embeddings: ``teacher_image`` [B, d] (this epoch's view) and
    ``teacher_text`` [B, d] (the caption each sample was drawn)."""
    import numpy as np

    texts = []
    for view, caption, sample in zip(stored, drawn, samples, strict=True):
        if view.texts.shape[0] != len(sample.captions):
            raise DataError(
                f"sample {sample.meta.get('index')} ({sample.key}): {view.texts.shape[0]} stored text "
                f"embeddings for {len(sample.captions)} captions; re-shard with --teacher"
            )
        texts.append(view.texts[caption])
    try:
        images, texts = np.stack([view.image for view in stored]), np.stack(texts)
    except ValueError:  # rows of different widths: samples of another teacher mixed in
        widths = sorted({view.image.shape[0] for view in stored} | {text.shape[0] for text in texts})
        keys = ", ".join(str(sample.key) for sample in samples[:3])
        raise DataError(
            f"stored teacher embeddings of widths {widths} in one batch (samples {keys}, ...): the shards "
            "were made with different teachers; re-shard with one --teacher"
        ) from None
    return {"teacher_image": torch.from_numpy(images), "teacher_text": torch.from_numpy(texts)}


def metric_label(position: int, name: str) -> str:
    """A tracker-safe metric name for source ``position`` shown as ``name`` (a path or URL):
    trackers treat metric names as file paths (MLflow refuses ``//``, ``:`` or ``..`` in them), so
    only letters, digits, ``_ . -`` are kept, after the source's position in the list."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")
    return f"{position}-{label[-60:]}" if label else str(position)


def source_counts(records) -> dict[int, int]:
    return dict(collections.Counter(int(record.get("__source__", 0)) for record in records))


def augment_id(record: dict[str, Any], sample) -> str:
    """What seeds a sample's augmentation: its json index (clipkit shards; as before streaming),
    else its global index, else its shard and key."""
    if sample.meta.get("index") is not None:
        return str(sample.meta["index"])
    if record.get("__index__", -1) >= 0:
        return str(record["__index__"])
    return f"{redact(record.get('__url__', ''))}#{record.get('__key__')}"


def batch_meta(samples, meta_keys: dict[str, str]) -> dict[str, list]:
    """{key: [value per sample]} for every meta-data key of the first sample (but ``index``), plus
    each ``name: source`` of ``meta_keys`` as ``name`` holding the values of ``source``."""
    present = [k for k in samples[0].meta if k != "index"]
    meta = {k: [s.meta.get(k) for s in samples] for k in present}
    for name, source in meta_keys.items():
        if source not in samples[0].meta:
            raise DataError(
                f"data.meta_keys: {name} <- {source!r}, but the shards' meta-data has only "
                f"{sorted(present)}; "
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
    caller has it already; ``lanes`` (default: one per loader worker) is replaced by the saved
    position's on :meth:`restore`.
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
        mixture=None,
        num_samples=0,
        policy=None,
        require_index=False,
        lanes=None,
        distill=None,
    ):
        self.distill = distill  # DistillInputs: stored teacher embeddings / teacher tokens per batch
        # Lanes: the parts of each epoch the loader workers read apart (module docs); they shape
        # the order, so a run keeps the number it started with (saved with its position).
        self.lanes = max(1, int(num_workers)) if lanes is None else max(1, int(lanes))
        from clipkit.app.own_data import holdout_rule

        self.holdout, self.policy = holdout_rule(holdout), policy or ReadPolicy()
        self.require_index = require_index
        self.batch_size, self.transform, self.tokenizer = batch_size, transform, tokenizer
        self.seed, self.num_workers, self.shuffle_buffer = seed, num_workers, shuffle_buffer
        self.views, self.resampled = views, resampled
        self.meta_keys = dict(meta_keys or {})
        self.rank, self.world_size = rank, world_size
        self.epoch, self.batch_in_epoch = 0, 0
        self.sources, self.first_indices, self.source_names = None, None, [redact(str(shards))]
        self.samples_seen: collections.Counter = collections.Counter()
        self.shards_skipped: collections.Counter = collections.Counter()
        # Bytes the tar readers took and fetched per source name since this process started (not
        # saved: a resumed run reads the consumed part of its epoch again, and that is traffic too).
        self.bytes_read: collections.Counter = collections.Counter()
        self.bytes_fetched: collections.Counter = collections.Counter()
        self.told_sharing = False
        if mixture is None and (split is not None or is_clipkit_directory(shards)):
            self.split = split if split is not None else training_split(shards, self.holdout)
            self.shards, self.num_samples = self.split.counts, self.split.num_samples
        else:
            self.init_streamed(shards, mixture, int(num_samples or 0))
        per_rank = self.num_samples // self.world_size
        if per_rank < batch_size:
            raise DataError(
                f"{self.source_names[0] if len(self.source_names) == 1 else 'data.mixture'}: "
                f"{self.num_samples} "
                f"samples over {self.world_size} process(es) are fewer than one batch of {batch_size} each; "
                "lower data.batch_size"
            )

    def init_streamed(self, shards, mixture, num_samples: int) -> None:
        """A streamed set or a mixture: a counted single set is planned like a shard directory
        (its samples numbered from the counts); anything else is drawn by a MixturePlan."""
        from clipkit.data.mixture import stream_sources

        if self.holdout > 0:
            raise DataError(
                "data.holdout works on clipkit shard directories only; evaluate streamed data "
                "with --eval-data"
            )
        sources, total = stream_sources(shards, mixture, num_samples, self.policy.patience)
        self.split = TrainingSplit([])
        self.source_names = [source.name for source in sources]
        self.num_samples = total
        counted = sources[0].shards.counts is not None
        if mixture is None and counted and (not num_samples or num_samples == sources[0].size):
            self.shards, self.first_indices = sources[0].shards.entries, sources[0].shards.first_indices
        else:
            self.sources = tuple(sources)
            if any(len(s.shards.urls) < self.world_size and s.shards.counts is None for s in sources):
                raise DataError(
                    f"{self.source_names}: a source without counts needs at least one shard per process "
                    f"({self.world_size}); serve a sizes.json beside the shards, or use fewer processes"
                )

    def position(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples_seen": dict(self.samples_seen),
            "shards_skipped": dict(self.shards_skipped),
            "lanes": self.lanes,
        }

    def restore(self, position: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(position["epoch"]), int(position["batch_in_epoch"])
        self.samples_seen = collections.Counter(position.get("samples_seen") or {})
        self.shards_skipped = collections.Counter(position.get("shards_skipped") or {})
        # A position saved before lanes existed was read as one stream: one lane replays it exactly.
        self.lanes = max(1, int(position.get("lanes", 1)))

    def metrics(self) -> dict[str, float]:
        """Samples this process took from each source, and shards it skipped by reason, so far;
        bytes its tar readers read and fetched per source since it started."""
        found = {}
        for kind, counter in (("samples", self.samples_seen), ("bytes_read", self.bytes_read),
                              ("bytes_fetched", self.bytes_fetched)):  # fmt: skip
            found.update(
                {
                    f"data/{kind}/{metric_label(self.source_names.index(name), name)}": float(count)
                    for name, count in counter.items()
                    if name in self.source_names
                }
            )
        found.update(
            {f"data/skipped/{reason}": float(count) for reason, count in self.shards_skipped.items()}
        )
        return found

    def plan(self, epoch: int):
        if self.sources is not None:
            from clipkit.data.mixture import MixturePlan

            batches = (self.num_samples // self.world_size) // self.batch_size
            return MixturePlan(
                self.sources, batches, self.seed, epoch, self.rank, self.world_size, self.resampled
            )
        return EpochPlan.build(
            self.shards,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            resampled=self.resampled,
            first_indices=self.first_indices,
        )

    def count(self, stats: dict[str, Any]) -> None:
        for source, number in stats["sources"].items():
            self.samples_seen[self.source_names[source]] += number
        for source, traffic in stats.get("bytes", {}).items():
            self.bytes_read[self.source_names[source]] += traffic["read"]
            self.bytes_fetched[self.source_names[source]] += traffic["fetched"]
        for reason, url in stats["faults"]:
            self.shards_skipped[reason] += 1
            print(f"data: skipped shard {url} ({reason})", file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A fresh DataLoader per epoch: the epoch's plan and seeds are baked into its dataset, and
        # (epoch, batch_in_epoch) — what a checkpoint saves — is all a resumed run needs to rebuild it.
        while True:
            produced = False
            for batch in self.loader(self.epoch, self.batch_in_epoch):
                if WORKER_ERROR in batch:
                    raise_worker_error(batch)
                produced = True
                self.count(batch.pop("data_stats"))
                self.batch_in_epoch += 1
                yield batch
            if not produced and self.batch_in_epoch == 0:
                raise DataError(f"epoch {self.epoch} yielded no full batch; lower data.batch_size")
            self.announce_epoch()
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def announce_epoch(self) -> None:
        """Once per epoch on process 0 of a mixture or a run that skipped shards: what it read."""
        if self.rank != 0 or (self.sources is None or len(self.sources) < 2) and not self.shards_skipped:
            return
        taken = ", ".join(f"{name}: {count}" for name, count in self.samples_seen.items())
        skipped = ", ".join(f"{reason}: {count}" for reason, count in self.shards_skipped.items()) or "none"
        print(f"data: after epoch {self.epoch}, samples per source {{{taken}}}, shards skipped {{{skipped}}}",
              file=sys.stderr, flush=True)  # fmt: skip

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
            policy=self.policy,
            require_index=self.require_index,
            lanes=self.lanes,
            distill=self.distill,
        )
        self.tell_sharing()
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.num_workers)

    def tell_sharing(self) -> None:
        """Once, on process 0: when the workers do not divide the lanes, some read a lane together."""
        workers = max(1, self.num_workers)
        times = workers // math.gcd(workers, self.lanes)
        if times > 1 and self.rank == 0 and not self.told_sharing:
            print(
                f"data: {workers} loader workers over {self.lanes} lane(s) (the number the run started "
                f"with): each byte is read {times} times; data.num_workers={self.lanes} reads it once",
                file=sys.stderr,
                flush=True,
            )
        self.told_sharing = True
