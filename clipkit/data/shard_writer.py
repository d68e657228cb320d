"""Writing shard sets: resumable after any interruption (kill -9 included), atomic when complete.

Layout while writing ``OUT``: a sibling directory ``OUT.partial/`` holds the finished shards
``shard-NNNNNN.tar``, at most one shard being written (``*.tar.tmp``) and ``journal.json``, which
lists every finished shard (name, count, sha256, first global index) with the source's position
after its last sample. A shard is finished in this order: close → fsync → rename → journal
(written atomically). After a crash anywhere, the journal therefore names exactly the shards that
are complete; anything else in ``OUT.partial/`` is deleted and rewritten.

Rerunning with the same source and settings continues: the source restores its position (its
``state()``/``restore()``, as :class:`clipkit.plugins.sources.file_sources.FileSource` has) or, for a source
without them, the samples already written are skipped (re-read, not re-written). Global indices
continue from the journal, so the finished set has every index in [0, n) exactly once. The tar
members carry a fixed mtime, so an interrupted-then-resumed run writes byte-identical shards to an
uninterrupted one. When the source is exhausted, ``manifest.json`` is written (the commit point), then
``OUT.partial`` is renamed to ``OUT`` (an existing ``OUT`` is swapped out only then), then the journal
is removed; a run killed between these steps is finished by the next one without re-reading the source.

Beside each shard, ``shard-NNNNNN.tar.idx`` gives every record's byte offset
(:mod:`clipkit.data.tar_index`): written durably before the shard is renamed into place, so a
finished shard has its index; a loader lane that starts or ends inside a shard reads its own bytes
only with it (also over HTTP and fsspec).

Each sample is stored under key = its global index (zero-padded, 9 digits) with fields
``<image_ext>`` (the image bytes as given), ``txt`` (the first caption, when there is one) and
``json`` (``{"index", "key", "captions", "meta"}``), plus the extra members of an annotated sample
(``clipkit shard --teacher``'s embeddings, :mod:`clipkit.data.teacher_shards`).

Samples written without a caption (label-only ones, which evaluation sets are made of) are counted
in the manifest's ``info.uncaptioned`` with the first as ``info.uncaptioned_example``; where some
samples have captions and some not, the command says so (:func:`uncaptioned_line`): a text tower
cannot train on such a set, and would otherwise only stop at the first such sample mid-training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from clipkit.artifacts.io import (
    OVERWRITE_REMEDY,
    Kept,
    OutputKind,
    atomic_write_text,
    claim_output_directory,
    fsync_directory,
    replace_directory,
    writing,
)
from clipkit.contract.types import Sample
from clipkit.data.shard import MANIFEST, SHARD_PATTERN, build_manifest, open_source, read_manifest, sha256
from clipkit.data.shard_lock import output_lock
from clipkit.data.tar_index import index_path, write_index
from clipkit.errors import ClipkitError, DataError

JOURNAL = "journal.json"
JOURNAL_FORMAT = "clipkit-shard-journal/1"
#: The manifest ``info`` keys counting samples written without a caption.
UNCAPTIONED_KEYS = ("uncaptioned", "uncaptioned_example")
#: Tar member mtime: fixed so shards are reproducible byte for byte (and resumable ones identical);
#: an int, since a float makes tarfile write a 1 KiB PAX header before every member.
MEMBER_MTIME = 0
#: A finished shard set (``OUT``) and an interrupted one (``OUT.partial``): the files clipkit writes
#: there. A directory holding anything else is refused unless ``overwrite`` (see
#: :func:`clipkit.artifacts.io.claim_output_directory`).
SHARD_FILES = ("shard-*.tar", "shard-*.tar.idx", MANIFEST, JOURNAL)
SHARD_OUTPUT = OutputKind("shard set", SHARD_FILES, marker=MANIFEST)
PARTIAL_OUTPUT = OutputKind("shard set", (*SHARD_FILES, "shard-*.tar.tmp", "shard-*.tar.idx.tmp"))
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int | None) -> int | None:
    """``"500MB"``, ``"1GiB"``, ``"4096"`` or an int -> bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    stripped = str(text).strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number) :]
    try:
        if unit not in UNITS:
            raise ValueError
        return int(float(number) * UNITS[unit])
    except ValueError:
        raise ClipkitError(f"cannot read the size {text!r}: use e.g. 500MB, 1GiB or bytes") from None


