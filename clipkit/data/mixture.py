"""Epochs over streamed sources: a weighted mixture of shard sets (one set is a mixture of one).

Each source gives each of this rank's L lanes an endless record stream: pass k over the source
takes its shards in an order seeded by (seed, epoch, source, k) — with counts, rank r reads the
contiguous range [r·N/W, (r+1)·N/W) of that order (:class:`~clipkit.data.loader.EpochPlan`), and
lane l the l-th of L equal contiguous parts of it; without counts, rank r reads the shards at
positions r, r+W, r+2W, ... and lane l every L-th of those (or, with fewer shards than lanes, every
L-th record of them) — and a new pass starts where the last one ends. Each lane draws each
sample's source with probabilities proportional to the weights, from a generator seeded by
(seed, epoch, rank, lane). Everything is a pure function of the seed, the epoch, the rank and
the number of lanes, so an epoch replays exactly: a resumed run skips the consumed batches'
records without decoding them and continues with the very samples the uninterrupted run would
see. With one lane the streams are those of the rank (the order before lanes existed).

A sample's global index is its source's offset (the sizes of the sources listed before it) plus
its index within the source (:mod:`clipkit.data.shard_sets`).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clipkit.data.epoch_plan import EpochPlan, ReadPolicy, Segment, cut_segments, fault_summary, read_segments
from clipkit.data.shard_sets import ShardSet
from clipkit.data.tar_stream import Meter, ignore
from clipkit.errors import DataError


@dataclass(frozen=True)
class StreamSource:
    """One source of a mixture: its shards, weight, first global index and size (n_i)."""

    shards: ShardSet
    weight: float
    offset: int
    size: int
    name: str


def source_records(
    source: StreamSource,
    *,
    key: str,
    rank: int,
    world_size: int,
    resampled: bool,
    policy: ReadPolicy,
    faults: list,
    lane: int = 0,
    lanes: int = 1,
    meter: Meter = ignore,
) -> Iterator[dict[str, Any]]:
    """Lane ``lane``'s endless records of ``source`` on this rank (passes over its shards, see
    the module docs)."""
    shards = source.shards
    for attempt in itertools.count():
        every = 1  # keep every record of the segments, or every lanes-th (too few shards for the lanes)
        if shards.counts is not None:
            segments = EpochPlan.build(
                shards.entries,
                seed=key,
                epoch=attempt,
                rank=rank,
                world_size=world_size,
                batch_size=1,
                resampled=resampled,
                first_indices=shards.first_indices,
            ).segments
            total = sum(segment.stop - segment.start for segment in segments)
            segments = cut_segments(segments, lane * total // lanes, (lane + 1) * total // lanes)
        else:
            urls = rank_urls(shards.urls, key, attempt, rank, world_size, resampled)
            urls, every = (urls[lane::lanes], 1) if len(urls) >= lanes else (urls, lanes)
            segments = tuple(Segment(url, 0, None) for url in urls)
        records = read_segments(segments, 0.0, policy, faults, meter)
        produced = 0
        for record in itertools.islice(records, lane if every > 1 else 0, None, every):
            produced += 1
            yield record
        if not produced:
            raise DataError(
                f"{shards.shown}: no sample could be read by process {rank} "
                f"({fault_summary(faults) or 'no shards'})"
            )


def rank_urls(urls, key: str, attempt: int, rank: int, world_size: int, resampled: bool) -> list[str]:
    rng = random.Random(f"shards:{key}:{attempt}")
    ordered = rng.choices(list(urls), k=len(urls)) if resampled else rng.sample(list(urls), len(urls))
    return ordered[rank::world_size]


@dataclass(frozen=True)
class MixturePlan:
    """One rank's epoch of a mixture: ``batches`` full batches of samples drawn from ``sources``."""

    sources: tuple[StreamSource, ...]
    batches: int
    seed: int
    epoch: int
    rank: int
    world_size: int
    resampled: bool = False

    def lane_records(
        self, lane: int, lanes: int, batch_size: int, holdout: float, policy: ReadPolicy, faults: list,
        meter_of=None,
    ) -> Iterator[dict[str, Any]]:  # fmt: skip
        """Lane ``lane``'s records (endless; the consumer takes its batches). ``meter_of(i)``: the
        byte meter of source i."""
        del holdout, batch_size  # no held-out split for streamed sets (checked when the run is built)
        streams = [
            source_records(
                source,
                key=f"{self.seed}:{self.epoch}:{i}",
                rank=self.rank,
                world_size=self.world_size,
                resampled=self.resampled,
                policy=policy,
                faults=faults,
                lane=lane,
                lanes=lanes,
                meter=meter_of(i) if meter_of else ignore,
            )
            for i, source in enumerate(self.sources)
        ]
        # One lane: the seed string of the rank's stream before lanes existed (the same order).
        suffix = f":{lane}" if lanes > 1 else ""
        rng = random.Random(f"mixture:{self.seed}:{self.epoch}:{self.rank}{suffix}")
        choices, weights = range(len(self.sources)), [source.weight for source in self.sources]
        try:
            while True:
                i = rng.choices(choices, weights)[0] if len(choices) > 1 else 0
                record = next(streams[i])
                record["__source__"] = i
                record["__index__"] = global_index(record, self.sources[i])
                yield record
        finally:
            for stream in streams:
                stream.close()

    def records(self, holdout: float, policy: ReadPolicy, faults: list) -> Iterator[dict[str, Any]]:
        """The rank's records (one lane)."""
        return self.lane_records(0, 1, 1, holdout, policy, faults)


def global_index(record: dict[str, Any], source: StreamSource) -> int:
    """The record's index in the mixture, or -1 when its source has no counts and its json no
    ``index`` (losses with per-sample state refuse such data; see :mod:`clipkit.data.shard_sets`)."""
    local = record.get("__index__")
    if local is None:
        try:
            local = json.loads(record.get("json", b"{}")).get("index")
        except (ValueError, AttributeError):
            local = None
    if not isinstance(local, int) or isinstance(local, bool):
        return -1
    if not 0 <= local < source.size:
        raise DataError(
            f"{source.name}: sample {record.get('__key__')!r} has index {local}, outside [0, {source.size}) "
            "— data.num_samples is smaller than the shard set; give its true size (or a sizes.json)"
        )
    return source.offset + local


def stream_sources(shards, mixture, num_samples: int, patience) -> tuple[list[StreamSource], int]:
    """The sources of ``data.shards`` (with ``data.num_samples``) or of ``data.mixture``, each
    resolved (a DataError naming a missing path or an unsized source), and the epoch's size."""
    from clipkit.data.shard_sets import MixtureEntry, parse_mixture, resolve, resolve_entry

    entries = parse_mixture(mixture) if mixture is not None else [MixtureEntry(str(shards), 1.0, num_samples)]
    sources, offset = [], 0
    for i, entry in enumerate(entries):
        shard_set = (
            resolve(entry.shards, patience) if mixture is None else resolve_entry(i, entry.shards, patience)
        )
        size = shard_set.num_samples or entry.num_samples
        if not size:
            key = "data.num_samples" if mixture is None else f"data.mixture[{i}].num_samples (the list form)"
            raise DataError(
                f"{shard_set.shown}: no manifest.json or sizes.json beside the shards gives their "
                "sample count; "
                f"set {key} (the samples in the set, as open_clip's train-num-samples)"
            )
        sources.append(StreamSource(shard_set, entry.weight, offset, size, shard_set.shown))
        offset += size
    return sources, (num_samples or offset)
