"""Dataset-format sources for ``clipkit shard``: parquet tables, img2dataset output, existing
WebDataset shards (re-indexed) and idx files (MNIST, Fashion-MNIST).

URIs (all ``trylast``, so a third-party ``open_source`` can take any of them over):

* ``PATH.parquet[?image=COL&caption=COL1,COL2&meta=COL3,COL4]``: opened by
  :class:`clipkit.plugins.sources.file_sources.TableSource` with the same column semantics as JSONL/CSV
  tables; the image column may also hold the encoded image itself (a binary column as img2dataset
  writes, or Hugging Face datasets' ``{"bytes", "path"}`` struct). Read a batch of rows at a time,
  so a 10 GB table is never loaded whole; a row group that cannot be decoded counts its rows as
  ``bad_row``. Needs pyarrow (``pip install pyarrow``, or the extra:
  ``pip install 'clipkit-contrastive[parquet]'``), imported lazily.
* ``img2dataset:PATH`` (or a bare directory holding img2dataset's ``NNNNN_stats.json`` files): an
  img2dataset output folder in any of its ``output_format`` "files" (``NNNNN/KEY.jpg`` + ``.txt`` +
  ``.json``), "webdataset" (``NNNNN.tar``) or "parquet" (``NNNNN.parquet`` with the image bytes in a
  ``jpg``/``png``/``webp`` column). Key = img2dataset's key; captions from ``txt`` (the parquet
  format's ``caption`` column; none when img2dataset had no caption column); meta = the scalar
  fields of its per-sample record (url, key, status, error_message, width, height, original_width,
  original_height, and any ``save_additional_columns``). Samples that failed to download or resize
  are counted under ``failed_download`` (for "files"/"webdataset" from ``NNNNN_stats.json``, which
  is all img2dataset keeps of them there; for "parquet" from each row's ``status``).
* ``webdataset:DIR`` / ``webdataset:GLOB`` / ``webdataset:PATH/shard-{000..009}.tar`` (or
  ``A.tar::B.tar``): existing WebDataset shards (``.tar``, ``.tgz``, ``.tar.gz``; braces and ``::``
  expanded by webdataset itself), re-indexed: ``clipkit shard`` numbers the samples afresh and
  ``Sample.key`` keeps the shards' own ``__key__``. Shards are streamed; one that ends early (cut
  short, corrupt) counts a ``bad_shard`` for the sample it was in and keeps those before it.
  Image from the ``png``/``jpg``/``jpeg``/``webp``/``bmp`` field; captions from ``txt`` (or
  ``caption``: one caption, or a JSON list of several), or from a ``captions`` list in ``json``
  (which wins: clipkit's own shards repeat only the first caption in ``txt``); meta =
  ``json``'s scalar fields plus ``cls`` (an integer, as ``label``). A sample with no caption
  field gets no captions (label-only eval sets).
* ``idx:PATH/t10k-images-idx3-ubyte[.gz][?labels=PATH]`` (or that path bare): MNIST-style idx files,
  gzipped or raw; the labels file is found by name (``-images-idx3-ubyte`` ->
  ``-labels-idx1-ubyte``) unless given. Each image becomes a lossless grayscale PNG with meta
  ``{"label", "class"}`` and caption "a photo of a {class}."; ``info()["labels"]["class"]`` is the
  ``classes:`` folders' format, so zero-shot evaluation works. Class names come from a sibling
  ``classes.json`` (``{"classes": [...]}`` as Fashion-MNIST ships, or a plain list), else "0".."9".
* ``wds:DIR[?split=test]`` (or a bare ``wds_<dataset>`` folder): CLIP_benchmark's WebDataset layout,
  with its ``classnames.txt`` and zero-shot templates
  (:mod:`clipkit.plugins.sources.clip_benchmark_source`).

Options (``-o key=value``) as for the file sources: ``strict``, ``workers``, ``max_caption_chars``.
As there, a bad sample is skipped and counted by reason in ``source.skipped`` (``strict`` raises
:class:`clipkit.errors.DataError` naming the file and sample instead), and a URI naming a missing
path is a DataError. Torch is never imported here.
"""

from __future__ import annotations

import functools
import glob
import json
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipkit.contract.types import Sample
from clipkit.data.captions import captions_from_text
from clipkit.errors import DataError

