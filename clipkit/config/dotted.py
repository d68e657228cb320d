"""Dotted-path lookup in a plain recipe tree (nested dicts and lists): the one walk that recipe
loading, validation and the settings constraints share.

A path is a dotted string (``"train.distributed.local_loss"``, ``"eval.0.name"``) or a tuple of keys.
A numeric part indexes a list, or a dict whose keys are ints when the dict has no string key of
that name (YAML ``1: x`` loads as the int key 1). Torch-free and import-free, like the settings
schema that uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split_path(path: str | Sequence[Any]) -> tuple[Any, ...]:
    """``"a.b.0"`` -> ("a", "b", "0"); a tuple or list of keys is returned as a tuple."""
    return tuple(path.split(".")) if isinstance(path, str) else tuple(path)


def lookup(tree: Any, path: str | Sequence[Any]) -> tuple[bool, Any, tuple[Any, ...]]:
    """(found, the value at ``path``, ``path`` with its keys as stored: list indices as ints).

    (False, None, the path as given) when any part is missing, including a part that would have
    to look inside a value that is neither a dict nor a list.
    """
    keys = split_path(path)
    node, stored = tree, []
    for key in keys:
        numeric = str(key).lstrip("-").isdigit()
        if numeric and (isinstance(node, list) or isinstance(node, dict) and key not in node):
            key = int(key)
        inside_dict = isinstance(node, dict) and key in node
        if inside_dict or isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return False, None, keys
        stored.append(key)
    return True, node, tuple(stored)


def get_path(tree: Any, path: str | Sequence[Any], default: Any = None) -> Any:
    """The value at dotted ``path`` of ``tree``, or ``default`` when any part is missing."""
    found, value, _ = lookup(tree, path)
    return value if found else default
