"""Your own data in one switch: ``clipkit train RECIPE --data SHARDS_OR_TABLE`` as recipe overrides.

:func:`own_data_overrides` turns the command line's data options into ``key=value`` overrides that
go before the user's own (so an explicit override still wins):

- ``data.shards`` / ``data.source``: a shard directory is read as is; a table (or any other source
  URI) is sharded first, into ``$CLIPKIT_DATA_DIR/<name>-<hash>`` (default ``data/``);
- ``data.holdout``: the fraction of samples held out of training (:func:`is_held_out`);
- ``eval``: retrieval on that held-out split, zero-shot over ``label`` when one is named, and the
  same on every ``--eval-data``. The recipe's own evaluation (the synthetic shapes) is replaced,
  since it scores other data than the model was trained on; it is kept only for synthetic data.

The split is a pure function of each sample's key (the source's stable key: a table's row number,
a file's relative path), so it is the same on every run, every process and every machine, and
``clipkit shard --split val=0.05`` writes exactly the same split as separate shard sets.
Torch is never imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from clipkit.errors import ClipkitError, DataError

HOLDOUT_SCHEME = "holdout:"
#: The default fraction held out of training for evaluation.
DEFAULT_HOLDOUT = 0.05


def split_position(key: str) -> float:
    """A sample key -> a number in [0, 1) that looks uniform (the first 8 bytes of its SHA-256)."""
    digest = hashlib.sha256(str(key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(key: str, fraction: float) -> bool:
    """Whether the sample with ``key`` belongs to the held-out ``fraction`` (deterministic)."""
    return fraction > 0 and split_position(key) < fraction


class Holdout(float):
    """A held-out fraction (a float, so ``holdout > 0`` reads as before) that also names the
    meta-data column whose value is hashed instead of each sample's key: ``by`` (``--holdout-by``)
    puts all rows of a group on one side of the split, so variants of one drawing, captions of one
    photo or rows of one class cannot be both trained on and scored; without it rows are split
    one by one. The fraction is then one of groups, not of rows."""

    by: str | None

    def __new__(cls, fraction: float = 0.0, by: str | None = None) -> Holdout:
        rule = super().__new__(cls, float(fraction))
        rule.by = by or None
        return rule

    def __reduce__(self):  # loader workers get the column too
        return (Holdout, (float(self), self.by))

    def __repr__(self) -> str:
        return f"Holdout({float(self)!r}, by={self.by!r})"

    def split_key(self, key: str, meta: dict | None) -> str:
        """What is hashed for the sample with ``key`` and ``meta``: its key, or its ``by`` value
        (DataError naming the sample and the column when it has none)."""
        if self.by is None:
            return str(key)
        value = (meta or {}).get(self.by)
        if value is None or value == "":
            present = sorted(k for k in (meta or {}) if k != "index")
            raise DataError(
                f"sample {key!r}: no value in column {self.by!r} to group the held-out split by "
                f"(--holdout-by; its columns: {present})"
            )
        return f"{self.by}={json.dumps(value, sort_keys=True) if not isinstance(value, str) else value}"

    def holds(self, key: str, meta: dict | None = None) -> bool:
        """Whether the sample with ``key`` and ``meta`` is held out."""
        return self > 0 and is_held_out(self.split_key(key, meta), float(self))


def holdout_rule(holdout: float, by: str | None = None) -> Holdout:
    """``holdout`` (a float or a :class:`Holdout`) as a :class:`Holdout`; ``by`` where it has none."""
    return holdout if isinstance(holdout, Holdout) else Holdout(holdout, by)


def recipe_holdout(data) -> Holdout:
    """The held-out split of a recipe's ``data`` section (``data.holdout``, ``data.holdout_by``)."""
    return Holdout(data.holdout, getattr(data, "holdout_by", None))


def check_fraction(fraction: float, what: str) -> float:
    fraction = float(fraction)
    if not 0 <= fraction < 1:
        raise ClipkitError(f"{what}: the held-out fraction must be in [0, 1), got {fraction}")
    return fraction


def holdout_uri(shards: str, fraction: float, by: str | None = None, part: str | None = None) -> str:
    """The eval-data URI of the held-out split of ``shards`` (grouped ``by`` a column; ``part=train``:
    the rest, what training sees) (:mod:`clipkit.plugins.sources.holdout_source`)."""
    query = [f"fraction={float(fraction):g}"] + ([f"by={quote(by)}"] if by else [])
    query += [f"part={part}"] if part else []
    return f"{HOLDOUT_SCHEME}{shards}?{'&'.join(query)}"


def is_shard_directory(data: str) -> bool:
    from clipkit.data.shard import MANIFEST

    return "://" not in data and (Path(data) / MANIFEST).is_file()


def is_synthetic(data: str) -> bool:
    return data.startswith("synthetic://")


def data_dir() -> Path:
    return Path(os.environ.get("CLIPKIT_DATA_DIR", "data"))