from .file_sources import (
    IMAGE_SUFFIXES,
    MANIFEST,
    BadRow,
    FileSource,
    check_meta,
    clean_captions,
    common_options,
    is_scalar,
    verify_image_bytes,
)
from .idx_source import IDX_IMAGES_NAME
from .parquet_reader import parquet_columns, parquet_records

IMG2DATASET, WEBDATASET, IDX = "img2dataset:", "webdataset:", "idx:"
#: Record fields holding the image, in order of preference (a record rarely has two).
IMAGE_FIELDS = tuple(suffix.lstrip(".") for suffix in IMAGE_SUFFIXES)
#: Record fields holding one caption each; the first present is used.
CAPTION_FIELDS = ("txt", "caption")
#: Per-sample record keys that are captions, never meta.
CAPTION_KEYS = frozenset({"caption", "captions"})
TAR_SUFFIXES = (".tar", ".tgz", ".tar.gz")
STATS_SUFFIX = "_stats.json"


def open_dataset_source(uri: str, options: dict[str, Any] | None = None):
    """The source for ``uri`` (see module docs), or None when it is none of these forms."""
    options = dict(options or {})
    if uri.startswith(IMG2DATASET):
        return Img2DatasetSource(uri[len(IMG2DATASET) :], **common_options(options))
    if uri.startswith(WEBDATASET):
        return WebDatasetSource(uri[len(WEBDATASET) :], **common_options(options))
    if uri.startswith(IDX):
        from .idx_source import idx_source

        return idx_source(uri[len(IDX) :], options)
    if "://" in uri:
        return None
    path, _, query = uri.partition("?")
    if IDX_IMAGES_NAME.search(Path(path).name) and Path(path).is_file():
        from .idx_source import idx_source

        return idx_source(uri, options)
    if not query and is_img2dataset_folder(Path(uri)):
        return Img2DatasetSource(uri, **common_options(options))
    return None


def fail(reason: str, detail: str) -> Sample:
    """A candidate's ``build`` for a sample known to be bad before it is built."""
    raise BadRow(reason, detail)


# --------------------------------------------------------------------------------------------
# WebDataset-style records: field -> bytes (from a tar) or -> a file (img2dataset "files")


def field_bytes(value: bytes | Path) -> bytes:
    if isinstance(value, Path):
        try:
            return value.read_bytes()
        except OSError as error:
            raise BadRow("missing_file", f"{value} cannot be read ({error.strerror or error})") from None
    return value


def field_text(value: bytes | Path, where: str) -> str:
    try:
        return field_bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRow("bad_encoding", f"{where}: text is not valid UTF-8") from None


def record_parts(fields: Mapping[str, bytes | Path], where: str) -> tuple[bytes | None, list | None, dict]:
    """``(image bytes or None, caption values or None, meta)`` of one record.

    Captions are None (not []) when the record has no caption field at all, as in label-only
    sets, which is allowed; a caption field that is present but blank is an ``empty_caption`` later.
    """
    captions: list[Any] | None = None
    name = next((name for name in CAPTION_FIELDS if name in fields), None)
    if name is not None:
        captions = captions_from_text(field_text(fields[name], f"{where}.{name}"))  # one, or a JSON list
    meta: dict[str, Any] = {}
    if "json" in fields:
        meta = json_object(field_text(fields["json"], f"{where}.json"), f"{where}.json")
        if isinstance(meta.get("captions"), list):
            captions = meta["captions"]
    if "cls" in fields:
        text = field_text(fields["cls"], f"{where}.cls").strip()
        try:
            meta["label"] = int(text)
        except ValueError:
            raise BadRow("bad_meta", f"{where}.cls: label {text!r} is not an integer") from None
    image_field = next((name for name in IMAGE_FIELDS if name in fields), None)
    image = field_bytes(fields[image_field]) if image_field else None
    return image, captions, meta


