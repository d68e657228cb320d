"""Parquet reading for the table and img2dataset sources (pyarrow, imported lazily).

Rows are read a row group and a batch at a time with buffered column reads, so a table of image
bytes never sits in memory whole; cells become plain, JSON-friendly Python values.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clipkit import install_hint
from clipkit.errors import DataError

from .source_base import BadRow

#: Rows per parquet read: bounds memory for tables of image bytes (~100 KB a row -> ~25 MB a batch).
PARQUET_BATCH_ROWS = 256
#: Buffered column-chunk reads: unbuffered, pyarrow reads a whole column chunk (a whole row group of
#: image bytes) at once; buffered, the peak stays flat as row groups grow (measured: a 400 MB row
#: group read in batches peaks ~160 MB above the interpreter, against the whole chunk unbuffered).
PARQUET_BUFFER_BYTES = 1 << 20


def open_parquet(path: Path):
    """A ``pyarrow.parquet.ParquetFile``; DataError when pyarrow is missing or the file is unreadable."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow: pip install pyarrow, or {install_hint('parquet')}"
        ) from None
    if not Path(path).is_file():
        raise DataError(f"{path}: parquet file not found")
    try:
        return pq.ParquetFile(path, buffer_size=PARQUET_BUFFER_BYTES)
    except Exception as error:  # pyarrow.ArrowInvalid / OSError for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({error})") from None


def parquet_columns(path: Path) -> list[str]:
    return list(open_parquet(path).schema_arrow.names)


def parquet_row_count(path: Path) -> int:
    return int(open_parquet(path).metadata.num_rows)


def parquet_records(path: Path, columns: list[str] | None = None) -> Iterator[tuple[int, dict | BadRow]]:
    """``(row number, row dict)`` for every row, read a row group and a batch at a time.

    A row group that cannot be decoded yields a ``bad_row`` BadRow for each of its rows not yet
    read (the file's metadata says how many), so counts stay per row and later groups still load.
    Values are plain Python: see :func:`plain_value`.
    """
    import pyarrow as pa

    parquet = open_parquet(path)
    first = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        done = 0
        try:
            batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns)
            for batch in batches:
                for record in batch.to_pylist():
                    yield first + done, {name: plain_value(value) for name, value in record.items()}
                    done += 1
        except (pa.ArrowException, OSError) as error:
            for lost in range(done, rows):
                yield first + lost, BadRow("bad_row", f"{path}: row group {group} cannot be read ({error})")
        first += rows


def plain_value(value: Any) -> Any:
    """A parquet cell as JSON-friendly Python: an image struct ``{"bytes", "path"}`` (Hugging Face
    datasets) becomes its bytes (or its path when the bytes are not embedded); dates and times
    become ISO strings and decimals floats, so they can be scalar meta."""
    if isinstance(value, dict) and set(value) == {"bytes", "path"}:
        return value["bytes"] if value["bytes"] is not None else value["path"]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value
