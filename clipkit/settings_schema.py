"""The allowed values of every numeric and enumerated setting, checked by ``clipkit validate``.

Host settings (``data.*``, ``model.*``, ``train.*``, ``seed``) declare theirs in :data:`HOST`;
plugin factories declare theirs on their parameters with :data:`typing.Annotated`::

    from typing import Annotated
    from clipkit.settings_schema import Range

    def adamw(named_parameters, lr: Annotated[float, Range(gt=0)] = 5e-4, ...): ...

so anything ``validate`` accepts cannot fail in ``train`` on a settings error. Constraints are
plain data, checked without building anything; each returns a message or None.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from clipkit.errors import choice_error
from clipkit.train.compile import COMPILE_MODES  # torch-free, like this module


def _compare(value: float, name: str, bound: float) -> bool:
    return {"gt": value > bound, "ge": value >= bound, "lt": value < bound, "le": value <= bound}[name]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        return " and ".join(parts)


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

#: Every constrained host setting: dotted key path -> constraint (checked when the key is set).
HOST: dict[str, Any] = {
    "seed": Integer(NON_NEGATIVE),
    "eval_seed": Integer(NON_NEGATIVE),
    "data.batch_size": POSITIVE,
    "data.num_samples": NON_NEGATIVE,
    "data.on_error": OneOf(("skip", "raise")),
    "data.timeout": POSITIVE,
    "data.retries": NON_NEGATIVE,
    "data.num_workers": NON_NEGATIVE,
    "data.shuffle_buffer": NON_NEGATIVE,
    "data.crop_scale": Interval(Range(gt=0, le=1)),
    "data.crop_ratio": Interval(POSITIVE),
    "data.color_jitter": NON_NEGATIVE,
    "data.grayscale": PROBABILITY,
    "data.augment": OneOf(("sample", "batched")),
    "data.batched_input_size": NON_NEGATIVE,
    "model.embed_dim": POSITIVE,
    "model.image_size": POSITIVE,
    "model.mean": Numbers(3),
    "model.std": Numbers(3, POSITIVE),
    "model.pair": OneOf(("image_text", "two_view", "vectors")),
    "train.steps": POSITIVE,
    "train.log_every": POSITIVE,
    "train.checkpoint_every": POSITIVE,
    "train.keep_checkpoints": NON_NEGATIVE,
    "train.precision": OneOf(("no", "bf16", "fp16")),
    "train.grad_clip": NON_NEGATIVE,
    "train.eval_every": NON_NEGATIVE,
    "train.micro_batch_size": NON_NEGATIVE,
    "train.nonfinite": OneOf(("stop", "skip")),
    "train.compile": OneOf(COMPILE_MODES),
    "train.distributed.strategy": OneOf(("ddp", "deepspeed")),
    "train.distributed.zero_stage": OneOf((0, 1, 2, 3)),
    "train.distributed.offload_optimizer": OneOf(("none", "cpu")),
    "train.distributed.offload_params": OneOf(("none", "cpu")),
}

_MISSING = object()


def check_host(recipe: dict) -> list[str]:
    """'key.path: message' for every host setting outside its declared values."""
    errors = []
    for path, constraint in HOST.items():
        value = _lookup(recipe, path)
        if value is _MISSING:
            continue
        problem = constraint.problem(value)
        if problem:
            errors.append(f"{path}: {problem}")
    return errors


def _lookup(recipe: dict, path: str) -> Any:
    node: Any = recipe
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def parameter_constraints(factory) -> dict[str, Any]:
    """``{parameter: constraint}`` from a factory's ``Annotated[..., Range(...)]`` annotations."""
    import inspect

    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # unresolvable annotations: no constraints rather than a failed validation
        return {}
    found = {}
    for name, hint in hints.items():
        if typing.get_origin(hint) is typing.Annotated:
            marks = [m for m in hint.__metadata__ if hasattr(m, "problem")]
            if marks:
                found[name] = marks[0]
    return found
