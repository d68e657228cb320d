"""Local-file data sources for ``clipkit shard`` and evaluation: tables, caption folders, class folders.

URIs (all ``trylast``, so a third-party ``open_source`` can take any of them over):

* ``PATH.jsonl`` / ``PATH.csv`` / ``PATH.tsv`` [``?image=COL&caption=COL1,COL2&meta=COL3,COL4``]:
  one row per image. Defaults: the image column is the first of ``image``, ``file``, ``path``; the
  caption columns are those of ``caption``, ``captions`` present (a string, or in JSONL a list of
  strings, so COCO's 5 captions per image stay together); meta is every other scalar column.
  Image paths are relative to the table's directory (absolute paths are kept). Key = data row number.
* ``folder:PATH`` (or a bare directory whose images have same-stem ``.txt`` files): images with
  same-stem ``.txt`` captions (one per line) and optional same-stem ``.json`` meta objects.
* ``classes:PATH``: ``PATH/<class>/<images>`` for zero-shot evaluation; meta ``{"label": index,
  "class": name}``, caption "a photo of a {name}.", and ``info()["labels"]["class"]`` in the format
  :func:`clipkit.plugins.synthetic_shapes.zero_shot_labels` uses (``classes`` + ``templates``).

A bad row (missing or unreadable image, empty or non-UTF-8 caption, unparsable line) is skipped and
counted by reason in ``source.skipped``; ``info()`` reports those counts after a full iteration. With
``options["strict"]`` true the first bad row raises :class:`clipkit.errors.DataError` naming the file
and row instead. Torch is never imported here.
"""

from __future__ import annotations

import abc
import csv
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from clipkit.errors import DataError
from clipkit.hookspecs import hookimpl
from clipkit.types import Sample

TABLE_DELIMITERS = {".jsonl": None, ".csv": ",", ".tsv": "\t"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: PIL format -> the shard field name; only encodings clipkit.shard.decode_record reads back.
PIL_FORMAT_EXT = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "BMP": "bmp"}
DEFAULT_IMAGE_COLUMNS = ("image", "file", "path")
DEFAULT_CAPTION_COLUMNS = ("caption", "captions")
TABLE_QUERY_KEYS = ("image", "caption", "meta")
CLASS_TEMPLATE = "a photo of a {}."
MANIFEST = "manifest.json"  # clipkit.shard.MANIFEST; a shard directory is not a caption folder


@hookimpl(trylast=True)
def open_source(uri, options):
    return open_file_source(uri, options)


def open_file_source(uri: str, options: dict[str, Any] | None = None):
    """The file source for ``uri`` (see module docs), or None when ``uri`` is not a local-file URI."""
    options = dict(options or {})
    strict = truthy(options.get("strict", False))
    if uri.startswith("folder:"):
        return CaptionFolderSource(uri[len("folder:") :], strict=strict)
    if uri.startswith("classes:"):
        return ClassFolderSource(uri[len("classes:") :], strict=strict)
    if "://" in uri:
        return None
    path, _, query = uri.partition("?")
    if Path(path).suffix.lower() in TABLE_DELIMITERS:
        return TableSource(path, **table_columns(uri, query, options), strict=strict)
    if not query and is_caption_folder(Path(uri)):
        return CaptionFolderSource(uri, strict=strict)
    return None


