"""``holdout:DATA?fraction=F[&by=COLUMN][&part=train]``: the held-out split of any data source
(default part ``holdout``; ``part=train`` gives the rest), by the rule of
:class:`clipkit.app.own_data.Holdout` (a hash of each sample's key, or of its ``by`` column's value:
all rows of a group on one side). ``clipkit train --data`` evaluates on this split of the training
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


def holdout_by(uri: str) -> str | None:
    """The ``by`` column of a ``holdout:`` URI, or None."""
    return dict(parse_qsl(uri.rpartition("?")[2])).get("by") or None


def parse_holdout_uri(uri: str):
    """``holdout:DATA?fraction=F&by=C&part=P`` -> (DATA, :class:`~clipkit.app.own_data.Holdout` (F, C),
    P); DataError naming the URI otherwise."""
    from clipkit.app.own_data import HOLDOUT_SCHEME, Holdout, check_fraction

    inner, _, query = uri[len(HOLDOUT_SCHEME) :].rpartition("?")
    params = dict(parse_qsl(query))
    unknown = set(params) - {"fraction", "part", "by"}
    if not inner or "fraction" not in params or unknown:
        raise DataError(f"{uri}: expected holdout:DATA?fraction=F[&by=COLUMN][&part=holdout|train]")
    part = params.get("part", "holdout")
    if part not in PARTS:
        raise DataError(f"{uri}: part must be one of {', '.join(PARTS)}, got {part!r}")
    try:
        fraction = check_fraction(float(params["fraction"]), uri)
    except ValueError:
        raise DataError(f"{uri}: fraction {params['fraction']!r} is not a number") from None
    return inner, Holdout(fraction, params.get("by")), part


class HoldoutSource:
    """The samples of ``source`` in (``part="holdout"``) or out of (``"train"``) the held-out split."""

    def __init__(self, source, data: str, fraction: float, part: str) -> None:
        self.source, self.data, self.fraction, self.part = source, data, fraction, part
        self.values: dict[str, set] = {}

    def __iter__(self) -> Iterator[Sample]:
        from clipkit.app.own_data import holdout_rule

        wanted, rule = self.part == "holdout", holdout_rule(self.fraction)
        self.values = {}
        for sample in self.source:
            self.note_values(sample.meta)
            if rule.holds(sample.key, sample.meta) == wanted:
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
        info["split"] = {"part": self.part, "fraction": float(self.fraction), "of": self.data}
        if getattr(self.fraction, "by", None):
            info["split"]["by"] = self.fraction.by
        info["label_values"] = {key: sorted(values, key=str) for key, values in self.values.items()}
        return info
