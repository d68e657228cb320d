"""Shard sets: opening sources, the manifest, reading shards back, checking a set.

A shard set is a directory of WebDataset tars ``shard-NNNNNN.tar`` plus ``manifest.json``;
:mod:`clipkit.data.shard_writer` writes them (resumably, atomically). Each sample is stored under
key = its global index (zero-padded) with fields ``<image_ext>`` (the image bytes as given),
``txt`` (the first caption, if any) and ``json`` (``{"index", "key", "captions", "meta"}``).
Reading a record back, the json's ``captions`` win; without them the ``txt`` field is read, one
caption or a JSON list of several (:mod:`clipkit.data.captions`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clipkit import __version__
from clipkit.contract.types import Sample
from clipkit.data.captions import record_captions
from clipkit.errors import ClipkitError, DataError

MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-%06d.tar"


def open_source(uri: str, options: dict[str, Any] | None = None, *, pm=None):
    """The first ``open_source`` plugin that accepts ``uri``."""
    if pm is None:
        from clipkit.contract.registry import default_registry

        pm = default_registry().pm
    source = pm.hook.open_source(uri=uri, options=dict(options or {}))
    if source is None:
        raise ClipkitError(
            f"no data source accepts {uri!r}: expected a shard directory (with {MANIFEST}), "
            "synthetic://shapes[?n=...&split=...], or a URI a plugin handles"
        )
    return source


def build_manifest(shards: list[dict[str, Any]], fields: list[str], source: str, info: dict) -> dict:
    """The manifest of a finished set: ``n``, per-shard name/count/sha256/first_index, fields, source,
    the source's ``info()`` (labels, skipped counts by reason) and the clipkit version."""
    return {
        "format": "clipkit-shards/1",
        "n": sum(shard["count"] for shard in shards),
        "shards": shards,
        "fields": fields,
        "source": source,
        "info": info,
        "clipkit_version": __version__,
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path | str) -> dict[str, Any]:
    """``manifest.json`` of a shard directory, checked so that nothing reading it fails later:
    ``n``, and ``shards`` entries with a plain file ``name`` and a ``count`` adding up to ``n``."""
    from clipkit.artifacts.files import read_json_object

    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"{directory} is not a clipkit shard directory: {MANIFEST} is missing")
    redo = "re-shard the source (clipkit shard SOURCE OUT) or restore the directory"
    manifest = read_json_object(path, "the shard manifest", redo)
    for key in ("n", "shards"):
        if key not in manifest:
            raise DataError(f"{path}: missing key {key!r}; {redo}")
    problem = manifest_problem(manifest)
    if problem:
        raise DataError(f"{path}: {problem}; {redo}")
    return manifest


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What makes a manifest unusable, or None."""
    n, shards = manifest["n"], manifest["shards"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return f"`n` must be a non-negative integer, got {n!r}"
    if not isinstance(shards, list):
        return f"`shards` must be a list, got {type(shards).__name__}"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            return f"shards[{i}] must be a mapping with name and count"
        name, count = shard.get("name"), shard.get("count")
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            return f"shards[{i}].name must be a file name in the directory, got {name!r}"
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return f"shards[{i}].count must be a non-negative integer, got {count!r}"
    total = sum(shard["count"] for shard in shards)
    if total != n:
        return f"the shards' counts add up to {total}, but `n` is {n}"
    return None


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
        import tarfile

        import webdataset as wds

        records = wds.WebDataset(shard_urls(self.directory), shardshuffle=False, empty_check=False)
        try:
            for record in records:
                yield decode_record(record, self.directory)
        except (tarfile.TarError, OSError, EOFError) as error:  # a shard truncated, damaged or gone
            raise DataError(
                f"{self.directory}: a shard cannot be read whole ({type(error).__name__}: {error}); "
                f"`clipkit shard --verify {self.directory}` names it — shard the data again"
            ) from error


#: The members a sample's image may be stored as, in the order they are looked for.
IMAGE_FIELDS = ("png", "jpg", "jpeg", "webp", "bmp")


def decode_record(record: dict[str, Any], where: Path | str) -> Sample:
    """A raw WebDataset record (bytes per field) -> :class:`Sample` (image left encoded). Shards
    from elsewhere (open_clip / img2dataset style) may lack the json: the caption is then ``txt``
    and the sample has no stored index (:mod:`clipkit.data.shard_sets` numbers it)."""
    key = record.get("__key__", "?")
    image_ext = next((ext for ext in IMAGE_FIELDS if ext in record), None)
    if image_ext is None:
        fields = ", ".join(sorted(k for k in record if not k.startswith("__"))) or "none"
        wanted = "/".join(IMAGE_FIELDS)
        raise DataError(f"{where}: sample {key!r} has no image member ({wanted}); its members: {fields}")
    try:
        meta = json.loads(record["json"]) if "json" in record else {}
    except ValueError as error:  # bad JSON, non-UTF-8
        raise DataError(f"{where}: sample {key!r}: its json is not valid JSON ({error})") from error
    if not isinstance(meta, dict):
        raise DataError(f"{where}: sample {key!r}: its json is not an object")
    try:
        captions = record_captions(meta, record.get("txt"))
    except ValueError as error:  # non-UTF-8 txt
        raise DataError(f"{where}: sample {key!r}: its txt is not UTF-8 text ({error})") from error
    return Sample(
        key=str(meta.get("key", key)),
        image=record[image_ext],
        image_ext=image_ext,
        captions=captions,
        # The global index wins over a source column named "index" (pandas exports have one).
        meta={**(meta.get("meta") or {}), "index": meta.get("index")},
    )


def verify_shards(directory: Path | str) -> dict[str, Any]:
    """Check a shard set against its manifest; returns ``{"n", "shards", "problems"}``.

    Problems found: a missing, unlisted or altered shard (sha256), a per-shard sample count
    that differs from the manifest, a sample whose key and ``json`` index disagree or lacks an
    image, global indices that are not exactly [0, n) once each, and a shard index
    (``.tar.idx``) that does not match its tar. Reads every tar but
    decodes no image (the checksums cover the bytes).
    """
    import tarfile

    directory = Path(directory)
    manifest = read_manifest(directory)
    problems: list[str] = []
    listed = {shard["name"] for shard in manifest["shards"]}
    for path in sorted(directory.glob("*.tar")):
        if path.name not in listed:
            problems.append(f"{path.name}: a tar file the manifest does not list")
    seen: dict[int, str] = {}
    for shard in manifest["shards"]:
        path = directory / shard["name"]
        if not path.is_file():
            problems.append(f"{shard['name']}: missing")
            continue
        if sha256(path) != shard.get("sha256"):
            problems.append(f"{shard['name']}: sha256 differs from the manifest (the file changed)")
        try:
            with tarfile.open(path) as tar:
                records = shard_records(tar)
        except (tarfile.TarError, OSError) as error:
            problems.append(f"{shard['name']}: unreadable tar ({error})")
            continue
        if len(records) != shard.get("count"):
            expected = shard.get("count")
            problems.append(f"{shard['name']}: {len(records)} samples, the manifest says {expected}")
        for key, record in records.items():
            problems.extend(check_record(shard["name"], key, record, seen))
        problems.extend(check_index(path))
    n = int(manifest["n"])
    missing = [index for index in range(n) if index not in seen]
    if missing:
        problems.append(f"{len(missing)} global indices missing, e.g. {missing[:5]}")
    outside = sorted(index for index in seen if not 0 <= index < n)
    if outside:
        problems.append(f"{len(outside)} global indices outside [0, {n}), e.g. {outside[:5]}")
    return {"n": n, "shards": len(manifest["shards"]), "problems": problems}


def check_index(path: Path) -> list[str]:
    """The index beside the shard at ``path`` (:mod:`clipkit.data.tar_index`) must list its
    records' keys and offsets and its size; a set written before indexes has none (no problem)."""
    import tarfile

    from clipkit.data.tar_index import index_path, index_tar, parse_index

    where = index_path(path)
    if not where.is_file():
        return []
    index = parse_index(where.read_bytes())
    if index is None:
        return [f"{where.name}: not a readable clipkit tar index (the loader does not use it)"]
    try:
        actual = index_tar(path)
    except (tarfile.TarError, OSError, EOFError) as error:
        return [f"{path.name}: its index cannot be checked: not a whole tar ({error})"]
    if index != actual:
        return [f"{where.name}: does not match {path.name} (the loader reads that tar from its start)"]
    return []


def shard_records(tar) -> dict[str, dict[str, bytes]]:
    """{key: {field: bytes}} of one tar; only ``json`` bodies are read (images are skipped)."""
    records: dict[str, dict[str, bytes]] = {}
    for member in tar:
        if not member.isfile():
            continue
        key, _, field = member.name.partition(".")
        body = tar.extractfile(member).read() if field == "json" else b""
        records.setdefault(key, {})[field] = body
    return records


def check_record(shard: str, key: str, record: dict[str, bytes], seen: dict[int, str]) -> list[str]:
    where = f"{shard}: sample {key!r}"
    if not any(field in record for field in ("png", "jpg", "jpeg", "webp", "bmp")):
        return [f"{where}: no image field (has {sorted(record)})"]
    try:
        index = int(json.loads(record["json"])["index"])
    except (KeyError, TypeError, ValueError) as error:
        return [f"{where}: no readable json index ({error})"]
    problems = []
    if key != f"{index:09d}":
        problems.append(f"{where}: key does not match its json index {index}")
    if index in seen:
        problems.append(f"{where}: global index {index} also in {seen[index]}")
    seen[index] = shard
    return problems
