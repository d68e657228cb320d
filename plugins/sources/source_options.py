"""The ``-o key=value`` options the built-in sources read, and the check that refuses the others
(called by the built-in ``open_source`` hook, :mod:`clipkit.plugins.sources`). Apart from
:mod:`.source_base` because it lists every source's options: the sources import the base, this
module imports them."""

from __future__ import annotations

from typing import Any

from clipkit.data.download import Downloader
from clipkit.errors import DataError

from .idx_source import IDX_OPTIONS
from .source_base import COMMON_OPTIONS
from .table_source import TABLE_OPTIONS


def known_options() -> list[str]:
    """Every ``-o key=value`` some built-in source reads, sorted: the common ones, the table's
    (columns, ``resize``, the downloader's) and the idx files' ``labels``."""
    return sorted({*COMMON_OPTIONS, *TABLE_OPTIONS, *Downloader.OPTION_TYPES, *IDX_OPTIONS})


def check_option_names(options: dict[str, Any]) -> None:
    """DataError naming the keys of ``options`` no built-in source reads, with the known ones: a
    misspelt option (``worker=8``) would otherwise be ignored and the source run with defaults."""
    import difflib

    known = known_options()
    unknown = sorted(key for key in options if key not in known)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    names = ", ".join(repr(key) for key in unknown)
    raise DataError(
        f"unknown source option{'s' if len(unknown) > 1 else ''} {names}{hint}; known: {', '.join(known)}"
    )