def truthy(value: Any) -> bool:
    """Options from a CLI arrive as strings: "false" and "0" must mean False."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def table_columns(uri: str, query: str, options: dict[str, Any]) -> dict[str, Any]:
    """Column choices from ``options`` overridden by the URI query: image (str), caption/meta (lists)."""
    chosen: dict[str, Any] = {key: options[key] for key in TABLE_QUERY_KEYS if options.get(key) is not None}
    seen: set[str] = set()
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in TABLE_QUERY_KEYS:
            raise DataError(f"{uri}: unknown query parameter {key!r}; known: {', '.join(TABLE_QUERY_KEYS)}")
        if key in seen:
            raise DataError(f"{uri}: query parameter {key!r} given more than once")
        seen.add(key)
        chosen[key] = value
    for key in ("caption", "meta"):
        if isinstance(chosen.get(key), str):
            chosen[key] = [column for column in chosen[key].split(",") if column]
    return {"image_column": chosen.get("image"), "caption_columns": chosen.get("caption"),
            "meta_columns": chosen.get("meta")}  # fmt: skip


def is_caption_folder(path: Path) -> bool:
    """A directory (not a shard directory) with at least one top-level image that has a .txt caption."""
    if not path.is_dir() or (path / MANIFEST).is_file():
        return False
    return any(image.with_suffix(".txt").is_file() for image in image_files(path, recursive=False))


def image_files(directory: Path, *, recursive: bool = True) -> list[Path]:
    """Image files under ``directory`` (hidden ones left out), sorted so keys and order are stable."""
    candidates = directory.rglob("*") if recursive else directory.iterdir()
    return sorted(
        path
        for path in candidates
        if path.suffix.lower() in IMAGE_SUFFIXES
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )


# --------------------------------------------------------------------------------------------
# Shared machinery: bad rows are skipped (and counted) or, in strict mode, raised


class BadRow(Exception):
    """One row cannot become a sample; ``reason`` is the key it is counted under in ``skipped``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def read_image(path: Path) -> tuple[bytes, str]:
    """The file's bytes and shard extension; BadRow if it is missing or not a readable image.

    ``Image.verify`` checks structure and checksums without decoding the pixels (cheap; a JPEG
    truncated inside its entropy-coded data can still pass).
    """
    from PIL import Image

    try:
        data = path.read_bytes()
    except OSError as error:
        raise BadRow("missing_image", f"image {path} cannot be read ({error.strerror or error})") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image_format = image.format
            image.verify()
    except Exception as error:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError)
        raise BadRow("bad_image", f"image {path} is not a readable image ({error})") from None
    if image_format not in PIL_FORMAT_EXT:
        raise BadRow("bad_image", f"image {path}: unsupported format {image_format}")
    return data, PIL_FORMAT_EXT[image_format]


def clean_captions(values: list[Any], where: str) -> tuple[str, ...]:
    """Stripped non-empty captions; BadRow for a non-string, non-UTF-8 text or no caption at all."""
    captions = []
    for value in values:
        if not isinstance(value, str):
            raise BadRow("bad_caption", f"{where}: caption {value!r} is not a string")
        check_utf8(value, where)
        if value.strip():
            captions.append(value.strip())
    if not captions:
        raise BadRow("empty_caption", f"{where}: no non-empty caption")
    return tuple(captions)


def check_utf8(text: str, where: str) -> None:
    # Text read with errors="surrogateescape" keeps undecodable bytes as lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRow("bad_encoding", f"{where}: text is not valid UTF-8") from None


class FileSource(abc.ABC):
    """Base of the file sources: iteration that skips-and-counts (or raises on) bad rows.

    Subclasses implement ``candidates()`` yielding ``(where, build)``: ``where`` names the file and
    row for messages, ``build()`` returns the :class:`Sample` or raises :class:`BadRow`.
    """

    name = "files"

    def __init__(self, path: Path | str, *, strict: bool = False) -> None:
        self.path = Path(path)
        self.strict = strict
        self.skipped: dict[str, int] = {}
        self.yielded = 0
        self.complete = False
        self._length: int | None = None

    @abc.abstractmethod
    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        """Every row or file of the source as ``(where, build)``, in a stable order."""

    def __iter__(self) -> Iterator[Sample]:
        self.skipped, self.yielded, self.complete = {}, 0, False
        for where, build in self.candidates():
            try:
                sample = build()
            except BadRow as bad:
                if self.strict:
                    raise DataError(f"{where}: {bad.reason}: {bad.detail}") from None
                self.skipped[bad.reason] = self.skipped.get(bad.reason, 0) + 1
                continue
            self.yielded += 1
            yield sample
        self.complete = True

    def __len__(self) -> int:
        """Rows (or images) found; an upper bound on the samples yielded, as bad ones are skipped."""
        if self._length is None:
            self._length = sum(1 for _ in self.candidates())
        return self._length

    def info(self) -> dict[str, Any]:
        """Name and path; after a full iteration also ``n`` (samples yielded) and ``skipped``."""
        info: dict[str, Any] = {"name": self.name, "path": str(self.path)}
        if self.complete:
            info.update(n=self.yielded, skipped=dict(sorted(self.skipped.items())))
        return info


# --------------------------------------------------------------------------------------------
# Tables


