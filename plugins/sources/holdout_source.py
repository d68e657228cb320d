"""``holdout:DATA?fraction=F[&part=train]``: the held-out split of any data source (default part
``holdout``; ``part=train`` gives the rest), by the rule of :func:`clipkit.app.own_data.is_held_out`
(a hash of each sample's key). ``clipkit train --data`` evaluates on this split of the training
data, whose training stream leaves the same samples out (``data.holdout``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from clipkit.contract.types import Sample
from clipkit.errors import DataError

PARTS = ("holdout", "train")
#: Distinct values of a meta-data key collected for zero-shot class names (more: not a class column).
MAX_LABEL_VALUES = 10_000


def open_holdout_source(uri: str, options: dict[str, Any] | None = None):
    """The held-out (or training) part of ``holdout:DATA?fraction=F&part=P``, or None for
    another URI form."""
    from clipkit.app.own_data import HOLDOUT_SCHEME

    if not uri.startswith(HOLDOUT_SCHEME):
        return None
    inner, fraction, part = parse_holdout_uri(uri)
    from clipkit.data.shard import open_source as open_inner

    return HoldoutSource(open_inner(inner, options), inner, fraction, part)


def parse_holdout_uri(uri: str) -> tuple[str, float, str]:
    """``holdout:DATA?fraction=F&part=P`` -> (DATA, F, P); DataError naming the URI otherwise."""
    from clipkit.app.own_data import HOLDOUT_SCHEME, check_fraction

    inner, _, query = uri[len(HOLDOUT_SCHEME) :].rpartition("?")
    params = dict(parse_qsl(query))
    unknown = set(params) - {"fraction", "part"}
    if not inner or "fraction" not in params or unknown:
        raise DataError(f"{uri}: expected holdout:DATA?fraction=F[&part=holdout|train]")
    part = params.get("part", "holdout")
    if part not in PARTS:
        raise DataError(f"{uri}: part must be one of {', '.join(PARTS)}, got {part!r}")
    try:
        fraction = check_fraction(float(params["fraction"]), uri)
    except ValueError:
        raise DataError(f"{uri}: fraction {params['fraction']!r} is not a number") from None
    return inner, fraction, part


class HoldoutSource:
    """The samples of ``source`` in (``part="holdout"``) or out of (``"train"``) the held-out split."""

    def __init__(self, source, data: str, fraction: float, part: str) -> None:
        self.source, self.data, self.fraction, self.part = source, data, fraction, part
        self.values: dict[str, set] = {}

    def __iter__(self) -> Iterator[Sample]:
        from clipkit.app.own_data import is_held_out

        wanted = self.part == "holdout"
        self.values = {}
        for sample in self.source:
            self.note_values(sample.meta)
            if is_held_out(sample.key, self.fraction) == wanted:
                yield sample

    def note_values(self, meta: dict[str, Any]) -> None:
        """Collect each categorical meta-data key's values over the whole data (both parts), so a
        zero-shot task on a small held-out part still knows every class."""
        for key, value in meta.items():
            if key == "index" or isinstance(value, (float, list)) or value is None:
                continue
            seen = self.values.setdefault(key, set())
            if len(seen) < MAX_LABEL_VALUES:
                seen.add(value)

    def info(self) -> dict[str, Any]:
        """The source's info, ``split`` and ``label_values`` (key -> every value seen, all parts)."""
        info = dict(self.source.info()) if hasattr(self.source, "info") else {}
        info["split"] = {"part": self.part, "fraction": self.fraction, "of": self.data}
        info["label_values"] = {key: sorted(values, key=str) for key, values in self.values.items()}
        return info
