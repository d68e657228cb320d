"""What a score on your own data cannot tell: the checks behind an eval result's ``warnings``.

A score on held-out rows flatters when those rows repeat training rows (variants of one drawing
land on both sides of a split by row), and a zero-shot score misleads when its classes are ones
the model cannot know or count for little. With ``training_data`` (the URI of the samples the
model was trained on; ``clipkit train --data`` sets it on every task it adds) an eval task adds:

- ``overlap``: the fraction of the evaluated samples whose caption also occurs in training
  (``captions``, compared case- and space-insensitively) and, with a ``label``, whose label value
  does (``label``); a warning when the evaluated data is a held-out split that is not grouped
  (``holdout:...`` without ``by=``) and either fraction is above 0, or when any caption repeats;
- zero-shot only, ``classes_unknown``: class names that share no word with any training caption
  (the image tower never saw them named; only a pretrained text tower can place them);

and, with or without ``training_data``, zero-shot adds ``classes_small`` (class -> samples, for the
classes with fewer than ``min_class_samples``: each counts as a full class in uniform chance and
mean per-class recall) and, when the majority baseline is a tie, names every tied class.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Words too common to say that a class name was seen in training captions.
STOPWORDS = frozenset(
    ("a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "into", "is", "it", "its")
    + ("of", "on", "or", "that", "the", "this", "to", "with")
)
#: Default of zero-shot's ``min_class_samples``: a class with fewer is flagged with its count.
MIN_CLASS_SAMPLES = 10
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> set[str]:
    """The lower-case words of ``text`` (letters and digits; ``_`` and punctuation split), less
    :data:`STOPWORDS`: ``"meats_and eggs!"`` -> {"meats", "eggs"}."""
    return {word for word in _WORD.findall(str(text).lower()) if word not in STOPWORDS}


def normalised(caption: str) -> str:
    """A caption compared for repeats: lower case, runs of white space as one space."""
    return " ".join(str(caption).lower().split())


@dataclass
class TrainingText:
    """The captions, caption words and categorical meta-data values of the training samples."""

    n: int = 0
    captions: set[str] = field(default_factory=set)
    words: set[str] = field(default_factory=set)
    values: dict[str, set[str]] = field(default_factory=dict)

    def add(self, captions: Iterable[str], meta: dict[str, Any]) -> None:
        self.n += 1
        for caption in captions:
            self.captions.add(normalised(caption))
            self.words |= words(caption)
        for key, value in meta.items():
            if key != "index" and isinstance(value, (str, int, bool)):
                self.values.setdefault(key, set()).add(str(value))


_TRAINING: dict[str, TrainingText] = {}


def training_text(uri: str, registry) -> TrainingText:
    """The :class:`TrainingText` of the samples at ``uri`` (read once per process and URI)."""
    if uri not in _TRAINING:
        from clipkit.data.shard import open_source

        text = TrainingText()
        for sample in open_source(uri, pm=registry.pm):
            text.add(sample.captions, dict(sample.meta))
        _TRAINING[uri] = text
    return _TRAINING[uri]


def is_grouped_holdout(data: str) -> bool | None:
    """For a ``holdout:`` URI, whether its split is by group (``by=``); None for other data."""
    from clipkit.app.own_data import HOLDOUT_SCHEME

    if not str(data).startswith(HOLDOUT_SCHEME):
        return None
    return "by=" in str(data).rpartition("?")[2]


def percent(fraction: float) -> str:
    return f"{fraction:.1%}"


def overlap_checks(data: str, samples: Sequence, training: TrainingText, label: str | None = None):
    """(``overlap`` field, warnings) of evaluated ``samples`` against the training samples."""
    n = len(samples)
    repeated = sum(any(normalised(c) in training.captions for c in s.captions) for s in samples)
    overlap: dict[str, Any] = {"captions": repeated / n if n else 0.0, "training_samples": training.n}
    seen = training.values.get(label) if label else None
    if seen is not None:
        overlap["label"] = sum(str(s.meta.get(label)) in seen for s in samples) / n if n else 0.0
    grouped = is_grouped_holdout(data)
    warnings = []
    shared = [f"{percent(overlap['captions'])} of the captions"] if repeated else []
    if grouped is False and overlap.get("label"):
        shared.append(f"{percent(overlap['label'])} of the {label!r} values")
    if shared:
        where = "the held-out samples" if grouped is not None else "the evaluated samples"
        remedy = (
            "split by group with --holdout-by COLUMN (all rows of a group on one side)"
            if grouped is False
            else "rows seen in training (or near-duplicates of them) flatter this score"
        )
        warnings.append(f"{' and '.join(shared)} of {where} also occur in training: {remedy}")
    return overlap, warnings


def unknown_classes(names: Sequence[str], training: TrainingText) -> list[str]:
    """The class names (as put in prompts) that share no word with any training caption."""
    return [name for name in names if not words(name) & training.words]


def small_classes(counts: dict[str, int], minimum: int) -> dict[str, int]:
    """Class -> evaluated samples, for the classes with fewer than ``minimum`` (zero included)."""
    return {name: count for name, count in counts.items() if count < minimum}


def shown(names: Sequence, limit: int = 8) -> str:
    text = ", ".join(repr(str(name)) for name in list(names)[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


def zero_shot_checks(
    classnames: Sequence,
    prompt_names: Sequence[str],
    labels: Sequence[int],
    training: TrainingText | None,
    minimum: int = MIN_CLASS_SAMPLES,
) -> tuple[dict[str, Any], list[str]]:
    """(fields, warnings) of a zero-shot task over ``classnames`` (put in prompts as
    ``prompt_names``) with evaluated ``labels`` (class indices): ``classes_unknown`` (with
    ``training``), ``classes_small`` and ``majority_tie``."""
    fields: dict[str, Any] = {}
    warnings: list[str] = []
    if training is not None:
        unknown = unknown_classes(prompt_names, training)
        fields["classes_unknown"] = unknown
        if unknown:
            warnings.append(
                f"{len(unknown)} of {len(prompt_names)} class names share no word with any training "
                f"caption ({shown(unknown)}): the model never saw them named, so it can place them only "
                "through a pretrained text tower"
            )
    tally = Counter(int(label) for label in labels)
    counts = {str(name): tally.get(index, 0) for index, name in enumerate(classnames)}
    small = small_classes(counts, minimum)
    fields["classes_small"] = small
    if small:
        listed = ", ".join(f"{name!r} {count}" for name, count in list(small.items())[:8])
        more = f" and {len(small) - 8} more" if len(small) > 8 else ""
        warnings.append(
            f"{len(small)} class(es) with fewer than {minimum} samples ({listed}{more}): each counts as a "
            "full class in uniform chance and mean per-class recall, scored on a few images"
        )
    top = max(tally.values(), default=0)
    tied = [str(classnames[index]) for index in sorted(tally) if tally[index] == top]
    if len(tied) > 1:
        fields["majority_tie"] = tied
        warnings.append(
            f"the majority-class baseline is a tie of {len(tied)} classes ({shown(tied)}), "
            f"{top} samples each: any of them is the constant answer"
        )
    return fields, warnings