def shards_for(source: str) -> str:
    """Where the shards of ``source`` go: ``<data dir>/<file stem>-<hash>``, named after the file so a
    report or a directory listing says which table it came from. The hash covers the source and,
    for one local file (a table), its size and modification time: an edited table is sharded anew
    into another folder (a run that trained on the old shards still resumes on them)."""
    from clipkit.data.shard_writer import source_state

    stem = Path(source.split("?", 1)[0]).stem or "source"
    state = source_state(source)
    identity = source if state is None else f"{source}\0{state}"
    digest = hashlib.sha1(identity.encode("utf-8")).hexdigest()[:8]
    return str((data_dir() / f"{stem}-{digest}").resolve())


def absolute(data: str) -> str:
    """A local path made absolute (evaluation may run from another directory); URIs with a scheme
    (``synthetic://``, ``classes:``, ``holdout:``) are kept as given."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", data):
        return data
    path, sep, query = data.partition("?")
    return str(Path(path).resolve()) + sep + query


def eval_tasks(data: str, label: str | None, training_data: str | None = None) -> list[dict[str, Any]]:
    """Retrieval on ``data``, and zero-shot over ``label`` when one is named; with ``training_data``
    (the URI of what the model trains on) each task checks its data against it
    (:mod:`clipkit.eval.data_checks`)."""
    checked = {"training_data": training_data} if training_data else {}
    tasks: list[dict[str, Any]] = [{"name": "retrieval", "data": data, **checked}]
    if label:
        tasks.append({"name": "zero_shot", "data": data, "label": label, **checked})
    return tasks


def training_uri(shards: str, holdout: float, by: str | None) -> str:
    """The URI of the samples a run trains on: ``shards`` less their held-out split."""
    return holdout_uri(shards, holdout, by, part="train") if holdout > 0 else shards


def own_data_overrides(
    data: str | None,
    *,
    holdout: float = DEFAULT_HOLDOUT,
    label: str | None = None,
    eval_data: list[str] | None = None,
    recipe_eval: list[dict] | None = None,
    holdout_by: str | None = None,
) -> tuple[list[str], list[str]]:
    """(recipe overrides, notes to print) for ``--data``, ``--holdout``, ``--holdout-by``,
    ``--label``, ``--eval-data``.

    ``recipe_eval``: the recipe's own eval tasks, kept (with ``eval_data`` added) when ``data`` is
    None or synthetic; replaced by evaluation on the user's data otherwise.
    """
    holdout = check_fraction(holdout, "--holdout")
    notes = [f"eval: also on {absolute(item)}" for item in eval_data or []]
    if data is None or is_synthetic(data):
        if label and not eval_data:
            raise ClipkitError("--label names a column of your --data or --eval-data; give one of them")
        if holdout_by:
            raise ClipkitError("--holdout-by names a column of your own --data; give --data TABLE")
        extra = [task for item in eval_data or [] for task in eval_tasks(absolute(item), label)]
        overrides = [f"eval={json.dumps(list(recipe_eval or []) + extra)}"] if extra else []
        if data is not None:
            overrides += [f"data.source={json.dumps(data)}", f"data.shards={json.dumps(shards_for(data))}"]
        return overrides, notes
    data = absolute(data)
    check_local_data(data)
    if is_streamed_data(data):
        holdout = streamed_holdout(holdout)
        if holdout_by:
            raise ClipkitError("--holdout-by: streamed --data has no held-out split; give --eval-data")
        shards, source = data, ""
        notes.insert(0, f"data: streaming the shards {redact(data)} (no local copy)")
        if not eval_data:
            notes.insert(1, "data: streamed data has no held-out split; evaluate it with --eval-data")
    elif is_shard_directory(data):
        shards, source = data, ""
        notes.insert(0, f"data: training on the shards in {data}")
    else:
        shards, source = shards_for(data), data
        notes.insert(0, f"data: {data} is sharded (once) into {shards}")
    training = None if is_streamed_data(data) else training_uri(shards, holdout, holdout_by)
    extra = [task for item in eval_data or [] for task in eval_tasks(absolute(item), label, training)]
    tasks = eval_tasks(holdout_uri(shards, holdout, holdout_by), label, training) if holdout > 0 else []
    if holdout > 0:
        what = "samples (by key hash)"
        if holdout_by:
            what = f"{holdout_by!r} groups (all rows of a group on one side)"
        notes.insert(1, f"data: {holdout:.1%} of the {what} are held out for evaluation")
    elif not extra and not is_streamed_data(data):
        notes.insert(1, "data: --holdout 0 and no --eval-data: the run is not evaluated")
    overrides = [
        f"data.shards={json.dumps(shards)}",
        f"data.source={json.dumps(source)}",
        f"data.holdout={holdout}",
        f"data.holdout_by={json.dumps(holdout_by) if holdout_by else 'null'}",
        f"eval={json.dumps(tasks + extra)}",
    ]
    return overrides, notes


def is_streamed_data(data: str) -> bool:
    from clipkit.data.shard_sets import is_streamed, is_tar_folder

    return is_streamed(data) or is_tar_folder(data)


def redact(data: str) -> str:
    from clipkit.data.remote import redact as redact_url

    return redact_url(data)


def check_local_data(data: str) -> None:
    """``--data`` naming a local path that is not there, or an empty folder: an error naming it
    (before anything is written), never a source to fill."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", data) or is_streamed_data(data):
        return
    path = Path(data.partition("?")[0])
    if not path.exists():
        raise ClipkitError(f"--data {path}: no such file or directory")
    if path.is_dir() and not any(path.iterdir()):
        raise ClipkitError(f"--data {path}: the directory is empty")


