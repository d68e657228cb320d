"""Zero-shot class names and prompt templates for standard datasets, shipped with clipkit.

The data (``plugins/evals/zeroshot/*.json``, MIT, licences and origins in ``zeroshot/README.md``) comes
from OpenAI CLIP (``data/prompts.md``: 26 datasets; the ImageNet notebook: 1000 classes, 80
templates and CLIP's 7-template subset), SLIP (``labels.json`` / ``templates.json``, the prompts
that WPSE and KME-CLIP (seeds 000, 003) evaluate with), CLIP_benchmark, and Fashion-MNIST's own
label table. Templates use ``str.format``'s ``{}`` for the class name (CLIP_benchmark's ``{c}``
is converted).

Class names (``classnames(dataset)``): a list's order *is* its label order, so the default list of
each dataset is CLIP's cleaned names in the dataset's usual label order:

* CLIP's list (``source="clip"``) for every dataset CLIP evaluated, except
* ``eurosat``: SLIP's list (= CLIP_benchmark's): CLIP's names in the alphabetical order of the
  EuroSAT folders (AnnualCrop, Forest, ...); CLIP's own list has another order;
* ``pets``: CLIP_benchmark's list: CLIP's names (Title Case) in the official Oxford-IIIT Pet
  class-id order (torchvision's); CLIP's and SLIP's lists put the capitalised cat breeds first;
* ``fashion_mnist``: the dataset's own names (no CLIP/SLIP/CLIP_benchmark list exists);
* ``cub200``: SLIP's (only source); ``svhn``: CLIP_benchmark's (only source).

``caltech101`` has 102 classes in every source (index 0 = "background"); ``imagenet`` repeats
"missile" and "sunglasses" (match labels by index). ``class_synonyms`` gives FER2013's several
names per class; ``classnames`` the first of each.

Template styles (``templates(dataset, style)``):

* ``"clip"``: CLIP's per-dataset templates (ImageNet: the 80);
* ``"clip80"``: the 80 ImageNet templates, for any dataset;
* ``"clip7"`` (= ``"imagenet7"``): CLIP's 7-template ImageNet subset, for any dataset;
* ``"slip"``: SLIP's per-dataset templates (identical to CLIP's, except ImageNet: the 7);
* ``"clip_benchmark"``: CLIP_benchmark's per-dataset templates.

For a dataset without its own ``"clip"`` or ``"clip_benchmark"`` templates (``fashion_mnist``,
``cub200``, ``svhn`` for ``"clip"``) those styles give the 80 ImageNet templates, CLIP_benchmark's
rule for datasets it has no templates for; ``"slip"`` has no such fallback.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from typing import Any

from clipkit.errors import ClipkitError, UnknownNameError

DATA_DIR = "zeroshot"
WHERE = "clipkit.plugins.evals.prompts"
STYLES = ("clip", "clip80", "clip7", "imagenet7", "slip", "clip_benchmark")
ANY_DATASET_STYLES = {"clip80": "clip80", "clip7": "clip7", "imagenet7": "clip7"}
FALLS_BACK_TO_CLIP80 = ("clip", "clip_benchmark")

# Other spellings of the canonical names, compared after squash() (so "CIFAR-10", "cifar_10" and
# "Oxford Pets" resolve too); a canonical name's own squashed form is always accepted.
ALIASES = {
    "fmnist": "fashion_mnist",
    "stanfordcars": "cars",
    "cars196": "cars",
    "fgvcaircraft": "aircraft",
    "flowers102": "flowers",
    "oxfordflowers": "flowers",
    "oxfordflowers102": "flowers",
    "oxford102flowers": "flowers",
    "describabletextures": "dtd",
    "oxfordpets": "pets",
    "oxfordiiitpet": "pets",
    "oxfordiiitpets": "pets",
    "imagenet1k": "imagenet",
    "ilsvrc2012": "imagenet",
    "in1k": "imagenet",
    "sst2": "rendered_sst2",
    "patchcamelyon": "pcam",
    "pascalvoc2007": "voc2007",
    "kinetics700frames": "kinetics700",
    "ucf101frames": "ucf101",
    "clevrcountall": "clevr_counts",
    "kittidistance": "kitti",
    "kitticlosestvehicledistance": "kitti",
    "facialemotionrecognition2013": "fer2013",
    "cub": "cub200",
    "cub2002011": "cub200",
}


def dataset_names() -> list[str]:
    """The canonical dataset names (lower_snake), sorted."""
    return sorted(_data("classnames.json")["datasets"])


def canonical_name(dataset: str) -> str:
    """``dataset``'s canonical name: case, ``-``, ``_`` and spaces are ignored; aliases resolve."""
    name = _lookup().get(squash(dataset)) if isinstance(dataset, str) else None
    if name is None:
        raise UnknownNameError("dataset", str(dataset), dataset_names(), where=WHERE)
    return name


