"""Bounded learnable parameters of the similarity and the loss (CLIP's logit scale ≤ 100, KME's γ,
CLOOB's learned 1/τ), kept in bounds the way open_clip keeps CLIP's: the parameter itself is
clamped in place, without gradient, after every applied optimiser step. The forward pass then
uses the parameter as it is, with its gradient, so a scale that reached its bound can come back
down (clamping the value in the forward pass instead zeroes the gradient at the bound for good).

A module declares its bounds with the optional member ``parameter_bounds()`` (:mod:`clipkit.contract.types`):
``{attribute name: (low, high)}``, None for an open side. :func:`bounded_parameters` collects them
once per run from every sub-module of the similarity and the loss (a ``dot`` scale inside WPSE
included); :meth:`clipkit.train.runtime.Runtime.clamp_parameters` applies them where the
parameters' authoritative copy lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from clipkit.contract.types import optional_member
from clipkit.errors import ClipkitError


@dataclass(frozen=True)
class Bound:
    """One bounded parameter: ``name`` (qualified, for messages), the parameter, its bounds."""

    name: str
    parameter: nn.Parameter
    low: float | None
    high: float | None


def bounded_parameters(**roots: object) -> tuple[Bound, ...]:
    """The trainable parameters that ``roots`` (e.g. ``similarity=..., loss=...``; non-modules are
    skipped) and their sub-modules declare bounds for; a declaration naming no parameter of its
    module, or an empty interval, is refused."""
    found: list[Bound] = []
    for root_name, root in roots.items():
        if not isinstance(root, nn.Module):
            continue
        for prefix, module in root.named_modules():
            declared = optional_member(module, "parameter_bounds")
            if declared is None:
                continue
            for name, (low, high) in declared().items():
                qualified = ".".join(part for part in (root_name, prefix, name) if part)
                parameter = module._parameters.get(name)
                if parameter is None:
                    raise ClipkitError(
                        f"{type(module).__name__}.parameter_bounds names {name!r}, not a parameter of it"
                    )
                if low is not None and high is not None and low > high:
                    raise ClipkitError(f"{qualified}: the bounds ({low}, {high}) are an empty interval")
                if parameter.requires_grad:  # a frozen parameter never leaves its bounds
                    found.append(Bound(qualified, parameter, low, high))
    return tuple(found)


@torch.no_grad()
def clamp_in_place(bounds: tuple[Bound, ...]) -> None:
    """Clamp every bounded parameter in place (open_clip: ``logit_scale.clamp_(0, math.log(100))``)."""
    for bound in bounds:
        bound.parameter.clamp_(min=bound.low, max=bound.high)