def streamed_holdout(holdout: float) -> float:
    """Streamed ``--data`` trains on everything: a held-out split would read every shard before
    training. The default fraction is dropped; an explicit other one is refused."""
    if holdout in (0, DEFAULT_HOLDOUT):
        return 0.0
    raise ClipkitError(
        f"--holdout {holdout:g}: streamed --data has no held-out split (finding it would read every shard "
        "first); give --eval-data, or shard the data with `clipkit shard --split val=F`"
    )


@dataclass(frozen=True)
class OwnData:
    """``clipkit train --data/--holdout/--label/--eval-data``: the user's data, as recipe overrides.

    The overrides depend on the recipe's own eval tasks (kept when ``data`` is synthetic), so
    they are made from the resolved recipe (:func:`clipkit.app.api.resolve`) rather than before it.
    """

    data: str | None = None
    holdout: float = DEFAULT_HOLDOUT
    label: str | None = None
    eval_data: tuple[str, ...] = ()
    epochs: float | None = None  # --epochs: passes over the user's data (clipkit.app.run_length)
    holdout_by: str | None = None  # --holdout-by: a column; all rows of a group on one side

    @property
    def is_own(self) -> bool:
        """Whether ``data`` is the user's (not synthetic): then the run is sized by epochs over it."""
        return self.data is not None and not is_synthetic(self.data)

    def overrides(self, recipe_eval: list[dict] | None) -> list[str]:
        """The ``key=value`` overrides for a recipe whose eval tasks are ``recipe_eval``."""
        return own_data_overrides(self.data, **self._options(), recipe_eval=recipe_eval)[0]

    def notes(self) -> list[str]:
        """What to tell the user about their data (where it is sharded, what is held out)."""
        return own_data_overrides(self.data, **self._options())[1]

    def _options(self) -> dict[str, Any]:
        return {
            "holdout": self.holdout,
            "holdout_by": self.holdout_by,
            "label": self.label,
            "eval_data": list(self.eval_data),
        }


def parse_split(text: str) -> tuple[str, float]:
    """``"val=0.05"`` -> ("val", 0.05): the held-out set's name and fraction (``--split``)."""
    name, sep, value = text.partition("=")
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not sep or not name.strip() or name.strip() == "train" or not 0 < fraction < 1:
        raise ClipkitError(f"--split {text!r}: expected NAME=FRACTION with 0 < FRACTION < 1, e.g. val=0.05")
    name = name.strip()
    # The name is a folder made inside OUT: never a path out of it ("../x", "/abs", "a/b").
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ClipkitError(
            f"--split {text!r}: the name {name!r} becomes a folder inside the output; use letters, "
            "digits, '.', '_' and '-' (starting with a letter or digit), e.g. val=0.05"
        )
    return name, fraction


class SplitPart:
    """The samples of ``source`` in (``held_out``) or out of the held-out ``fraction``, for
    ``clipkit shard --split``; ``info()`` is the source's plus ``split``."""

    def __init__(self, source, fraction: float, held_out: bool, name: str) -> None:
        self.source, self.fraction, self.held_out, self.name = source, fraction, held_out, name

    def __iter__(self):
        for sample in self.source:
            if holdout_rule(self.fraction).holds(sample.key, sample.meta) == self.held_out:
                yield sample

    def info(self) -> dict[str, Any]:
        info = dict(self.source.info()) if hasattr(self.source, "info") else {}
        return {**info, "split": {"part": self.name, "fraction": self.fraction}}


#: The settings a user is expected to look at when training on their own data (``validate --show``).
USER_KNOBS = (
    ("data.shards", "the training data (set by --data; a table is sharded into it)"),
    ("data.holdout", "fraction held out of training for evaluation (--holdout)"),
    ("data.holdout_by", "column whose groups are held out whole (--holdout-by; null: row by row)"),
    ("data.background", "colour transparent pixels are composited onto"),
    ("data.batch_size", "samples per step over all processes (lower it for a small table)"),
    ("data.fit_batch", "lower data.batch_size to a table smaller than one batch (tiny variants: on)"),
    ("train.steps", "optimiser steps"),
    ("model.image_size", "input side in pixels"),
    ("data.num_workers", "loader processes (auto: from the usable CPUs)"),
    ("train.threads", "torch threads (auto: from the usable CPUs)"),
)


def knob_lines(recipe: dict) -> list[str]:
    """``# key: value  — what it is`` for each of :data:`USER_KNOBS` in a resolved recipe."""
    from clipkit.config.recipe import section

    lines = ["# the knobs to set for your own data (key=value overrides):"]
    for key, meaning in USER_KNOBS:
        part, _, name = key.partition(".")
        value = getattr(section(recipe, part), name)
        lines.append(f"#   {key}: {value}  — {meaning}")
    return lines