def classnames(dataset: str, source: str = "default") -> list[str]:
    """Class names in label order (index i = label i); the first name where a class has several."""
    return [names[0] for names in class_synonyms(dataset, source)]


def class_synonyms(dataset: str, source: str = "default") -> list[list[str]]:
    """Every name of every class, in label order (one name per class except for FER2013)."""
    name = canonical_name(dataset)
    record = _data("classnames.json")["datasets"][name]
    chosen = record["default"] if source == "default" else source
    lists = record["lists"]
    if chosen not in lists:
        known = [*_data("classnames.json")["sources"], "default"]
        if source not in known:
            raise UnknownNameError("class-name source", str(source), known, where=WHERE)
        raise ClipkitError(
            f"{WHERE}: no {source!r} class names for dataset {name!r}; "
            f"its sources: {', '.join(classname_sources(name))} (default {record['default']!r})"
        )
    return [list(entry) if isinstance(entry, list) else [entry] for entry in _resolve(lists, chosen, "names")]


def classname_sources(dataset: str) -> list[str]:
    """The sources that have class names for ``dataset``, e.g. ["clip", "slip", "clip_benchmark"]."""
    return list(_data("classnames.json")["datasets"][canonical_name(dataset)]["lists"])


def default_classname_source(dataset: str) -> str:
    """The source ``classnames(dataset)`` uses when none is named (see the module docstring)."""
    return _data("classnames.json")["datasets"][canonical_name(dataset)]["default"]


def templates(dataset: str, style: str = "clip") -> list[str]:
    """Prompt templates for ``dataset``, each with one ``{}`` for the class name (styles: module doc)."""
    name = canonical_name(dataset)
    if style not in STYLES:
        raise UnknownNameError("template style", str(style), STYLES, where=WHERE)
    data = _data("templates.json")
    if style in ANY_DATASET_STYLES:
        return list(data["any_dataset"][ANY_DATASET_STYLES[style]]["templates"])
    styles = data["datasets"][name]
    if style in styles:
        return list(_resolve({**data["any_dataset"], **styles}, style, "templates"))
    if style in FALLS_BACK_TO_CLIP80:
        return list(data["any_dataset"]["clip80"]["templates"])
    available = ", ".join(template_styles(name))
    raise ClipkitError(f"{WHERE}: no {style!r} templates for dataset {name!r}; its styles: {available}")


def template_styles(dataset: str) -> list[str]:
    """The styles ``templates(dataset, style)`` answers, in ``STYLES`` order."""
    own = _data("templates.json")["datasets"][canonical_name(dataset)]
    return [s for s in STYLES if s in own or s in ANY_DATASET_STYLES or s in FALLS_BACK_TO_CLIP80]


def squash(name: str) -> str:
    """Lower case, letters and digits only: the form names and aliases are compared in."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _resolve(entries: dict[str, dict], key: str, field: str) -> list[Any]:
    """Follow ``same_as`` references (a list stored once for sources that agree) to the list."""
    seen = []
    while "same_as" in entries[key]:
        seen.append(key)
        key = entries[key]["same_as"]
        if key in seen:  # a corrupt data file, not a user error
            raise RuntimeError(f"{WHERE}: same_as cycle {seen}")
    return entries[key][field]


@functools.cache
def _lookup() -> dict[str, str]:
    names = dataset_names()
    return {**ALIASES, **{squash(name): name for name in names}}


@functools.cache
def _data(filename: str) -> dict[str, Any]:
    resource = importlib.resources.files("clipkit.plugins.evals").joinpath(DATA_DIR).joinpath(filename)
    return json.loads(resource.read_text(encoding="utf-8"))
