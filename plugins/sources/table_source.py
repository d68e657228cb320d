"""Table sources: one image (path, URL or encoded bytes) per row of a JSONL / CSV / TSV / parquet
table, with caption and meta-data columns. See :mod:`clipkit.plugins.sources.file_sources` for the URI forms
and options. Torch is never imported here.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from clipkit.contract.types import Sample
from clipkit.errors import DataError

from .source_base import (
    DEFAULT_MAX_CAPTION_CHARS,
    DEFAULT_MAX_IMAGE_BYTES,
    BadRow,
    FileSource,
    check_meta,
    check_utf8,
    clean_captions,
    is_scalar,
    positive_int,
    preview,
    read_image,
    verify_image_bytes,
)

#: Default ``workers`` for a table whose (first) image cell is a URL: downloads wait on the network.
URL_TABLE_WORKERS = 16

if TYPE_CHECKING:
    from clipkit.data.download import Downloader


#: The UTF-8 byte-order mark some editors (Excel, Notepad) put at the start of a text file.
UTF8_BOM = b"\xef\xbb\xbf"
TABLE_DELIMITERS = {".jsonl": None, ".csv": ",", ".tsv": "\t"}
TABLE_SUFFIXES = (*TABLE_DELIMITERS, ".parquet")
DEFAULT_IMAGE_COLUMNS = ("image", "file", "path", "url")  # "url": img2dataset's input tables
DEFAULT_CAPTION_COLUMNS = ("caption", "captions")
#: Numbered caption columns (``caption_0`` .. ``caption_k``), also taken by default, in numeric order.
NUMBERED_CAPTION_COLUMN = re.compile(r"caption_(\d+)")
#: Caption columns of other tools, used when a table has none of the above: the first present.
#: "text": DataComp, Hugging Face datasets; "txt": WebDataset field name; "TEXT": LAION's parquet.
CAPTION_ALIASES = ("text", "txt", "TEXT")
EXPECTED_CAPTION_COLUMNS = "caption, captions, caption_0 .. caption_k, or else " + " / ".join(CAPTION_ALIASES)
TABLE_QUERY_KEYS = ("image", "caption", "meta")
#: The ``-o`` options a table reads besides the common ones and the downloader's.
TABLE_OPTIONS = (*TABLE_QUERY_KEYS, "resize")


def table_options(options: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Table settings: ``common`` (an unset ``workers`` becomes None = automatic), the
    :class:`~clipkit.data.download.Downloader` for URL cells and ``resize`` (None = keep images as
    they are)."""
    from clipkit.data.download import Downloader

    resize = options.get("resize")
    return {
        **common,
        "workers": common["workers"] if options.get("workers") is not None else None,
        "download": Downloader.from_options(options),
        "resize": positive_int(options, "resize", 1) if resize not in (None, "") else None,
    }


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


def default_caption_columns(columns) -> list[str]:
    """The caption columns of a table that names none: those of ``caption``, ``captions`` and
    ``caption_0`` .. ``caption_k`` present (numbered ones in numeric order), else the first of
    :data:`CAPTION_ALIASES` present; [] when there is none."""
    numbered = [c for c in columns if NUMBERED_CAPTION_COLUMN.fullmatch(c)]
    found = [c for c in DEFAULT_CAPTION_COLUMNS if c in columns]
    found += sorted(numbered, key=lambda column: int(column.split("_", 1)[1]))
    alias = next((c for c in CAPTION_ALIASES if c in columns), None)
    return found or ([alias] if alias else [])


def parse_scalar(text: str) -> int | float | str:
    """A CSV cell as int, else finite float, else the string itself.

    "nan", "inf" (or a name like "Nan") stay text: JSON has no such numbers. Python also reads
    "1_000" as a number; a cell written with underscores is text (a code, not a quantity).
    """
    if "_" in text:
        return text
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:  # also a number of more than sys.get_int_max_str_digits() digits
            continue
        if kind is int or math.isfinite(number):
            return number
    return text


