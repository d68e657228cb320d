"""CLIP_benchmark's local WebDataset layout as a source: ``wds:DIR[?split=test]``, or ``DIR`` itself
when it looks like one (a ``wds_<dataset>`` folder, or one holding ``classnames.txt`` /
``zeroshot_classification_templates.txt`` / ``dataset_type.txt`` beside a split folder).

The layout (as CLIP_benchmark's ``clip_benchmark_export_wds`` writes it, and the ``wds_*`` sets it
publishes)::

    wds_vtab-cifar10/
        classnames.txt                          one class name per line (label i = line i)
        zeroshot_classification_templates.txt   one prompt per line, ``{c}`` for the class name
        dataset_type.txt                        optional: "retrieval" (else classification)
        test/  nshards.txt  0.tar  1.tar ...    one sample per key: an image (webp/png/jpg),
        train/ ...                              ``cls`` (the label) or ``txt`` (captions, one a line)

Samples carry ``label`` (the ``cls`` integer) and, for retrieval sets, every caption of the
``txt`` member; ``info()["labels"]["label"]`` holds the class names and the templates (``{c}``
written as clipkit's ``{}``), so ``zero_shot`` needs no other argument;
``info()["benchmark"]["dataset"]`` is CLIP_benchmark's name of the set
(:func:`clipkit.eval.clip_benchmark.benchmark_name`: ``wds_vtab-cifar10`` -> ``vtab/cifar10``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from clipkit.contract.types import Sample
from clipkit.errors import DataError
from clipkit.eval.clip_benchmark import benchmark_name

from .dataset_sources import BadRow, WebDatasetSource, field_text, make_sample, record_parts

SCHEME = "wds:"
CLASSNAMES = "classnames.txt"
TEMPLATES = "zeroshot_classification_templates.txt"
DATASET_TYPE = "dataset_type.txt"
NSHARDS = "nshards.txt"


def is_clip_benchmark_folder(path: Path) -> bool:
    """Whether ``path`` looks like a CLIP_benchmark wds dataset folder (see the module docs)."""
    if not path.is_dir():
        return False
    marked = any((path / name).is_file() for name in (CLASSNAMES, TEMPLATES, DATASET_TYPE))
    split = any((child / NSHARDS).is_file() for child in path.iterdir() if child.is_dir())
    return split and (marked or path.name.startswith("wds_"))


def open_clip_benchmark_source(uri: str, options: dict[str, Any]):
    """The source for ``wds:DIR[?split=S]`` or a detected folder, else None."""
    from .source_base import common_options

    explicit = uri.startswith(SCHEME)
    spec = uri[len(SCHEME) :] if explicit else uri
    path, _, query = spec.partition("?")
    if not explicit and ("://" in uri or not is_clip_benchmark_folder(Path(path))):
        return None
    split = "test"
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "split":
            raise DataError(f"{uri}: unknown query parameter {key!r}; known: split")
        split = value
    return ClipBenchmarkSource(path, split=split, **common_options(options))


def read_lines(path: Path) -> list[str] | None:
    """The non-blank lines of a text file, or None when it does not exist."""
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot be read as UTF-8 text ({error})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def clipkit_template(template: str, where: str) -> str:
    """CLIP_benchmark's ``a photo of a {c}.`` as clipkit's ``a photo of a {}.``."""
    if "{c}" not in template:
        raise DataError(f"{where}: template {template!r} has no {{c}} for the class name")
    return template.replace("{", "{{").replace("}", "}}").replace("{{c}}", "{}")


class ClipBenchmarkSource(WebDatasetSource):
    """One split of a CLIP_benchmark wds dataset folder (see the module docs)."""

    name = "clip_benchmark_wds"

    def __init__(self, path: Path | str, *, split: str = "test", **common: Any) -> None:
        root = Path(path)
        if not root.is_dir():
            raise DataError(f"{root}: no CLIP_benchmark dataset folder here (wds:DIR names one)")
        splits = sorted(child.name for child in root.iterdir() if (child / NSHARDS).is_file())
        folder = root / split
        if not folder.is_dir():
            raise DataError(f"{root}: no split {split!r} (its splits: {', '.join(splits) or 'none'})")
        # FileSource's set-up, not WebDatasetSource's: the shards are the split's numbered tars
        super(WebDatasetSource, self).__init__(folder, **common)
        self.spec = str(folder)
        self.root, self.split, self.shards = root, split, shard_files(folder)
        kind = read_lines(root / DATASET_TYPE)
        self.retrieval = bool(kind) and kind[0].lower() == "retrieval"
        self.classes = read_lines(root / CLASSNAMES)
        templates = read_lines(root / TEMPLATES)
        self.templates = [clipkit_template(t, str(root / TEMPLATES)) for t in templates or []]

    def build(self, key: str, where: str, fields: dict[str, bytes] | BadRow) -> Sample:
        if isinstance(fields, BadRow):
            raise fields
        image, captions, meta = record_parts(fields, where)
        if "txt" in fields:  # CLIP_benchmark's retrieval sets: every line of txt is a caption
            captions = field_text(fields["txt"], f"{where}.txt").splitlines()
        label = meta.get("label")
        if self.classes and isinstance(label, int) and not 0 <= label < len(self.classes):
            # Refused, not skipped: scoring the samples that happen to fit would report a score
            # of another class list than the data's (docs/safety.md).
            raise DataError(
                f"{where}.cls: label {label} is outside the {len(self.classes)} classes of "
                f"{self.root / CLASSNAMES}: the class list does not match the data's labels"
            )
        return make_sample(key, where, image, captions, meta, self.max_caption_chars)

    def info(self) -> dict[str, Any]:
        info = {**super().info(), "path": str(self.root), "split": self.split}
        info["benchmark"] = {"dataset": benchmark_name(self.root), "retrieval": self.retrieval}
        if self.classes:
            info["labels"] = {"label": {"classes": list(self.classes), "templates": list(self.templates)}}
        elif not self.retrieval:  # the labels are indices into a list that is not here
            info["labels"] = {"label": {"classes_missing": str(self.root / CLASSNAMES)}}
        return info


def shard_files(folder: Path) -> list[Path]:
    """The split's tars: ``0.tar`` .. ``N-1.tar`` for ``nshards.txt`` = N, else every tar by number."""
    count = read_lines(folder / NSHARDS)
    if count:
        try:
            names = [folder / f"{i}.tar" for i in range(int(count[0]))]
        except ValueError:
            raise DataError(f"{folder / NSHARDS}: expected the number of shards, got {count[0]!r}") from None
        missing = [p for p in names if not p.is_file()]
        if missing:
            raise DataError(f"{missing[0]}: shard not found ({folder / NSHARDS} says {len(names)})")
        return names
    tars = [p for p in folder.iterdir() if p.suffix == ".tar"]
    if not tars:
        raise DataError(f"{folder}: no .tar shards (and no {NSHARDS})")
    return sorted(tars, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
