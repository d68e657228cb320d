"""Class lists shared by the classification evals (``zero_shot``, ``linear_probe``): what a source
says its label values mean, names compared loosely, and the checks of a class list a user gives."""

from __future__ import annotations

import string
from collections.abc import Sequence

from clipkit.errors import ClipkitError


def described_labels(info: dict, samples, label: str) -> dict:
    """What the source says about the classes its ``label`` values refer to: its own entry for
    ``label`` (``info()["labels"][label]``), or, for index labels, the entry whose class names the
    samples carry beside the index (``classes:``, ``idx:`` and tar sets: ``label`` = index into
    ``labels["class"]["classes"]``, ``class`` = that name); {} where the source says nothing."""
    labels = info.get("labels") or {}
    if labels.get(label):
        return labels[label]
    for key, entry in labels.items():
        classes = (entry or {}).get("classes") or []
        if (
            key != label
            and classes
            and samples
            and all(names_index(sample.meta.get(label), sample.meta.get(key), classes) for sample in samples)
        ):
            return entry
    return {}


def names_index(index, name, classes: list) -> bool:
    """Whether ``index`` is an index into ``classes`` that names ``name``."""
    if not is_index(index) or not 0 <= index < len(classes):
        return False
    return name == classes[index]


def is_index(value) -> bool:
    """An integer label value (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def squash(name) -> str:
    """A class name compared without case, ``_``, ``-`` or repeated spaces."""
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


def shown(names: list, most: int = 20) -> str:
    """The first ``most`` names, quoted, and how many there are in all where that is more."""
    text = ", ".join(map(repr, names[:most]))
    return text + (f", ... ({len(names)} in all)" if len(names) > most else "")


def check_given_classnames(task: str, names, where: str = "classnames") -> list:
    """A class list a user gives (``classnames``, ``classnames_file``): a non-empty list of distinct
    names, compared as :func:`squash` does (``'blue'`` and ``'Blue'`` would get prompts the model
    cannot tell apart, and one class's images would be scored under the other's name)."""
    if not is_list(names) or not names:
        raise ClipkitError(f"{task}: {where} must be a non-empty list of class names, got {names!r}")
    seen: dict[str, object] = {}
    for name in names:
        if is_list(name) or isinstance(name, dict) or name is None:
            raise ClipkitError(f"{task}: {where} holds {name!r}, not a class name")
        key = squash(name)
        if key in seen:
            other = seen[key]
            same = "twice" if other == name else f"and {other!r} (the same name up to case, '_' or '-')"
            raise ClipkitError(f"{task}: {where} names {name!r} {same}; each class must be named once")
        seen[key] = name
    return list(names)


def check_templates(task: str, templates, where: str = "templates") -> list[str]:
    """Prompt templates: a non-empty list of texts, each with exactly one ``{}`` for the class name
    (``{{``/``}}`` for literal braces). A template without ``{}`` gives every class the same text."""
    if not is_list(templates) or not templates:
        raise ClipkitError(f"{task}: {where} must be a non-empty list of texts with {{}}, got {templates!r}")
    for template in templates:
        problem = template_problem(template)
        if problem:
            raise ClipkitError(f"{task}: {where}: {template!r} {problem}; each template needs one {{}}")
    return list(templates)


def template_problem(template) -> str | None:
    """Why ``template`` cannot take a class name with ``template.format(name)``, or None."""
    if not isinstance(template, str):
        return "is not a text"
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:  # an unmatched brace
        return f"is not a format text ({error})"
    if fields != [""]:
        named = [f"{{{field}}}" for field in fields]
        return f"has {len(fields)} fields {named}" if fields else "has no {} for the class name"
    return None


def is_list(value) -> bool:
    """A list of values (a YAML list included), not a text."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)
