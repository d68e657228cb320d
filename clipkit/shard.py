"""`clipkit shard`: a data source -> WebDataset tar shards + ``manifest.json``.

Each sample is stored under key = its global index (zero-padded) with fields
``<image_ext>`` (the encoded image bytes as given), ``txt`` (the first caption) and
``json`` (``{"index", "key", "captions", "meta"}``). The whole shard set is built in a
temporary directory and renamed into place when complete, so an interrupted run never
leaves a half-written set that looks finished.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from clipkit import __version__
from clipkit.errors import ClipkitError, DataError
from clipkit.io import atomic_directory
from clipkit.types import Sample

MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-%06d.tar"


def open_source(uri: str, options: dict[str, Any] | None = None, *, pm=None):
    """The first ``open_source`` plugin that accepts ``uri``."""
    if pm is None:
        from clipkit.registry import default_registry

        pm = default_registry().pm
    source = pm.hook.open_source(uri=uri, options=dict(options or {}))
    if source is None:
        raise ClipkitError(
            f"no data source accepts {uri!r}: expected a shard directory (with {MANIFEST}), "
            "synthetic://shapes[?n=...&split=...], or a URI a plugin handles"
        )
    return source


def write_shards(
    samples: Iterable[Sample],
    out_dir: Path | str,
    *,
    source: str,
    info: dict[str, Any] | None = None,
    samples_per_shard: int = 1000,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write ``samples`` to ``out_dir`` atomically; returns the manifest."""
    import webdataset as wds

    if samples_per_shard <= 0:
        raise ClipkitError(f"samples_per_shard must be > 0, got {samples_per_shard}")
    out_dir = Path(out_dir)
    fields: set[str] = set()
    count = 0
    with atomic_directory(out_dir) as building:
        pattern = str(building / SHARD_PATTERN)
        with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as writer:
            for index, sample in enumerate(samples):
                record = encode_sample(sample, index)
                fields.update(k for k in record if not k.startswith("__"))
                writer.write(record)
                count = index + 1
                if progress is not None:
                    progress(1)
        if hasattr(samples, "info"):
            # Read after the pass: sources count what they skipped (by reason) while iterating.
            info = {**(info or {}), **samples.info()}
        if count == 0:
            raise DataError(f"source {source!r} yielded no samples; nothing written to {out_dir}")
        manifest = build_manifest(building, count, sorted(fields), source, info or {})
        (building / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def encode_sample(sample: Sample, index: int) -> dict[str, Any]:
    if not sample.captions:
        raise DataError(f"sample {sample.key!r} has no caption")
    return {
        "__key__": f"{index:09d}",
        sample.image_ext: sample.image,
        "txt": sample.captions[0],
        "json": {
            "index": index,
            "key": sample.key,
            "captions": list(sample.captions),
            "meta": dict(sample.meta),
        },
    }


def build_manifest(directory: Path, n: int, fields: list[str], source: str, info: dict) -> dict[str, Any]:
    shards = []
    for path in sorted(directory.glob("shard-*.tar")):
        shards.append({"name": path.name, "count": count_members(path), "sha256": sha256(path)})
    total = sum(s["count"] for s in shards)
    if total != n:
        raise DataError(f"{directory}: wrote {n} samples but the shards hold {total}")
    return {
        "format": "clipkit-shards/1",
        "n": n,
        "shards": shards,
        "fields": fields,
        "source": source,
        "info": info,
        "clipkit_version": __version__,
    }


def count_members(path: Path) -> int:
    import tarfile

    with tarfile.open(path) as tar:
        keys = {member.name.split(".", 1)[0] for member in tar.getmembers() if member.isfile()}
    return len(keys)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path | str) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"{directory} is not a clipkit shard directory: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: invalid JSON ({error})") from error
    for key in ("n", "shards"):
        if key not in manifest:
            raise DataError(f"{path}: missing key {key!r}")
    return manifest


def shard_urls(directory: Path | str) -> list[str]:
    manifest = read_manifest(directory)
    return [str(Path(directory) / shard["name"]) for shard in manifest["shards"]]


class ShardSource:
    """Reads a shard directory back as :class:`Sample` records in index order (eval, re-sharding)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)

    def __len__(self) -> int:
        return int(self.manifest["n"])

    def info(self) -> dict[str, Any]:
        return dict(self.manifest.get("info") or {})

    def __iter__(self) -> Iterator[Sample]:
        import webdataset as wds

        for record in wds.WebDataset(shard_urls(self.directory), shardshuffle=False, empty_check=False):
            yield decode_record(record, self.directory)


def decode_record(record: dict[str, Any], where: Path | str) -> Sample:
    """A raw WebDataset record (bytes per field) -> :class:`Sample` (image left encoded)."""
    key = record.get("__key__", "?")
    try:
        meta = json.loads(record["json"])
        image_ext = next(ext for ext in ("png", "jpg", "jpeg", "webp", "bmp") if ext in record)
    except (KeyError, StopIteration, json.JSONDecodeError) as error:
        raise DataError(f"{where}: sample {key!r} lacks an image or a valid json field ({error})") from error
    return Sample(
        key=str(meta.get("key", key)),
        image=record[image_ext],
        image_ext=image_ext,
        captions=tuple(meta.get("captions") or ()),
        meta={"index": meta.get("index"), **(meta.get("meta") or {})},
    )


def ensure_shards(shards: str, source: str, *, pm=None, progress=None) -> Path:
    """Return the shard directory, creating it from ``source`` first when it has no manifest."""
    directory = Path(shards)
    if (directory / MANIFEST).is_file():
        made_from = read_manifest(directory).get("source")
        if source and made_from != source:
            # Reusing shards of another source would silently train on the wrong data.
            raise DataError(
                f"{directory} holds shards of {made_from!r}, not data.source {source!r}: "
                "point data.shards at a new directory (or remove the old one)"
            )
        return directory
    if not source:
        raise DataError(f"{directory}: no {MANIFEST} and no data.source to create it from")
    opened = open_source(source, pm=pm)
    write_shards(opened, directory, source=source, info=opened.info(), progress=progress)
    return directory