def parse_scalar(text: str) -> int | float | str:
    """A CSV cell as int, else float, else the string itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


class TableSource(FileSource):
    """Rows of a JSONL / CSV / TSV table, one image (with its captions and meta) per row."""

    name = "table"

    def __init__(
        self,
        path: Path | str,
        *,
        image_column: str | None = None,
        caption_columns: list[str] | None = None,
        meta_columns: list[str] | None = None,
        strict: bool = False,
    ) -> None:
        super().__init__(path, strict=strict)
        if not self.path.is_file():
            raise DataError(f"{self.path}: table not found")
        self.delimiter = TABLE_DELIMITERS[self.path.suffix.lower()]
        self.image_column, self.caption_columns = image_column, caption_columns
        self.meta_columns = meta_columns
        if self.delimiter is not None:
            self.check_header()

    def info(self) -> dict[str, Any]:
        columns = {"image": self.image_column, "caption": self.caption_columns, "meta": self.meta_columns}
        return {**super().info(), "columns": {k: v for k, v in columns.items() if v is not None}}

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        rows = self.json_rows() if self.delimiter is None else self.delimited_rows()
        for row_index, (where, parsed) in enumerate(rows):
            yield where, lambda i=row_index, w=where, p=parsed: self.build(i, w, p)

    def build(self, row_index: int, where: str, parsed: dict[str, Any] | BadRow) -> Sample:
        if isinstance(parsed, BadRow):
            raise parsed
        image_column = self.image_column or next((c for c in DEFAULT_IMAGE_COLUMNS if c in parsed), None)
        relative = parsed.get(image_column) if image_column else None
        if not isinstance(relative, str) or not relative.strip():
            raise BadRow("missing_image", f"{where}: no image path in column {image_column or 'image'!r}")
        check_utf8(relative, where)
        image, image_ext = read_image(self.path.parent / relative.strip())  # an absolute path wins
        caption_columns = self.caption_columns or [c for c in DEFAULT_CAPTION_COLUMNS if c in parsed]
        values = [v for column in caption_columns for v in self.caption_values(parsed.get(column))]
        captions = clean_captions(values, where)
        used = {image_column, *caption_columns}
        if self.meta_columns is not None:
            meta = {c: parsed[c] for c in self.meta_columns if c in parsed}
        else:
            meta = {c: v for c, v in parsed.items() if c not in used and is_scalar(v)}
        return Sample(key=str(row_index), image=image, image_ext=image_ext, captions=captions, meta=meta)

    def caption_values(self, value: Any) -> list[Any]:
        """A cell's captions: a JSON list stays a list; in CSV a cell holding a JSON list is parsed."""
        if value is None:
            return []
        if isinstance(value, list):
            return value
        if self.delimiter is not None and isinstance(value, str) and value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                return [value]
            return parsed if isinstance(parsed, list) else [value]
        return [value]

    def json_rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        """(where, row object or BadRow) per non-blank line; decoding each line alone keeps one bad
        line from spoiling the rest."""
        with self.path.open("rb") as stream:
            for line_number, raw in enumerate(stream, 1):
                if not raw.strip():
                    continue
                where = f"{self.path}: line {line_number}"
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    yield where, BadRow("bad_encoding", f"{where}: line is not valid UTF-8")
                    continue
                except json.JSONDecodeError as error:
                    yield where, BadRow("bad_line", f"{where}: invalid JSON ({error})")
                    continue
                if not isinstance(row, dict):
                    kind = type(row).__name__
                    yield where, BadRow("bad_line", f"{where}: expected a JSON object, got {kind}")
                    continue
                yield where, row

    def open_text(self):
        return self.path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")

    def check_header(self) -> None:
        """Fail early (not per row) when a named column is absent or the default ones are."""
        with self.open_text() as stream:
            header = next(csv.reader(stream, delimiter=self.delimiter), [])
        missing = [c for c in [self.image_column, *(self.caption_columns or []), *(self.meta_columns or [])]
                   if c is not None and c not in header]  # fmt: skip
        if self.image_column is None and not any(c in header for c in DEFAULT_IMAGE_COLUMNS):
            missing.append(" or ".join(DEFAULT_IMAGE_COLUMNS))
        if self.caption_columns is None and not any(c in header for c in DEFAULT_CAPTION_COLUMNS):
            missing.append(" or ".join(DEFAULT_CAPTION_COLUMNS))
        if missing:
            raise DataError(f"{self.path}: missing column(s) {', '.join(missing)}; header is {header}")

    def delimited_rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        with self.open_text() as stream:
            reader = csv.reader(stream, delimiter=self.delimiter)
            header = next(reader, [])
            while True:
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as error:
                    where = f"{self.path}: line {reader.line_num}"
                    yield where, BadRow("bad_line", f"{where}: {error}")
                    continue
                if not any(cell.strip() for cell in cells):
                    continue
                where = f"{self.path}: line {reader.line_num}"
                yield where, self.delimited_row(header, cells, where)

    def delimited_row(self, header: list[str], cells: list[str], where: str) -> dict[str, Any] | BadRow:
        if len(cells) != len(header):
            return BadRow("bad_line", f"{where}: {len(cells)} fields, the header has {len(header)}")
        try:
            for cell in cells:
                check_utf8(cell, where)
        except BadRow as bad:
            return bad
        # Captions and image paths stay strings ("42" is a caption, not a number); meta is parsed.
        text_columns = {*(self.caption_columns or DEFAULT_CAPTION_COLUMNS), *DEFAULT_IMAGE_COLUMNS}
        text_columns.add(self.image_column)
        return {
            column: cell if column in text_columns else parse_scalar(cell)
            for column, cell in zip(header, cells, strict=True)
        }


