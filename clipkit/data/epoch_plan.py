"""An epoch's reading: the shard segments one process reads (:class:`EpochPlan`), and reading them
(:func:`read_segments`) with the fault policy (:class:`ReadPolicy`): see :mod:`clipkit.data.loader`."""

from __future__ import annotations

import collections
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clipkit.data.remote import Patience, ShardUnavailable, redact
from clipkit.data.tar_stream import tar_records
from clipkit.errors import DataError


@dataclass(frozen=True)
class Segment:
    """Samples [start, stop) (positions within the tar) of one shard; ``stop`` None: to its end.
    ``first_index``: the global index of the tar's first sample, when counts give it (streamed
    sets); None: each sample's json ``index`` is its global index (clipkit shard directories)."""

    url: str
    start: int
    stop: int | None
    first_index: int | None = None


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
                segments.append(Segment(url, start, stop, (first_indices or {}).get(url)))
            offset += count
        # The same count on every rank (from total, not from this rank's range, which may be one
        # sample longer): every rank steps the same number of times per epoch. The samples left
        # over (fewer than a global batch) wait for a later epoch, whose new order leaves out others.
        return cls(tuple(segments), (total // world_size) // batch_size)

    def records(self, holdout: float, policy: ReadPolicy, faults: list) -> Iterator[dict[str, Any]]:
        """The rank's records of this epoch; when shards were skipped, the readable segments are
        read again until the consumer has its batches (so every rank keeps its batch count)."""
        while True:
            produced = yield from read_segments(self.segments, holdout, policy, faults)
            if not getattr(faults, "failed", faults):
                return
            if not produced:
                raise DataError(f"no shard of this epoch could be read ({fault_summary(faults)})")


def read_segments(segments, holdout: float = 0.0, policy: ReadPolicy | None = None, faults=None):
    """Raw WebDataset records (bytes per field) of each segment, in order; with ``holdout``, the
    positions count the kept samples only (the held-out ones are skipped before slicing). A
    record of a segment with a ``first_index`` carries its global index as ``__index__``. A shard
    that fails is handled by ``policy`` (faults are appended to ``faults``); returns how many
    records were produced."""
    policy = policy or ReadPolicy()
    faults = faults if faults is not None else Faults()
    produced = 0
    for segment in segments:
        if segment.url in getattr(faults, "failed", ()):
            continue  # failed earlier this epoch: counted once, not fetched again
        records = tar_records(segment.url, policy.patience)
        kept = (r for r in records if not record_held_out(r, holdout)) if holdout > 0 else records
        position = segment.start
        try:
            for record in itertools.islice(kept, segment.start, segment.stop):
                if segment.first_index is not None:
                    record["__index__"] = segment.first_index + position
                position += 1
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