def json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadRow("bad_meta", f"{where}: invalid JSON ({error})") from None
    if not isinstance(value, dict):
        raise BadRow("bad_meta", f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def make_sample(
    key: str, where: str, image: bytes | None, captions: list | None, meta: dict, max_caption_chars: int
) -> Sample:
    """Clean the captions, keep the scalar meta (captions are not meta), then verify the image."""
    if image is None:
        raise BadRow("missing_image", f"{where}: no image field ({'/'.join(IMAGE_FIELDS)})")
    captions = () if captions is None else clean_captions(captions, where, max_caption_chars)
    meta = {name: value for name, value in meta.items() if name not in CAPTION_KEYS and is_scalar(value)}
    check_meta(meta, where)
    image_ext = verify_image_bytes(image, f"{where}: image")
    return Sample(key=key, image=image, image_ext=image_ext, captions=captions, meta=meta)


def is_meta_member(name: str) -> bool:
    # webdataset skips "__name__" members (tar-level meta data), and so do we.
    return re.match(r"__[^/]*__($|/)", name) is not None


def tar_records(path: Path) -> Iterator[tuple[str, dict[str, bytes] | BadRow]]:
    """``(key, fields)`` per sample of a WebDataset tar, streamed (plain or gzipped).

    A sample is a run of consecutive members sharing the part of the name before the first dot of
    its file name (webdataset's own ``base_plus_ext`` rule); field names are the rest, lower-cased.
    A sample naming a field twice becomes a ``bad_sample`` BadRow. A tar that cannot be read to
    the end (truncated, corrupt) yields one ``bad_shard`` BadRow for the sample being read, then
    stops: what came before it is kept.
    """
    from webdataset.tariterators import base_plus_ext

    key: str | None = None
    fields: dict[str, bytes] = {}
    duplicate: str | None = None

    def finished() -> tuple[str, dict[str, bytes] | BadRow]:
        if duplicate is not None:
            return key, BadRow("bad_sample", f"{path}: {key}: field {duplicate!r} appears twice")
        return key, fields

    try:
        with tarfile.open(path, "r|*") as stream:
            for member in stream:
                if not member.isreg() or is_meta_member(member.name):
                    continue
                prefix, suffix = base_plus_ext(member.name)
                if prefix is None:
                    continue
                if prefix != key:
                    if key is not None:
                        yield finished()
                    key, fields, duplicate = prefix, {}, None
                data = stream.extractfile(member).read()  # a truncated tar fails here: key is this sample
                suffix = suffix.lower()
                if suffix in fields:
                    duplicate = suffix
                fields[suffix] = data
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        yield key or "?", BadRow("bad_shard", f"{path}: cannot be read to the end ({error})")
        return
    if key is not None:
        yield finished()


def is_tar_name(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES)


def expand_shards(spec: str) -> list[Path]:
    """The tar files ``spec`` names: a directory's tars (sorted), a glob (sorted), brace notation
    and ``::``-separated lists (webdataset's ``expand_urls``, in its order) or one file; DataError
    when one is missing."""
    path = Path(spec)
    if path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.is_file() and is_tar_name(p.name))
        if not shards:
            raise DataError(f"{spec}: no {'/'.join(TAR_SUFFIXES)} files in this directory")
        return shards
    if "{" in spec or "::" in spec:
        from webdataset.shardlists import expand_urls

        shards = [Path(name) for name in expand_urls(spec)]
    elif any(char in spec for char in "*?["):
        shards = sorted(Path(name) for name in glob.glob(spec))
        if not shards:
            raise DataError(f"{spec}: no file matches this pattern")
    else:
        shards = [path]
    missing = [shard for shard in shards if not shard.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more of the {len(shards)} named)" if len(missing) > 1 else ""
        raise DataError(f"{missing[0]}: WebDataset shard not found{more}")
    return shards


class WebDatasetSource(FileSource):
    """Samples of existing WebDataset shards, in shard order, to be re-indexed by ``clipkit shard``."""

    name = "webdataset"

    def __init__(self, spec: str, **common: Any) -> None:
        """``common``: ``strict``, ``workers``, ``max_caption_chars`` (see :class:`FileSource`)."""
        super().__init__(spec, **common)
        self.spec = spec
        self.shards = expand_shards(spec)

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for shard in self.shards:
            for key, fields in tar_records(shard):
                where = f"{shard}: {key}"
                yield where, lambda k=key, w=where, f=fields: self.build(k, w, f)

    def build(self, key: str, where: str, fields: dict[str, bytes] | BadRow) -> Sample:
        if isinstance(fields, BadRow):
            raise fields
        return make_sample(key, where, *record_parts(fields, where), self.max_caption_chars)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "path": self.spec, "shards": len(self.shards)}


