"""An epoch's reading: the shard segments one process reads (:class:`EpochPlan`), cut into lanes
(:func:`lane_range`) that loader workers read apart, and reading them (:func:`read_segments`)
with the fault policy (:class:`ReadPolicy`): see :mod:`clipkit.data.loader`."""

from __future__ import annotations

import collections
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clipkit.data.remote import Patience, ShardUnavailable, redact
from clipkit.data.tar_stream import Meter, ignore, tar_records
from clipkit.errors import DataError


@dataclass(frozen=True)
class Segment:
    """Samples [start, stop) (positions within the tar) of one shard; ``stop`` None: to its end.
    ``first_index``: the global index of the tar's first sample, when counts give it (streamed
    sets); None: each sample's json ``index`` is its global index (clipkit shard directories).
    ``count``: the shard's samples when known (a segment with ``stop == count`` reads to its end)."""

    url: str
    start: int
    stop: int | None
    first_index: int | None = None
    count: int | None = None

    @property
    def ends_shard(self) -> bool:
        return self.stop is None or (self.count is not None and self.stop >= self.count)


@dataclass(frozen=True)
class ReadPolicy:
    """How shards are read: the network's ``patience`` and ``on_error`` (``skip``: a shard that
    cannot be read is counted by reason and passed over; ``raise``: the run stops, naming it)."""

    patience: Patience = Patience()
    on_error: str = "skip"