class TableSource(FileSource):
    """Rows of a JSONL / CSV / TSV / parquet table, one image (with its captions and meta) per row.

    An image cell starting with ``http://`` or ``https://`` is downloaded by ``download`` (a
    :class:`clipkit.data.download.Downloader`); a failed download skips the row under the downloader's
    reason (``http_404``, ``timeout``, ``too_large``, ``download_failed``, ``bad_url``).
    ``workers=None`` means 16 when the first row's image is a URL, else 1. ``resize=N``
    downscales every image (local or downloaded) whose shorter side exceeds N to exactly N.
    """

    name = "table"

    def __init__(
        self,
        path: Path | str,
        *,
        image_column: str | None = None,
        caption_columns: list[str] | None = None,
        meta_columns: list[str] | None = None,
        strict: bool = False,
        workers: int | None = None,
        download: Downloader | None = None,
        resize: int | None = None,
        max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS,
        background: Any = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    ) -> None:
        from clipkit.data.download import Downloader

        super().__init__(path, strict=strict, workers=workers or 1, max_caption_chars=max_caption_chars,
                         background=background, max_image_bytes=max_image_bytes)  # fmt: skip
        if not self.path.is_file():
            raise DataError(f"{self.path}: table not found")
        self.parquet = self.path.suffix.lower() == ".parquet"
        self.delimiter = TABLE_DELIMITERS.get(self.path.suffix.lower())
        self.image_column, self.caption_columns = image_column, caption_columns
        self.meta_columns = meta_columns
        #: The default caption columns of a table with a header (CSV/TSV/parquet); None for JSONL,
        #: whose rows each have their own keys.
        self.header_captions: list[str] | None = None
        if self.parquet or self.delimiter is not None:
            self.check_header(self.header_columns(), "header")
        else:
            self.check_first_row()
        if resize is not None and int(resize) < 1:
            raise DataError(f"{self.path}: resize must be >= 1, got {resize}")
        self.download, self.resize = download or Downloader(), resize
        self.has_urls = self.first_image_is_url()
        if workers is None and self.has_urls:
            self.workers = URL_TABLE_WORKERS

    def info(self) -> dict[str, Any]:
        columns = {"image": self.image_column, "caption": self.caption_columns, "meta": self.meta_columns}
        info = {**super().info(), "columns": {k: v for k, v in columns.items() if v is not None}}
        if self.has_urls:
            info["download"] = self.download.info()
        if self.resize is not None:
            info["resize"] = self.resize
        return info

    def rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        """(where, row or BadRow) for each data row, in table order."""
        if self.parquet:
            return self.parquet_rows()
        return self.json_rows() if self.delimiter is None else self.delimited_rows()

    def __len__(self) -> int:
        if self.parquet and self._length is None:
            from .parquet_reader import parquet_row_count

            self._length = parquet_row_count(self.path)  # every parquet row is a candidate: no data read
        return super().__len__()

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for row_index, (where, parsed) in enumerate(self.rows()):
            yield where, lambda i=row_index, w=where, p=parsed: self.build(i, w, p)

    def image_cell(self, parsed: dict[str, Any]) -> tuple[str | None, Any]:
        """(image column, its cell) of a row; the column is the first default one present if unset."""
        image_column = self.image_column or next((c for c in DEFAULT_IMAGE_COLUMNS if c in parsed), None)
        return image_column, parsed.get(image_column) if image_column else None

    def first_row(self) -> dict[str, Any] | None:
        """The first well-formed row (None when there is none)."""
        rows = self.rows()
        try:
            return next((p for _, p in rows if not isinstance(p, BadRow)), None)
        finally:
            rows.close()

    def first_image_is_url(self) -> bool:
        """Whether the first well-formed row's image cell is an http(s) URL."""
        from clipkit.data.download import is_url

        parsed = self.first_row()
        cell = self.image_cell(parsed)[1] if parsed is not None else None
        return isinstance(cell, str) and is_url(cell)

    def caption_columns_of(self, parsed: dict[str, Any]) -> list[str]:
        """The caption columns of a row: those named, else the table's (or the row's) defaults."""
        if self.caption_columns:
            return self.caption_columns
        return self.header_captions if self.header_captions is not None else default_caption_columns(parsed)

    def build(self, row_index: int, where: str, parsed: dict[str, Any] | BadRow) -> Sample:
        if isinstance(parsed, BadRow):
            raise parsed
        image_column, cell = self.image_cell(parsed)
        reference = self.image_reference(cell, image_column, where)
        caption_columns = self.caption_columns_of(parsed)
        values = [v for column in caption_columns for v in self.caption_values(parsed.get(column))]
        captions = clean_captions(values, where, self.max_caption_chars)
        used = {image_column, *caption_columns}
        if self.meta_columns is not None:
            meta = {c: parsed[c] for c in self.meta_columns if c in parsed}
        else:
            meta = {c: v for c, v in parsed.items() if c not in used and is_scalar(v)}
        check_meta(meta, where)
        # Read after the (cheap) caption and meta checks, so a row skipped anyway costs no download.
        image, image_ext = self.read_row_image(reference, where)
        return Sample(key=str(row_index), image=image, image_ext=image_ext, captions=captions, meta=meta)

    def image_reference(self, cell: Any, image_column: str | None, where: str) -> str | bytes:
        """What a row's image cell holds: a path or URL (stripped), or, in a binary parquet column
        (img2dataset, Hugging Face datasets), the encoded image itself."""
        if isinstance(cell, bytes):
            return cell
        if not isinstance(cell, str) or not cell.strip():
            raise BadRow("missing_image", f"{where}: no image path in column {image_column or 'image'!r}")
        check_utf8(cell, where)
        return cell.strip()

    def read_row_image(self, cell: str | bytes, where: str) -> tuple[bytes, str]:
        """The image bytes and extension of a row: the cell's own bytes (a binary column), downloaded
        for an http(s) URL (a URL of another scheme, or with credentials, is a ``bad_url`` saying
        so), else read from the path relative to the table (an absolute path wins); resized when
        ``resize`` is set."""
        from clipkit.data.download import DownloadError, has_scheme, is_url, redact, resize_image

        if isinstance(cell, bytes):
            image, image_ext = cell, verify_image_bytes(cell, f"{where}: image bytes")
        elif has_scheme(cell):  # ftp://, s3://, file:// too: the downloader says why it refuses them
            self.has_urls = self.has_urls or is_url(cell)
            try:
                image = self.download.fetch(cell)
            except DownloadError as error:
                raise BadRow(error.reason, f"{where}: {redact(cell)}: {error.detail}") from None
            image_ext = verify_image_bytes(image, f"{where}: download {redact(cell)}")
        else:
            image, image_ext = read_image(self.path.parent / cell, self.max_image_bytes)
        if self.resize is not None:
            try:
                image = resize_image(image, self.resize)
            except Exception as error:  # PIL: OSError, ValueError, DecompressionBombError, ...
                raise BadRow("bad_image", f"{where}: image cannot be resized ({error})") from None
        return image, image_ext

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

    def parquet_rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        """(where, row or BadRow) per parquet row, read a batch at a time. With ``meta`` named, only
        the columns in use are read (embedding or image columns can dwarf the rest of a table)."""
        from .parquet_reader import parquet_records

        columns = None
        if self.meta_columns is not None:
            captions = self.caption_columns or self.header_captions or DEFAULT_CAPTION_COLUMNS
            used = {self.image_column, *DEFAULT_IMAGE_COLUMNS, *captions, *self.meta_columns}
            columns = [column for column in self.header_columns() if column in used]
        for row, record in parquet_records(self.path, columns):
            yield f"{self.path}: row {row}", record

    def json_rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        """(where, row object or BadRow) per non-blank line; decoding each line alone keeps one bad
        line from spoiling the rest."""
        with self.path.open("rb") as stream:
            for line_number, raw in enumerate(stream, 1):
                if line_number == 1:
                    raw = raw.removeprefix(UTF8_BOM)  # as open_text's utf-8-sig does for CSV/TSV
                if not raw.strip():
                    continue
                where = f"{self.path}: line {line_number}"
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    yield where, BadRow("bad_encoding", f"{where}: line is not valid UTF-8")
                    continue
                except (ValueError, RecursionError) as error:  # JSONDecodeError; a huge int; deep nesting
                    yield where, BadRow("bad_line", f"{where}: invalid JSON ({preview(str(error), 200)})")
                    continue
                if not isinstance(row, dict):
                    kind = type(row).__name__
                    yield where, BadRow("bad_line", f"{where}: expected a JSON object, got {kind}")
                    continue
                yield where, row

    def open_text(self):
        return self.path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")

    def header_columns(self) -> list[str]:
        """The column names: a CSV/TSV header row, or a parquet file's schema."""
        if self.parquet:
            from .parquet_reader import parquet_columns

            return parquet_columns(self.path)
        with self.open_text() as stream:
            header = next(self.csv_reader(stream), [])
        repeated = sorted({column for column in header if header.count(column) > 1})
        if repeated:  # a row is a mapping column -> cell: the last cell would win unseen
            raise DataError(f"{self.path}: the header names column(s) {repeated} more than once; rename them")
        return header

    def csv_reader(self, stream):
        """A CSV is read with quoting (RFC 4180), strictly: a stray quote is a bad line, not text
        silently stripped of its quotes. A TSV is read without quoting, as the CC3M/CC12M TSVs are
        written: a quote is part of the caption (``"the hobbit" poster``)."""
        if self.delimiter == "\t":
            return csv.reader(stream, delimiter="\t", quoting=csv.QUOTE_NONE)
        return csv.reader(stream, delimiter=self.delimiter, strict=True)

    def check_header(self, header: list[str], what: str) -> None:
        """Fail early (not per row) when a named column is absent or the default ones are; ``header``:
        the columns of the table (``what``: "header", or for JSONL "first row", where named meta
        columns may be absent: JSONL rows need not all have every key)."""
        meta = (self.meta_columns or []) if what == "header" else []
        missing = [c for c in [self.image_column, *(self.caption_columns or []), *meta]
                   if c is not None and c not in header]  # fmt: skip
        if self.image_column is None and not any(c in header for c in DEFAULT_IMAGE_COLUMNS):
            missing.append(" or ".join(DEFAULT_IMAGE_COLUMNS))
        if not self.caption_columns:
            captions = default_caption_columns(header)
            if not captions:
                missing.append(f"a caption column ({EXPECTED_CAPTION_COLUMNS})")
            if what == "header":
                self.header_captions = captions
        if missing:
            raise DataError(
                f"{self.path}: missing column(s) {'; '.join(missing)}; the {what} has {header}. Name the "
                "columns to use with PATH?image=COL&caption=COL1,COL2 (or -o image=COL -o caption=COL)"
            )

    def check_first_row(self) -> None:
        """A JSONL table has no header: its first well-formed row is checked as one, for the image
        and caption columns (a later row without them is skipped and counted)."""
        first = self.first_row()
        if first is not None:
            self.check_header(list(first), "first row")

    def delimited_rows(self) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
        with self.open_text() as stream:
            reader = self.csv_reader(stream)
            header = next(reader, [])
            while True:
                first_line = reader.line_num + 1
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as error:
                    if "unexpected end of data" in str(error):
                        # A quote opened and never closed swallowed every line after it into one
                        # field: those rows cannot be read, so the table is refused, not shortened.
                        raise DataError(
                            f"{self.path}: line {first_line}: a quoted field opened here is never closed, "
                            f"so lines {first_line}-{reader.line_num} cannot be read; close or remove the "
                            'quote (inside a quoted field a quote is written "")'
                        ) from None
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
        text_columns = {*(self.caption_columns or self.header_captions or ()), *DEFAULT_IMAGE_COLUMNS}
        text_columns.add(self.image_column)
        return {
            column: cell if column in text_columns else parse_scalar(cell)
            for column, cell in zip(header, cells, strict=True)
        }