# --------------------------------------------------------------------------------------------
# Folders


class CaptionFolderSource(FileSource):
    """Images under a directory with same-stem ``.txt`` captions (one per line) and ``.json`` meta."""

    name = "folder"

    def __init__(self, path: Path | str, *, strict: bool = False) -> None:
        super().__init__(path, strict=strict)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: not a directory")

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for image_path in image_files(self.path):
            yield str(image_path), lambda p=image_path: self.build(p)

    def build(self, image_path: Path) -> Sample:
        where = str(image_path)
        caption_path = image_path.with_suffix(".txt")
        try:
            text = caption_path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise BadRow("missing_caption", f"{where}: no caption file {caption_path.name}") from None
        except UnicodeDecodeError:
            raise BadRow("bad_encoding", f"{caption_path}: not valid UTF-8") from None
        captions = clean_captions(text.splitlines(), str(caption_path))
        image, image_ext = read_image(image_path)
        key = image_path.relative_to(self.path).with_suffix("").as_posix()
        meta = self.meta(image_path)
        return Sample(key=key, image=image, image_ext=image_ext, captions=captions, meta=meta)

    def meta(self, image_path: Path) -> dict[str, Any]:
        meta_path = image_path.with_suffix(".json")
        if not meta_path.is_file():
            return {}
        try:
            meta = json.loads(meta_path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise BadRow("bad_meta", f"{meta_path}: invalid JSON ({error})") from None
        if not isinstance(meta, dict):
            raise BadRow("bad_meta", f"{meta_path}: expected a JSON object")
        return meta


def class_name(folder: str) -> str:
    """Folder name -> class name in prompts ("golden_retriever" -> "golden retriever")."""
    return folder.replace("_", " ")


class ClassFolderSource(FileSource):
    """``PATH/<class>/<images>``: a labelled evaluation set; classes are the sorted folder names."""

    name = "classes"

    def __init__(self, path: Path | str, *, strict: bool = False) -> None:
        super().__init__(path, strict=strict)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: not a directory")
        folders = (p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.folders = sorted(folders)
        if not self.folders:
            raise DataError(f"{self.path}: no class sub-directories")
        self.classes = [class_name(folder) for folder in self.folders]

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for label, folder in enumerate(self.folders):
            for image_path in image_files(self.path / folder):
                yield str(image_path), lambda p=image_path, i=label: self.build(p, i)

    def build(self, image_path: Path, label: int) -> Sample:
        image, image_ext = read_image(image_path)
        name = self.classes[label]
        return Sample(
            key=image_path.relative_to(self.path).with_suffix("").as_posix(),
            image=image,
            image_ext=image_ext,
            captions=(CLASS_TEMPLATE.format(name),),
            meta={"label": label, "class": name},
        )

    def info(self) -> dict[str, Any]:
        labels = {"classes": list(self.classes), "templates": [CLASS_TEMPLATE]}
        return {**super().info(), "labels": {"class": labels}}