class Faults(list):
    """The shards that failed in one epoch: ``(reason, shown URL)`` per shard, in order (what is
    reported), and ``failed``, their URLs: a failed shard is passed over for the rest of the
    epoch, so it is fetched (and waited for) once and reported once per epoch."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.failed: set[str] = set()

    def add(self, reason: str, url: str) -> None:
        if url not in self.failed:
            self.failed.add(url)
            self.append((reason, redact(url)))


def lane_quotas(batches: int, lanes: int) -> list[int]:
    """Full batches of each lane: the epoch's batch j is lane (j mod lanes)'s (j // lanes)-th."""
    return [len(range(lane, batches, lanes)) for lane in range(lanes)]


def lane_range(lane: int, lanes: int, batches: int, batch_size: int, samples: int) -> tuple[int, int]:
    """Lane ``lane``'s contiguous part [start, stop) of a stream of ``samples`` samples giving
    ``batches`` batches: exactly its quota of samples; the last lane also takes the samples left
    over (fewer than a batch and a half), so that with one lane the whole stream is one lane."""
    quotas = lane_quotas(batches, lanes)
    start = sum(quotas[:lane]) * batch_size
    stop = samples if lane == lanes - 1 else start + quotas[lane] * batch_size
    return start, stop


def cut_segments(segments, start: int, stop: int) -> tuple[Segment, ...]:
    """The samples [start, stop) of the concatenated ``segments`` (each with a ``stop``), as
    segments: whole ones kept as they are, the first and last cut at sample boundaries."""
    cut, offset = [], 0
    for segment in segments:
        length = segment.stop - segment.start
        low, high = max(start - offset, 0), min(stop - offset, length)
        if low < high:
            whole = low == 0 and high == length
            cut.append(
                segment
                if whole
                else Segment(
                    segment.url, segment.start + low, segment.start + high, segment.first_index, segment.count
                )  # fmt: skip
            )
        offset += length
    return tuple(cut)


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: shard segments and the number of full batches."""

    segments: tuple[Segment, ...]
    batches: int

    @classmethod
    def build(
        cls, shards, *, seed, epoch, rank, world_size, batch_size, resampled=False, first_indices=None
    ) -> EpochPlan:
        """``shards``: [(url, count)] from the manifest; the plan is a pure function of the arguments.
        ``first_indices`` {url: global index of its first sample} numbers streamed samples."""
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
                segments.append(Segment(url, start, stop, (first_indices or {}).get(url), count))
            offset += count
        # The same count on every rank (from total, not from this rank's range, which may be one
        # sample longer): every rank steps the same number of times per epoch. The samples left
        # over (fewer than a global batch) wait for a later epoch, whose new order leaves out others.
        return cls(tuple(segments), (total // world_size) // batch_size)

    @property
    def samples(self) -> int:
        return sum(segment.stop - segment.start for segment in self.segments)

    def lane_segments(self, lane: int, lanes: int, batch_size: int) -> tuple[Segment, ...]:
        return cut_segments(self.segments, *lane_range(lane, lanes, self.batches, batch_size, self.samples))

    def lane_records(
        self, lane: int, lanes: int, batch_size: int, holdout: float, policy: ReadPolicy, faults: list,
        meter_of=None,
    ) -> Iterator[dict[str, Any]]:  # fmt: skip
        """Lane ``lane``'s records of this epoch (with one lane: the rank's); ``meter_of(0)`` counts
        the bytes (the plan's one source)."""
        own = self.lane_segments(lane, lanes, batch_size)
        return records_refilled(
            own, self.segments, holdout, policy, faults, meter_of(0) if meter_of else ignore
        )

    def records(self, holdout: float, policy: ReadPolicy, faults: list) -> Iterator[dict[str, Any]]:
        """The rank's records of this epoch (one lane)."""
        return self.lane_records(0, 1, 1, holdout, policy, faults)


def records_refilled(own, fallback, holdout: float, policy: ReadPolicy, faults: list, meter: Meter = ignore):
    """The records of segments ``own``; when shards were skipped, the readable segments are read
    again (``fallback``, the rank's, when none of ``own`` could be read) until the consumer has its
    batches, so every rank keeps its batch count."""
    segments = own
    while True:
        produced = yield from read_segments(segments, holdout, policy, faults, meter)
        if not getattr(faults, "failed", faults):  # nothing failed this epoch
            return
        if not produced:
            if segments == fallback or not fallback:
                raise DataError(f"no shard of this epoch could be read ({fault_summary(faults)})")
            segments = fallback


def read_segments(
    segments, holdout: float = 0.0, policy: ReadPolicy | None = None, faults=None, meter: Meter = ignore
):
    """Raw WebDataset records (bytes per field) of each segment, in order; with ``holdout``, the
    positions count the kept samples only (the held-out ones are skipped before slicing). A
    record of a segment with a ``first_index`` carries its global index as ``__index__``. A shard
    that fails is handled by ``policy`` (faults are appended to ``faults``); ``meter`` counts the
    bytes; returns how many records were produced."""
    policy = policy or ReadPolicy()
    faults = faults if faults is not None else Faults()
    produced = 0
    for segment in segments:
        if segment.url in getattr(faults, "failed", ()):
            continue  # failed earlier this epoch: counted once, not fetched again
        # A tar is entered at the segment's first record and left at its last (by the shard's
        # index, or a local tar's headers): the segments of a shard split between lanes share no
        # bytes. Under a holdout the positions count kept samples only: read from the start.
        enter = holdout <= 0
        skip = segment.start if enter else 0
        bound = segment.stop if enter and not segment.ends_shard else None
        records = tar_records(segment.url, policy.patience, meter, skip, bound)
        kept = (r for r in records if not record_held_out(r, holdout)) if holdout > 0 else records
        position = segment.start
        try:
            stop = None if segment.stop is None else segment.stop - skip
            for record in itertools.islice(kept, segment.start - skip, stop):
                if segment.first_index is not None:
                    record["__index__"] = segment.first_index + position
                position += 1
                if position == segment.stop and segment.ends_shard:
                    next(kept, None)  # read the tar's end before the last record goes: all bytes counted
                produced += 1
                yield record
            if segment.stop is not None and position < segment.stop:
                raise ShardUnavailable(
                    segment.url, "short_shard", f"{position} samples, expected {segment.stop}"
                )
        except ShardUnavailable as error:
            if policy.on_error == "raise":
                raise DataError(f"shard {error} (data.on_error: raise)") from None
            if isinstance(faults, Faults):
                faults.add(error.reason, segment.url)  # reported by BatchStream, once per epoch
            else:
                faults.append((error.reason, redact(segment.url)))
        finally:
            records.close()  # stop reading the tar (and close it) past the segment
    return produced


def fault_summary(faults) -> str:
    counts = collections.Counter(reason for reason, _ in faults)
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(counts.items()))


def record_key(json_bytes: bytes, fallback: str) -> str:
    """The source key stored in a record's json (the key the held-out split hashes)."""
    try:
        return str(json.loads(json_bytes).get("key", fallback))
    except (ValueError, AttributeError):
        return fallback


def record_meta(json_bytes: bytes) -> dict[str, Any]:
    """The meta-data stored in a record's json ({} when it has none)."""
    try:
        meta = json.loads(json_bytes).get("meta")
    except (ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def record_held_out(record: dict[str, Any], holdout: float) -> bool:
    """Whether a raw record is in the held-out split ``holdout`` (a fraction, or a
    :class:`clipkit.app.own_data.Holdout` grouped by a column of its meta-data)."""
    from clipkit.app.own_data import holdout_rule

    rule, raw = holdout_rule(holdout), record.get("json", b"{}")
    meta = record_meta(raw) if rule.by else None
    return rule.holds(record_key(raw, record.get("__key__", "")), meta)