# --------------------------------------------------------------------------------------------
# img2dataset output folders


def is_img2dataset_folder(path: Path) -> bool:
    """A directory (not a clipkit shard directory) holding img2dataset's ``NNNNN_stats.json``."""
    if not path.is_dir() or (path / MANIFEST).is_file():
        return False
    return any(re.fullmatch(r"\d+" + re.escape(STATS_SUFFIX), p.name) for p in path.iterdir())


@dataclass(frozen=True)
class Img2DatasetShard:
    """One img2dataset shard ``NNNNN``: its data (format "files", "webdataset", "parquet", or
    "none" when only the stats remain) and its parsed ``NNNNN_stats.json`` (None if absent)."""

    name: str
    format: str
    data: Path | None
    stats_path: Path
    stats: dict[str, Any] | None
    image_field: str | None = None  # the parquet format's image column


def img2dataset_shards(root: Path) -> list[Img2DatasetShard]:
    names = set()
    for entry in root.iterdir():
        match = re.fullmatch(r"(\d+)(_stats\.json|\.tar|\.parquet|\.tfrecord|)", entry.name)
        if match and (match.group(2) or entry.is_dir()):
            names.add(match.group(1))
    return [img2dataset_shard(root, name) for name in sorted(names)]


def img2dataset_shard(root: Path, name: str) -> Img2DatasetShard:
    stats_path = root / f"{name}{STATS_SUFFIX}"
    stats = read_stats(stats_path)
    if (root / name).is_dir():
        return Img2DatasetShard(name, "files", root / name, stats_path, stats)
    if (root / f"{name}.tar").is_file():
        return Img2DatasetShard(name, "webdataset", root / f"{name}.tar", stats_path, stats)
    if (root / f"{name}.tfrecord").is_file():
        raise DataError(
            f"{root / name}.tfrecord: img2dataset's tfrecord output is not supported; "
            "download with output_format webdataset, parquet or files"
        )
    parquet = root / f"{name}.parquet"
    if parquet.is_file():
        # Without a folder or tar beside it, this parquet is the data (output_format "parquet").
        columns = parquet_columns(parquet)
        image_field = next((field for field in IMAGE_FIELDS if field in columns), None)
        if image_field is None:
            raise DataError(
                f"{parquet}: no image column ({'/'.join(IMAGE_FIELDS)}), and no {name}/ folder or "
                f"{name}.tar beside it: not an img2dataset shard with images"
            )
        return Img2DatasetShard(name, "parquet", parquet, stats_path, stats, image_field)
    return Img2DatasetShard(name, "none", None, stats_path, stats)


def read_stats(path: Path) -> dict[str, Any] | None:
    """img2dataset's per-shard stats (``count``, ``successes``, ``failed_to_download``, ...)."""
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a readable img2dataset stats file ({error})") from None
    if not (
        isinstance(stats, dict)
        and isinstance(stats.get("count"), int)
        and isinstance(stats.get("successes"), int)
    ):
        raise DataError(f"{path}: expected img2dataset stats with integer 'count' and 'successes'")
    return stats


def check_status(meta: Mapping[str, Any], where: str) -> None:
    status = meta.get("status")
    if status is not None and status != "success":
        raise BadRow(
            "failed_download", f"{where}: img2dataset status {status!r} ({meta.get('error_message')})"
        )


