"""Shard sets as ``data.shards`` names them, resolved before anything is read or written.

A shard set is one of:

- a clipkit shard directory (``manifest.json`` beside the tars);
- a local directory of ``.tar`` files without a manifest (``sizes.json`` may give counts);
- a streamed set: a brace-expanded list of local paths or URLs (``shard-{000000..000999}.tar``,
  several groups allowed), ``http(s)://``, ``pipe:COMMAND`` (its standard output is the tar), or
  an fsspec URL (``s3://``, ``gs://``, ``hf://``, ...). Nothing is copied locally.

Counts come from a ``manifest.json`` (clipkit's) or ``sizes.json`` (WebDataset's ``{name: count}``)
beside the shards, when there is one; otherwise ``data.num_samples`` sizes an epoch. A path that
does not exist, an empty folder or one without shards is an error naming it — never synthetic data.

Global sample indices (what NUCLR's and SogCLR's per-sample state is keyed by): with counts, shard
k's samples are numbered from the sum of the counts of the shards listed before it, in tar order
(for a whole clipkit set this is exactly the index stored in each sample's json); without counts,
the ``index`` in each sample's json (clipkit shards carry one), which must be below ``n``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clipkit.config.constraints import MAX_INTEGER
from clipkit.data.remote import (
    FSSPEC_PACKAGES,
    Patience,
    ShardUnavailable,
    check_url,
    read_small,
    redact,
    scheme_of,
)
from clipkit.data.tar_stream import check_local_shards  # a .tar.gz named .tar is refused, named
from clipkit.errors import DataError

MANIFEST, SIZES = "manifest.json", "sizes.json"
BRACES = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")
#: ``data.mixture`` as one string: ``WEIGHT*SHARDS :: WEIGHT*SHARDS`` (the weight defaults to 1).
MIXTURE_SEPARATOR = "::"


@dataclass(frozen=True)
class ShardSet:
    """``urls`` to read (in the listed order) and their sample ``counts`` when known."""

    spec: str
    urls: tuple[str, ...]
    counts: tuple[int, ...] | None = None
    clipkit_directory: bool = False  # a local clipkit shard directory (the samples' json index rules)

    @property
    def num_samples(self) -> int | None:
        return sum(self.counts) if self.counts is not None else None

    @property
    def entries(self) -> list[tuple[str, int]]:
        """[(url, count)] — only with counts."""
        return list(zip(self.urls, self.counts or (), strict=True))

    @property
    def first_indices(self) -> dict[str, int]:
        """url -> global index of its first sample (with counts)."""
        firsts, total = {}, 0
        for url, count in self.entries:
            firsts[url] = total
            total += count
        return firsts

    @property
    def shown(self) -> str:
        return redact(self.spec)


#: URI schemes of clipkit's own sources, which are not shard locations.
OWN_SCHEMES = frozenset({"synthetic"})
OWN_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:(?![/\\])")  # classes:, holdout:, webdataset:, ...


def is_streamed(spec: str) -> bool:
    """Whether ``spec`` names shards by URL or by pattern (as opposed to one local folder, or one
    of clipkit's own source URIs such as ``synthetic://`` and ``webdataset:``)."""
    scheme = scheme_of(spec)
    if scheme:
        return scheme not in OWN_SCHEMES and is_shard_scheme(scheme)
    if OWN_PREFIX.match(spec):
        return False
    return bool(BRACES.search(spec)) or spec.endswith(".tar")


def is_shard_scheme(scheme: str) -> bool:
    """http(s), pipe, file, and every protocol fsspec knows (installed or not: a missing package
    is then named); other schemes belong to data-source plugins."""
    if scheme in ("http", "https", "pipe", "file") or scheme in FSSPEC_PACKAGES:
        return True
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return False
    return scheme in known_implementations


def is_tar_folder(spec: str) -> bool:
    """A local folder of ``.tar`` shards without a clipkit manifest (read as a streamed set)."""
    path = Path(spec)
    return path.is_dir() and not (path / MANIFEST).is_file() and any(path.glob("*.tar"))


class StreamedShardSource:
    """A streamed shard set read back as :class:`~clipkit.contract.types.Sample` records in listed order
    (``clipkit eval --data``, ``--eval-data``); no local copy."""

    def __init__(self, spec: str, patience: Patience = Patience()) -> None:
        self.shards, self.patience = resolve(spec, patience), patience

    def info(self) -> dict:
        return {}

    def __iter__(self):
        from clipkit.data.shard import decode_record
        from clipkit.data.tar_stream import tar_records

        for url in self.shards.urls:
            try:
                for record in tar_records(url, self.patience):
                    yield decode_record(record, redact(url))
            except ShardUnavailable as error:
                raise DataError(f"cannot read shard {error}") from None


def expand(spec: str) -> list[str]:
    """``spec`` with every brace group expanded (``{000..009}`` keeps the zero padding)."""
    import braceexpand

    try:
        return list(braceexpand.braceexpand(spec))
    except Exception as error:  # noqa: BLE001 - braceexpand raises its own UnbalancedBracesError
        raise DataError(f"{spec}: cannot expand its braces ({error})") from error


def resolve(spec: str, patience: Patience = Patience()) -> ShardSet:
    """The :class:`ShardSet` ``spec`` names; a DataError naming the path when there is none."""
    spec = str(spec)
    if not spec:
        raise DataError("data.shards is empty: name a shard directory, a list of shards or a URL")
    if not is_streamed(spec):
        return resolve_directory(Path(spec))
    urls = expand(spec)
    for url in urls:
        check_url(url)
    local = [url for url in urls if scheme_of(url) in ("", "file")]
    missing = [url for url in local if not os.path.isfile(url.removeprefix("file://"))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"data.shards {spec}: {missing[0]} does not exist{more}")
    check_local_shards(local)
    return ShardSet(spec, tuple(urls), shard_counts(urls, spec, patience))


def resolve_directory(path: Path) -> ShardSet:
    from clipkit.data.shard import read_manifest

    if not path.exists():
        raise DataError(f"data.shards {path}: no such file or directory")
    if not path.is_dir():
        raise DataError(f"data.shards {path}: not a shard directory, a .tar file or a URL")
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        urls = tuple(str(path / shard["name"]) for shard in manifest["shards"])
        return ShardSet(str(path), urls, tuple(int(s["count"]) for s in manifest["shards"]), True)
    if not any(path.iterdir()):
        raise DataError(f"data.shards {path}: the directory is empty (no shards)")
    tars = sorted(str(tar) for tar in path.glob("*.tar"))
    if not tars:
        raise DataError(f"data.shards {path}: holds no shards (no {MANIFEST} and no .tar files)")
    check_local_shards(tars)
    return ShardSet(str(path), tuple(tars), shard_counts(tars, str(path), Patience()))


def shard_name(url: str) -> str:
    """The file name of a shard URL, without its query (``shard-0.tar?sig=...`` -> ``shard-0.tar``)."""
    path = url.split("?", 1)[0].split("#", 1)[0] if scheme_of(url) not in ("", "pipe") else url
    return path.rsplit("/", 1)[-1]


def parent_of(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


def shard_counts(urls: list[str], spec: str, patience: Patience) -> tuple[int, ...] | None:
    """Per-shard counts from a ``manifest.json`` or ``sizes.json`` beside the shards (all in one
    folder), or None when there is neither (or the shards come from ``pipe:`` commands)."""
    parents = {parent_of(url) for url in urls}
    if len(parents) != 1 or any(scheme_of(url) == "pipe" for url in urls):
        return None
    parent = parents.pop()
    for name in (MANIFEST, SIZES):
        try:
            body = read_small(f"{parent}/{name}", patience)
        except ShardUnavailable as error:
            raise DataError(f"data.shards {redact(spec)}: cannot look for its {name}: {error}") from None
        if body is None:
            continue
        sizes = parse_sizes(body, name, f"{redact(parent)}/{name}")
        names = [shard_name(url) for url in urls]
        unlisted = [n for n in names if n not in sizes]
        if unlisted:
            raise DataError(
                f"{redact(parent)}/{name} does not list {unlisted[0]}, one of the shards of {redact(spec)}"
            )
        return tuple(sizes[n] for n in names)
    return None


def parse_sizes(body: bytes, name: str, where: str) -> dict[str, int]:
    """{shard name: count} of a clipkit manifest or a WebDataset ``sizes.json``."""
    try:
        data = json.loads(body)
    except ValueError as error:
        raise DataError(f"{where}: not valid JSON ({error})") from error
    if name == MANIFEST:
        from clipkit.data.shard import manifest_problem

        if not isinstance(data, dict) or "shards" not in data or "n" not in data:
            raise DataError(f"{where}: not a clipkit manifest (no `n` and `shards`)")
        problem = manifest_problem(data)
        if problem:
            raise DataError(f"{where}: {problem}")
        return {s["name"]: int(s["count"]) for s in data["shards"]}
    if not isinstance(data, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in data.values()
    ):
        raise DataError(f"{where}: expected {{shard name: sample count}}")
    return {str(k).rsplit("/", 1)[-1]: v for k, v in data.items()}


def resolve_entry(i: int, shards: str, patience: Patience = Patience()) -> ShardSet:
    """The shard set of ``data.mixture[i]``; its errors name the entry, not ``data.shards``."""
    try:
        return resolve(shards, patience)
    except DataError as error:
        message = str(error).removeprefix("data.shards ")
        raise DataError(f"data.mixture[{i}].shards {message}") from None


@dataclass(frozen=True)
class MixtureEntry:
    shards: str
    weight: float = 1.0
    num_samples: int = 0  # sizes this source when it has no counts


def parse_mixture(mixture) -> list[MixtureEntry]:
    """``data.mixture`` (a list of ``{shards, weight[, num_samples]}``, or the compact string
    ``WEIGHT*SHARDS :: WEIGHT*SHARDS``) -> entries; a DataError naming the bad entry."""
    if isinstance(mixture, str):
        mixture = [compact_entry(item.strip()) for item in mixture.split(MIXTURE_SEPARATOR) if item.strip()]
    if not isinstance(mixture, (list, tuple)) or not mixture:
        raise DataError(
            "data.mixture: expected a list of {shards: ..., weight: ...}, or 'W*SHARDS :: W*SHARDS'"
        )
    entries = []
    for i, item in enumerate(mixture):
        if isinstance(item, dict) and isinstance(item.get("shards"), str) and not item["shards"].strip():
            raise DataError(
                f"data.mixture[{i}]: names no shards (an empty `shards:`, or nothing after `W*` "
                "between `::`); give each source its shard directory, list or URL"
            )
        if not isinstance(item, dict) or not isinstance(item.get("shards"), str) or not item["shards"]:
            raise DataError(f"data.mixture[{i}]: expected {{shards: ..., weight: ...}}, got {item!r}")
        unknown = set(item) - {"shards", "weight", "num_samples"}
        if unknown:
            raise DataError(
                f"data.mixture[{i}]: unknown key(s) {sorted(unknown)} (shards, weight, num_samples)"
            )
        weight = item.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not 0 < weight < math.inf
            or isinstance(weight, int)
            and weight > MAX_INTEGER
        ):
            raise DataError(f"data.mixture[{i}].weight must be a positive finite number, got {weight!r}")
        count = item.get("num_samples", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise DataError(f"data.mixture[{i}].num_samples must be a non-negative integer, got {count!r}")
        entries.append(MixtureEntry(item["shards"], float(weight), count))
    return relative_weights(entries)


def relative_weights(entries: list[MixtureEntry]) -> list[MixtureEntry]:
    """``entries``; when their weights' sum overflows, divided by the largest: the same draw, and
    a sum that cannot overflow (``1e308*A :: 1e308*B`` is an even mixture, not inf/inf); a
    weight too small to count beside the others is refused, naming it."""
    import dataclasses

    if math.isfinite(sum(entry.weight for entry in entries)):  # as random.choices adds them
        return entries  # as given: a resumed run draws exactly as before
    largest = max(entry.weight for entry in entries)
    scaled = [dataclasses.replace(entry, weight=entry.weight / largest) for entry in entries]
    for i, entry in enumerate(scaled):
        if not entry.weight > 0:
            raise DataError(
                f"data.mixture[{i}].weight {entries[i].weight!r} is too small beside {largest!r} "
                "to draw from; give weights of comparable size"
            )
    return scaled


def compact_entry(item: str) -> dict:
    weight, star, shards = item.partition("*")
    if star:
        try:
            return {"shards": shards.strip(), "weight": float(weight)}
        except ValueError:
            pass
    return {"shards": item}
