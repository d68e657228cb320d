"""The vocabulary of setting constraints: a number's range, a choice, a pair, a list, an integer.

Host settings (:mod:`clipkit.config.settings_schema`) and plugin factories declare their allowed values
with these, as :data:`typing.Annotated` metadata::

    def adamw(named_parameters, lr: Annotated[float, Range(gt=0)] = 5e-4, ...): ...

Constraints are plain data, checked without building anything; each ``problem(value)`` returns a
message or None. Torch-free and importing only clipkit.errors, so anything may declare with it.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from dataclasses import dataclass
from typing import Any

from clipkit.errors import choice_error


def _compare(value: float, name: str, bound: float) -> bool:
    return {"gt": value > bound, "ge": value >= bound, "lt": value < bound, "le": value <= bound}[name]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The largest integer a setting may hold: what a 64-bit tensor, a C long or a timeout can carry.
MAX_INTEGER = 2**63 - 1


def number_problem(value: Any) -> str | None:
    """Why a number cannot be a setting at all — not finite (inf, nan) or an integer beyond 64 bits —
    or None. Every bound check starts with it, and recipes are walked for it (any key)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER:
        return f"must be at most {MAX_INTEGER} in size, got an integer of {len(str(abs(value)))} digits"
    return None


@dataclass(frozen=True)
class Range:
    """A number within bounds: ``gt``/``ge`` below, ``lt``/``le`` above (None: unbounded)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def problem(self, value: Any) -> str | None:
        if value is None or not _is_number(value):
            return None  # types are checked separately (and None means "unset" where allowed)
        unusable = number_problem(value)
        if unusable:
            return unusable
        for name in ("gt", "ge", "lt", "le"):
            bound = getattr(self, name)
            if bound is not None and not _compare(value, name, bound):
                return f"must be {self.describe()}, got {value!r}"
        return None

    def describe(self) -> str:
        parts = [
            f"{sign} {getattr(self, name)}"
            for name, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
            if getattr(self, name) is not None
        ]
        return " and ".join(parts) or "a finite number"  # unbounded: finite is all that is asked


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of values."""

    choices: tuple

    def problem(self, value: Any) -> str | None:
        return choice_error(value, self.choices)


@dataclass(frozen=True)
class Interval:
    """A ``[low, high]`` pair with low <= high, each within ``bounds``."""

    bounds: Range = Range()

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(map(_is_number, value)):
            return f"must be a pair [low, high] of numbers, got {value!r}"
        low, high = value
        if low > high:
            return f"must be [low, high] with low <= high, got {list(value)}"
        bad = [v for v in value if self.bounds.problem(v)]
        return f"both ends must be {self.bounds.describe()}, got {list(value)}" if bad else None


@dataclass(frozen=True)
class Numbers:
    """A list of ``length`` numbers, each within ``each``."""

    length: int
    each: Range = Range()

    def problem(self, value: Any) -> str | None:
        numbers = isinstance(value, (list, tuple)) and all(map(_is_number, value))
        if not numbers or len(value) != self.length:
            return f"must be a list of {self.length} numbers, got {value!r}"
        bad = [v for v in value if self.each.problem(v)]
        return f"each must be {self.each.describe()}, got {list(value)}" if bad else None


@dataclass(frozen=True)
class Integer:
    """An int (not a bool) within ``bounds``: for settings outside the typed sections, like ``seed``."""

    bounds: Range = Range()

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {type(value).__name__} {value!r}"
        return self.bounds.problem(value)


POSITIVE, NON_NEGATIVE, PROBABILITY = Range(gt=0), Range(ge=0), Range(ge=0, le=1)


@functools.lru_cache(maxsize=2048)
def _remembered_hints(target, include_extras: bool) -> dict[str, Any]:
    return typing.get_type_hints(target, include_extras=include_extras)


def type_hints(target, *, include_extras: bool = False) -> dict[str, Any]:
    """``typing.get_type_hints(target)`` of a function or a class, remembered per target: every
    recipe resolution validates the same factories and settings, and string annotations (``from
    __future__ import annotations``) are evaluated anew on each call (~half of a resolve's time).
    Raises what ``get_type_hints`` raises for unresolvable annotations (never remembered), and
    TypeError for a target that is not a function or class (as ``get_type_hints`` does)."""
    return dict(_remembered_hints(target, include_extras))


def annotated_constraints(target) -> dict[str, Any]:
    """``{name: constraint}`` from the ``Annotated[..., Range(...)]`` annotations of ``target``
    (a function or a class); the first metadata item with a ``problem`` method is the constraint."""
    try:
        hints = type_hints(target, include_extras=True)
    except Exception:  # unresolvable annotations: no constraints rather than a failed validation
        return {}
    found = {}
    for name, hint in hints.items():
        if typing.get_origin(hint) is typing.Annotated:
            marks = [m for m in hint.__metadata__ if hasattr(m, "problem")]
            if marks:
                found[name] = marks[0]
    return found


def parameter_constraints(factory) -> dict[str, Any]:
    """``{parameter: constraint}`` of a plugin factory (a function, or a class's ``__init__``)."""
    return annotated_constraints(factory.__init__ if inspect.isclass(factory) else factory)