def skip_summary(info: dict[str, Any]) -> str:
    """`` (every row skipped: 3 empty_caption, ...; -o strict=true stops at the first with its
    reason)`` from a source's ``info()["skipped"]``, or "" when nothing was skipped."""
    skipped = info.get("skipped") or {}
    if not skipped:
        return ""
    counts = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
    return f" (every row skipped: {counts}; -o strict=true stops at the first one, naming it)"


def partial_directory(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".partial")


def encode_sample(sample: Sample, index: int) -> dict[str, Any]:
    """A :class:`Sample` -> the WebDataset record stored under global ``index``."""
    record: dict[str, Any] = {
        "__key__": f"{index:09d}",
        sample.image_ext: sample.image,
        "json": {
            "index": index,
            "key": sample.key,
            "captions": list(sample.captions),
            "meta": dict(sample.meta),
        },
    }
    if sample.captions:
        record["txt"] = sample.captions[0]
    record.update(getattr(sample, "members", {}))  # AnnotatedSample: e.g. stored teacher embeddings
    return record


def write_shards(
    samples: Iterable[Sample],
    out_dir: Path | str,
    *,
    source: str,
    info: dict[str, Any] | None = None,
    samples_per_shard: int = 1000,
    max_shard_bytes: int | str | None = None,
    settings: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``samples`` as shards in ``out_dir`` (resuming ``out_dir.partial`` if there is one).

    An existing ``out_dir`` is replaced only when it is empty or a shard set of the same ``source``
    (re-sharding it); a folder holding anything else, or shards of another source, is refused
    unless ``overwrite``. It is never the source itself or a folder holding it.

    A shard closes at ``samples_per_shard`` samples or once it holds ``max_shard_bytes`` bytes
    (it may exceed that by one sample). ``settings`` (e.g. the source options) must match on a
    resume. Returns the manifest.

    One writer at a time per ``out_dir`` (:mod:`clipkit.data.shard_lock`): a run that had to wait for
    another one writing the same set reuses that set, once it checks out against its manifest.
    """
    writer = ResumableWriter(
        Path(out_dir),
        source=source,
        samples_per_shard=samples_per_shard,
        max_shard_bytes=parse_size(max_shard_bytes),
        settings=settings or {},
    )
    with output_lock(writer.out_dir) as waited:
        if waited and (writer.out_dir / MANIFEST).is_file():
            return reuse_concurrent_set(writer.out_dir, source)
        claim_shard_directory(writer.out_dir, source, overwrite=overwrite)
        return writer.run(samples, info or {}, progress)


def claim_shard_directory(
    out_dir: Path, source: str, *, overwrite: bool, remedy: str = OVERWRITE_REMEDY
) -> None:
    """Refuse (ClipkitError) to write shards of ``source`` over anything but an earlier set of it."""
    protect = [Kept(path, "the source being sharded", inside=False) for path in local_paths(source)]
    claim_output_directory(out_dir, SHARD_OUTPUT, overwrite=overwrite, protect=protect, remedy=remedy)
    claim_output_directory(partial_directory(out_dir), PARTIAL_OUTPUT, overwrite=overwrite, remedy=remedy)
    made_from = manifest_source(out_dir)
    if made_from is not None and made_from != source and not overwrite:
        raise ClipkitError(
            f"{out_dir} already holds a shard set of {made_from!r}; writing {source!r} there would replace "
            f"it: {remedy}"
        )


def manifest_source(out_dir: Path) -> str | None:
    """The ``source`` a shard directory's manifest names (None without a readable manifest)."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return str(manifest.get("source")) if isinstance(manifest, dict) else None


def local_paths(source: str) -> list[Path]:
    """The existing local files or folders a source URI reads (``PATH``, ``scheme:PATH?query``)."""
    candidates = [source, source.split("?", 1)[0]]
    if ":" in source:
        candidates.append(source.split(":", 1)[1].split("?", 1)[0])
    return [Path(c) for c in dict.fromkeys(candidates) if c and Path(c).exists()]


def reuse_concurrent_set(out_dir: Path, source: str) -> dict[str, Any]:
    """The manifest of the set another process wrote while this one waited for the lock, after
    checking every shard against it; DataError when it is of another source or damaged."""
    from clipkit.data.shard import read_manifest, verify_shards

    manifest = read_manifest(out_dir)
    if manifest.get("source") != source:
        raise DataError(
            f"{out_dir} was written from {manifest.get('source')!r} by another run while this one "
            f"waited to write {source!r} there; not overwriting it (pick another output directory)"
        )
    problems = verify_shards(out_dir)["problems"]
    if problems:
        raise DataError(f"{out_dir}, written by another run meanwhile, does not match its manifest: "
                        f"{'; '.join(problems[:3])}")  # fmt: skip
    logging.getLogger("clipkit.data.shard").warning(
        "%s was written by another run meanwhile; it matches its manifest and is reused", out_dir
    )
    return manifest


def source_state(source: str) -> str | None:
    """``"<bytes>:<mtime ns>"`` of a source that is one local file (a table, a tar, an idx file),
    the path read from its URI (``webdataset:x.tar``, ``x.csv?image=...``); None for folders, URLs
    and generated data. A resumed shard run and a reused shard set compare it: an edited file would
    otherwise mix two versions of the rows unseen."""
    import re
    import stat

    path = source.split("?", 1)[0]
    if "://" in path:
        return None
    path = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]+:", "", path)  # a scheme prefix: webdataset:, idx:, ...
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return f"{status.st_size}:{status.st_mtime_ns}" if stat.S_ISREG(status.st_mode) else None