class Img2DatasetSource(FileSource):
    """An img2dataset output folder, shard by shard; within a shard, its samples then its failures."""

    name = "img2dataset"

    def __init__(self, path: Path | str, **common: Any) -> None:
        """``common``: ``strict``, ``workers``, ``max_caption_chars`` (see :class:`FileSource`)."""
        super().__init__(path, **common)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: not a directory (an img2dataset output folder)")
        self.shards = img2dataset_shards(self.path)
        if not self.shards:
            raise DataError(
                f"{self.path}: no img2dataset shards "
                "(NNNNN_stats.json with NNNNN/, NNNNN.tar or NNNNN.parquet)"
            )

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for shard in self.shards:
            if shard.format == "files":
                yield from self.folder_candidates(shard.data)
            elif shard.format == "webdataset":
                for key, fields in tar_records(shard.data):
                    where = f"{shard.data}: {key}"
                    yield where, lambda k=key, w=where, f=fields: self.build(k, w, f)
            elif shard.format == "parquet":
                yield from self.parquet_candidates(shard)
            else:
                yield from self.lost_candidates(shard)
            if shard.format != "parquet":  # a parquet shard keeps its failures as rows
                yield from self.failure_candidates(shard)

    def __len__(self) -> int:
        """Samples plus failures; from the stats files when every shard has one (no data read)."""
        if self._length is None and all(shard.stats is not None for shard in self.shards):
            self._length = sum(shard.stats["count"] for shard in self.shards)
        return super().__len__()

    def folder_candidates(self, folder: Path) -> Iterator[tuple[str, Callable[[], Sample]]]:
        from webdataset.tariterators import base_plus_ext

        records: dict[str, dict[str, Path]] = {}
        for file in folder.iterdir():
            prefix, suffix = base_plus_ext(file.name)
            if prefix is not None and file.is_file():
                records.setdefault(prefix, {})[suffix.lower()] = file
        for key in sorted(records):
            where = str(folder / key)
            yield where, lambda k=key, w=where, f=records[key]: self.build(k, w, f)

    def build(self, key: str, where: str, fields: Mapping[str, bytes | Path] | BadRow) -> Sample:
        if isinstance(fields, BadRow):
            raise fields
        image, captions, meta = record_parts(fields, where)
        check_status(meta, where)
        return make_sample(key, where, image, captions, meta, self.max_caption_chars)

    def parquet_candidates(self, shard: Img2DatasetShard) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for row, record in parquet_records(shard.data):
            key = record.get("key") if isinstance(record, dict) else None
            where = f"{shard.data}: row {row}" + (f" (key {key})" if key else "")
            yield where, lambda r=row, w=where, p=record: self.build_row(r, w, p, shard.image_field)

    def build_row(self, row: int, where: str, record: dict[str, Any] | BadRow, image_field: str) -> Sample:
        if isinstance(record, BadRow):
            raise record
        check_status(record, where)
        # img2dataset's parquet keeps the input's caption column as "caption" (there is no "txt"
        # column, unlike its tars); no such column = an input without captions.
        field = next((name for name in CAPTION_FIELDS if name in record), None)
        captions = None if field is None else [] if record[field] is None else [record[field]]
        meta = {
            name: value
            for name, value in record.items()
            if name != image_field and name not in CAPTION_FIELDS
        }
        key = str(record.get("key") or row)
        return make_sample(key, where, record.get(image_field), captions, meta, self.max_caption_chars)

    def lost_candidates(self, shard: Img2DatasetShard) -> Iterator[tuple[str, Callable[[], Sample]]]:
        """One ``missing_image`` per sample a shard's stats say was downloaded when its data (the
        folder, tar or parquet) is gone: counted, not dropped unseen."""
        successes = int((shard.stats or {}).get("successes") or 0)
        detail = (
            f"{shard.stats_path}: {successes} downloaded samples, but no {shard.name}/, {shard.name}.tar "
            f"or {shard.name}.parquet holds them"
        )
        lost = functools.partial(fail, "missing_image", detail)
        for number in range(1, successes + 1):
            yield f"{shard.stats_path}: lost sample {number}", lost

    def failure_candidates(self, shard: Img2DatasetShard) -> Iterator[tuple[str, Callable[[], Sample]]]:
        """One ``failed_download`` per sample img2dataset could not fetch or resize; "files" and
        "webdataset" output keep only their number (and error messages) in the stats file."""
        if shard.stats is None:
            return
        count, failed = shard.stats["count"], shard.stats["count"] - shard.stats["successes"]
        errors = shard.stats.get("status_dict") or {}
        common = sorted(((n, e) for e, n in errors.items() if e != "success"), reverse=True)[:3]
        detail = f"{failed} of {count} samples failed in img2dataset" + (
            f"; most common errors: {'; '.join(f'{e} ({n})' for n, e in common)}" if common else ""
        )
        for number in range(1, failed + 1):
            yield (
                f"{shard.stats_path}: failed sample {number}",
                functools.partial(fail, "failed_download", detail),
            )

    def info(self) -> dict[str, Any]:
        formats = sorted({shard.format for shard in self.shards} - {"none"})
        return {**super().info(), "formats": formats, "shards": len(self.shards)}
