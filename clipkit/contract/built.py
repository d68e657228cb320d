"""What a plugin factory must return, checked once when a recipe slot is built.

A factory that returns the wrong kind of object (a function instead of an ``nn.Module``, a loss
with no ``__call__``) would otherwise train to the end with a tower that has no parameters, or
fail many frames deep in the loop. :func:`check_built` turns that into one line naming the slot,
the plugin and what it returned (docs/plugins.md, "The hooks").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clipkit.contract.types import CONTEXT_FIELDS, OPTIONAL_MEMBERS
from clipkit.errors import PluginError

#: Boolean capabilities the host branches on; a truthy string or a number is a declaration error.
BOOLEAN_MEMBERS = tuple(name for name, default in OPTIONAL_MEMBERS.items() if isinstance(default, bool))


def _is_module(built: Any) -> bool:
    from torch import nn

    return isinstance(built, nn.Module)


def _is_optimizer(built: Any) -> bool:
    import torch

    return isinstance(built, torch.optim.Optimizer)


def _has_step(built: Any) -> bool:
    return callable(getattr(built, "step", None))


def _is_tokenizer(built: Any) -> bool:
    sizes = (getattr(built, "vocab_size", None), getattr(built, "context_length", None))
    return callable(built) and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)


#: kind -> (test, what the factory should have returned). Kinds not listed are not checked.
EXPECTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "encoder": (_is_module, "an nn.Module whose forward returns a PointSet"),
    "similarity": (_is_module, "an nn.Module: forward(a, b, *, generator) -> Logits"),
    "loss": (callable, "a callable (logits, targets, ctx) -> LossOutput"),
    "distill_loss": (callable, "a callable (student, teacher) -> LossOutput"),
    "tokenizer": (_is_tokenizer, "a callable texts -> LongTensor with int vocab_size and context_length"),
    "optimizer": (_is_optimizer, "a torch.optim.Optimizer"),
    "schedule": (_has_step, "an LR scheduler (with step())"),
    "eval": (callable, "a callable (model, registry) -> dict"),
}


def check_built(kind: str, built: Any, who: str) -> None:
    """Raise :class:`PluginError` unless ``built`` (what a ``kind`` factory returned) is what the
    host calls; ``who`` names the slot and plugin, e.g. ``model.image_encoder (my_vit, plugin ...)``."""
    test, expected = EXPECTED.get(kind, (None, ""))
    if test is not None and not test(built):
        raise PluginError(f"{who}: the factory returned {describe(built)}, not {expected}")
    problems = declaration_problems(built, loss=kind in ("loss", "distill_loss"))
    if kind in DECLARING_KINDS and problems:
        raise PluginError(f"{who}: {problems[0]}")


#: Kinds whose built objects declare the optional members of :data:`OPTIONAL_MEMBERS`.
DECLARING_KINDS = ("encoder", "similarity", "loss", "distill_loss")


def declaration_problems(built: Any, *, loss: bool) -> list[str]:
    """Optional members declared with the wrong type: a non-bool capability, and (``loss``) a
    ``requires`` that is a string or names no ``LossContext`` field (it would be silently ignored)."""
    problems = []
    for name in BOOLEAN_MEMBERS:
        value = getattr(built, name, False)
        if not isinstance(value, bool):
            problems.append(f"{type(built).__name__}.{name} must be True or False, got {value!r}")
    if not loss:
        return problems
    requires = getattr(built, "requires", frozenset())
    if isinstance(requires, str | bytes) or not isinstance(requires, set | frozenset | tuple | list):
        problems.append(f"{type(built).__name__}.requires must be a frozenset of names, got {requires!r}")
    else:
        unknown = sorted(map(str, set(requires) - CONTEXT_FIELDS))
        if unknown:
            problems.append(
                f"{type(built).__name__}.requires names unknown LossContext field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(CONTEXT_FIELDS))}"
            )
    return problems


def describe(built: Any) -> str:
    """A short name for what a factory returned: ``a function``, ``an int``, ``a Tensor``."""
    name = "function" if callable(built) and type(built).__name__ == "function" else type(built).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}"


def plugin_label(kind: str, plugin: Any) -> str:
    """``the similarity my_pkg.sims.MySim``: how a per-step refusal names the plugin object."""
    cls = type(plugin)
    return f"the {kind} {cls.__module__}.{cls.__qualname__}"


def check_logits(logits: Any, rows: int, cols: int, who: str) -> Any:
    """``logits`` as a similarity returned them for ``rows`` anchors against ``cols`` candidates,
    refused (:class:`PluginError` naming ``who``) unless a :class:`~clipkit.contract.types.Logits`
    with i2t [rows, cols] and t2i [cols, rows]: a plain tensor or another shape would fail deep in
    the loss, or (one column short) score each anchor against the wrong candidates."""
    from clipkit.contract.types import Logits

    if not isinstance(logits, Logits):
        raise PluginError(f"{who}: forward returned {describe(logits)}, not Logits(i2t, t2i)")
    for name, tensor, shape in (("i2t", logits.i2t, (rows, cols)), ("t2i", logits.t2i, (cols, rows))):
        found = tuple(getattr(tensor, "shape", ()))
        if found != shape:
            raise PluginError(
                f"{who}: Logits.{name} has shape {found} for {rows} x {cols} point sets; expected {shape}"
            )
    return logits


def check_loss_output(output: Any, who: str) -> Any:
    """What a loss returned, refused (:class:`PluginError` naming ``who``) unless a
    :class:`~clipkit.contract.types.LossOutput` whose ``loss`` is a scalar tensor (backward and the
    finiteness check read one number)."""
    import torch

    from clipkit.contract.types import LossOutput

    if not isinstance(output, LossOutput):
        raise PluginError(
            f"{who}: returned {describe(output)}, not LossOutput(loss=<scalar tensor>, metrics)"
        )
    if not isinstance(output.loss, torch.Tensor) or output.loss.dim() != 0:
        shape = tuple(output.loss.shape) if isinstance(output.loss, torch.Tensor) else None
        what = f"a tensor of shape {shape}" if shape is not None else describe(output.loss)
        raise PluginError(f"{who}: LossOutput.loss is {what}, not a scalar tensor (reduce it, e.g. .mean())")
    return output