class ResumableWriter:
    """One shard set being written; see the module docs for the on-disk protocol."""

    def __init__(
        self,
        out_dir: Path,
        *,
        source: str,
        samples_per_shard: int,
        max_shard_bytes: int | None,
        settings: dict[str, Any],
    ) -> None:
        if samples_per_shard <= 0:
            raise ClipkitError(f"samples_per_shard must be > 0, got {samples_per_shard}")
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise ClipkitError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out_dir, self.partial = out_dir, partial_directory(out_dir)
        self.identity = {
            "source": source,
            "samples_per_shard": samples_per_shard,
            "max_shard_bytes": max_shard_bytes,
            "settings": json.loads(json.dumps(settings, default=str)),
        }
        self.source, self.source_state = source, source_state(source)
        self.samples_per_shard, self.max_shard_bytes = samples_per_shard, max_shard_bytes
        self.shards: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.fields: set[str] = set()
        # Samples of the finished shards written without a caption: {"count", "example"} (journaled).
        self.uncaptioned: dict[str, Any] = {"count": 0, "example": None}
        self.abandoned: OpenShard | None = None  # the shard being written when a run failed

    # -- journal ---------------------------------------------------------------------------

    @property
    def written(self) -> int:
        return sum(shard["count"] for shard in self.shards)

    def load_journal(self) -> bool:
        """Pick up ``OUT.partial`` if it exists (True when resuming); clear what the journal lacks."""
        path = self.partial / JOURNAL
        if not path.is_file():
            shutil.rmtree(self.partial, ignore_errors=True)
            self.partial.mkdir(parents=True)
            return False
        from clipkit.artifacts.files import read_json

        journal = read_json(path, "the shard journal", f"delete {self.partial}", expect=dict)
        if journal.get("identity") != self.identity:
            raise DataError(
                f"{self.partial} holds an interrupted run with other arguments "
                f"({json.dumps(journal.get('identity'))}); rerun with those arguments to finish it, "
                f"or delete {self.partial} to start over"
            )
        if "source_state" in journal and journal["source_state"] != self.source_state:
            raise DataError(
                f"{self.source} changed since {self.partial} was started (its size or modification time "
                f"differs); finishing it would mix rows of two versions: delete {self.partial} to shard "
                "the source from the start"
            )
        self.shards, self.state = list(journal["shards"]), dict(journal.get("state") or {})
        self.fields = set(journal.get("fields") or [])
        self.uncaptioned = dict(journal.get("uncaptioned") or {"count": 0, "example": None})
        listed = {shard["name"] for shard in self.shards} | {JOURNAL}
        listed |= {index_path(Path(name)).name for name in listed}
        for leftover in self.partial.iterdir():
            if leftover.name not in listed:
                leftover.unlink()  # an unfinished .tmp, or a shard renamed just before a crash
        return True

    def save_journal(self) -> None:
        journal = {
            "format": JOURNAL_FORMAT,
            "identity": self.identity,
            "source_state": self.source_state,
            "shards": self.shards,
            "state": self.state,
            "fields": sorted(self.fields),
            "uncaptioned": self.uncaptioned,
        }
        atomic_write_text(self.partial / JOURNAL, json.dumps(journal, indent=1) + "\n")

    # -- writing -----------------------------------------------------------------------------

    def run(self, samples: Iterable[Sample], info: dict[str, Any], progress) -> dict[str, Any]:
        finished = self.finish_completed()
        if finished is not None:
            return finished
        resuming = self.load_journal()
        iterator = self.resumed_iterator(samples) if resuming else iter(samples)
        if progress is not None and self.written:
            progress(self.written)
        shard = None
        with writing(self.out_dir, needed=self.next_shard_bytes, remove=self.unfinished, kept=self.kept_note):
            try:
                for sample in iterator:
                    if shard is None:
                        shard = self.open_shard()
                    shard.write(encode_sample(sample, self.written + shard.count), sample)
                    if progress is not None:
                        progress(1)
                    if self.is_full(shard):
                        self.finish_shard(shard, samples)
                        shard = None
                if shard is not None:
                    self.finish_shard(shard, samples)
                    shard = None
            finally:
                if shard is not None:
                    self.abandoned = shard
                    shard.abandon()  # its .tmp is deleted by the next run (or now, if the disk is full)
        if hasattr(samples, "info"):
            # Read after the pass: sources count what they skipped (by reason) while iterating.
            info = {**info, **samples.info()}
        if self.written == 0:
            shutil.rmtree(self.partial, ignore_errors=True)
            why = skip_summary(info)
            raise DataError(
                f"source {self.source!r} yielded no samples{why}; nothing written to {self.out_dir}"
            )
        return self.complete(info)

    def resumed_iterator(self, samples: Iterable[Sample]) -> Iterator[Sample]:
        """Samples after the last finished shard: the source's own position, or skip-by-count."""
        if hasattr(samples, "restore") and "source_state" in self.state:
            samples.restore(self.state["source_state"])
            return iter(samples)
        iterator = iter(samples)
        for _ in range(self.written):
            if next(iterator, None) is None:
                raise DataError(
                    f"{self.partial}: the source now yields fewer samples than the {self.written} "
                    "already written; it changed since the interrupted run — delete the .partial directory"
                )
        return iterator

    # -- a full disk (clipkit.artifacts.io.writing) ----------------------------------------------------

    def unfinished(self) -> list[Path]:
        """What a full disk leaves to delete: the half-written shard, and ``OUT.partial`` when no
        shard was finished (the finished ones are kept: a rerun continues from them)."""
        half = [self.abandoned.temporary] if self.abandoned is not None else []
        return half + ([] if self.shards else [self.partial])

    def next_shard_bytes(self) -> int | None:
        """The room one more shard needs: ``max_shard_bytes``, else the largest finished one, else
        what the unfinished one held when the disk filled (a lower bound)."""
        sizes = [(self.partial / shard["name"]).stat().st_size for shard in self.shards[-1:]]
        unfinished = self.abandoned.size if self.abandoned is not None else 0
        return self.max_shard_bytes or max(sizes + [unfinished]) or None

    def kept_note(self) -> str:
        if not self.shards:
            return f"nothing was written; {self.out_dir} is unchanged"
        return (
            f"the {len(self.shards)} finished shard(s) in {self.partial} are kept: free space and rerun "
            f"the same command to continue ({self.out_dir} is unchanged until the set is complete)"
        )

    def is_full(self, shard: OpenShard) -> bool:
        by_size = self.max_shard_bytes is not None and shard.size >= self.max_shard_bytes
        return shard.count >= self.samples_per_shard or by_size

    def open_shard(self) -> OpenShard:
        name = SHARD_PATTERN % len(self.shards)
        return OpenShard(self.partial / name, first_index=self.written)

    def finish_shard(self, shard: OpenShard, samples) -> None:
        final = shard.close()
        self.fields.update(shard.fields)
        self.uncaptioned["count"] += shard.uncaptioned
        self.uncaptioned["example"] = self.uncaptioned["example"] or shard.uncaptioned_example
        digest = sha256(final)
        self.shards.append(
            {"name": final.name, "count": shard.count, "sha256": digest, "first_index": shard.first_index}
        )
        self.state = {"source_state": samples.state()} if hasattr(samples, "state") else {}
        self.save_journal()

    def complete(self, info: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest, then rename ``OUT.partial`` to ``OUT``, then drop the journal.

        The manifest is the commit point: once it is in ``OUT.partial`` the set is complete, and
        a run killed before the rename finishes it (:meth:`finish_completed`) without re-reading
        the source. The journal goes last, from ``OUT``: a leftover one there is harmless (no
        reader looks at it) and removed by the next writer.
        """
        manifest = build_manifest(self.shards, sorted(self.fields), self.source, self.counted(info))
        atomic_write_text(self.partial / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        replace_directory(self.partial, self.out_dir)
        (self.out_dir / JOURNAL).unlink(missing_ok=True)
        return manifest

    def counted(self, info: dict[str, Any]) -> dict[str, Any]:
        """The source's ``info`` with this run's count of samples written without a caption (a
        re-sharded set's own count is replaced: it is counted again here)."""
        info = {key: value for key, value in info.items() if key not in UNCAPTIONED_KEYS}
        if self.uncaptioned["count"]:
            info.update(
                uncaptioned=self.uncaptioned["count"], uncaptioned_example=self.uncaptioned["example"]
            )
        return info

    def finish_completed(self) -> dict[str, Any] | None:
        """The manifest of a set a killed run completed but did not rename yet (None otherwise):
        ``OUT.partial`` holds a manifest (written after every shard was journaled) and a journal
        with this run's arguments; it is renamed to ``OUT`` now."""
        (self.out_dir / JOURNAL).unlink(missing_ok=True)  # left by a run killed after its rename
        manifest_path, journal_path = self.partial / MANIFEST, self.partial / JOURNAL
        if not (manifest_path.is_file() and journal_path.is_file()):
            return None
        from clipkit.artifacts.files import read_json
        from clipkit.errors import ArtifactError

        try:
            journal = read_json(journal_path, "the shard journal", expect=dict)
            manifest = read_json(manifest_path, "the shard manifest", expect=dict)
        except ArtifactError:
            return None  # not the commit point after all: load_journal decides
        if journal.get("identity") != self.identity or manifest.get("shards") != journal.get("shards"):
            return None
        replace_directory(self.partial, self.out_dir)
        (self.out_dir / JOURNAL).unlink(missing_ok=True)
        return manifest


class OpenShard:
    """A tar shard being written to ``NAME.tmp``; :meth:`close` makes it ``NAME`` durably."""

    def __init__(self, path: Path, *, first_index: int) -> None:
        import webdataset as wds

        self.path, self.first_index = path, first_index
        self.temporary = path.with_name(path.name + ".tmp")
        self.stream = self.temporary.open("wb")
        self.writer = wds.TarWriter(self.stream, mtime=MEMBER_MTIME)
        self.count = 0
        self.fields: set[str] = set()
        self.keys: list[str] = []  # per record: its key and where its first header starts (the index)
        self.offsets: list[int] = []
        self.uncaptioned = 0  # samples without a caption, and the first one's index and key
        self.uncaptioned_example: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        """Bytes of tar members so far (headers + padded data); the file adds the end-of-archive
        blocks, padded to tar's 10 KiB record size."""
        return self.writer.tarstream.offset

    def write(self, record: dict[str, Any], sample: Sample) -> None:
        offset = self.size
        try:
            self.writer.write(record)
        except (TypeError, ValueError) as error:  # e.g. meta-data json cannot encode
            raise DataError(f"sample {sample.key!r} cannot be written: {error}") from error
        self.fields.update(key for key in record if not key.startswith("__"))
        self.keys.append(record["__key__"])
        self.offsets.append(offset)
        if not sample.captions:
            self.uncaptioned += 1
            self.uncaptioned_example = self.uncaptioned_example or {
                "index": self.first_index + self.count,
                "key": sample.key,
            }
        self.count += 1

    def abandon(self) -> None:
        """Close without finishing (the ``.tmp`` stays until the next run deletes it); on a full
        disk the close itself may fail, which changes nothing."""
        with contextlib.suppress(OSError):
            self.writer.close()
        with contextlib.suppress(OSError):
            self.stream.close()

    def close(self) -> Path:
        self.writer.close()  # closes the tar stream, not our file object
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        write_index(self.path, self.keys, self.offsets, self.temporary.stat().st_size)
        os.replace(self.temporary, self.path)
        fsync_directory(self.path.parent)
        return self.path


def ensure_shards(shards: str, source: str, *, pm=None, progress=None) -> Path:
    """Return the shard directory, creating it from ``source`` first when it has no manifest."""
    directory = Path(shards)
    opened = check_shards(shards, source, pm=pm)
    if opened is not None:
        manifest = write_shards(opened, directory, source=source, info=opened.info(), progress=progress)
        line = skipped_rows_line(manifest)
        if line:  # what `clipkit shard` prints: no row is left out without a word
            print(f"data: {line} (while sharding {source} into {directory})", flush=True)
            for example in skipped_example_lines(manifest):
                print(f"data: {example}", flush=True)
        warning = uncaptioned_line(manifest)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return directory


def skipped_rows_line(manifest: dict) -> str:
    """``skipped 3 bad row(s): missing_image 2, empty_caption 1`` from a manifest, or "" — the one
    wording of `clipkit shard` and of sharding a source for `clipkit train`."""
    skipped = (manifest.get("info") or {}).get("skipped") or {}
    if not skipped:
        return ""
    reasons = ", ".join(f"{reason} {count}" for reason, count in skipped.items())
    return f"skipped {sum(skipped.values())} bad row(s): {reasons}"


def skipped_example_lines(manifest: dict) -> list[str]:
    """``  e.g. FILE: line 7: bad_caption: ...``, the first row skipped for each reason (from a
    manifest), so every count can be traced without rerunning with ``--strict`` (which stops at the
    first bad row of any reason)."""
    examples = (manifest.get("info") or {}).get("skipped_examples") or {}
    return [f"  e.g. {example}" for example in examples.values()]


def uncaptioned_line(manifest: dict) -> str:
    """``warning: 1 of 3 samples have no caption ...`` when a set mixes samples with and without
    captions, or "" (all captioned; or none, a label-only evaluation set). Such samples are kept
    (zero-shot evaluation uses them), but a text tower cannot train on them: the loader stops at
    the first one, maybe hours into a run, so `clipkit shard` says it when it writes the set."""
    info = manifest.get("info") or {}
    count, total = int(info.get("uncaptioned") or 0), int(manifest.get("n") or 0)
    if not 0 < count < total:
        return ""
    example = info.get("uncaptioned_example") or {}
    return (
        f"warning: {count} of {total} samples have no caption (e.g. key {example.get('key')!r}, stored "
        f"as index {example.get('index')}): kept for evaluation, but training a text tower on this set "
        "stops at the first one; give them captions or leave them out of the source to train on it"
    )


def check_shards(shards: str, source: str, *, pm=None):
    """What :func:`ensure_shards` checks before it writes anything (also ``clipkit validate``): a
    shard directory made from ``source``, or a ``source`` some plugin opens. Returns the opened
    source to shard from, or None when the shards are there."""
    directory = Path(shards)
    if (directory / MANIFEST).is_file():
        made_from = read_manifest(directory).get("source")
        if source and made_from != source:
            # Reusing shards of another source would silently train on the wrong data.
            raise DataError(
                f"{directory} holds shards of {made_from!r}, not data.source {source!r}: "
                "point data.shards at a new directory (or remove the old one)"
            )
        return None
    if not source:
        raise DataError(f"{directory}: no {MANIFEST} and no data.source to create it from")
    # Refused before the source is opened: a data.shards folder holding files clipkit did not write.
    claim_shard_directory(directory, source, overwrite=False, remedy="point data.shards at a new directory")
    return open_source(source, pm=pm)
