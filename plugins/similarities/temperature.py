"""Positive learnable scalars (logit scales, kernel bandwidths) shared by the similarities.

Stored as a log so the optimiser works on an unconstrained value. The upper bound is kept the way
open_clip keeps CLIP's logit scale at most 100: the *parameter* is clamped in place after every
optimiser step (the training loop applies each module's :func:`log_bounds`, see
``parameter_bounds`` in :mod:`clipkit.contract.types`), and the forward pass uses exp(parameter) with its
gradient — so a scale that reached its bound can come back down. (Clamping the value in the forward
pass instead, as this module once did, stops the gradient at the bound for good: METHODS §1.)

The forward still clamps in log space (:func:`bounded_exp`): for a parameter within its bound that
is the identity with gradient 1 (``clamp``'s gradient is 1 at the bound itself), and it keeps a
fixed buffer, or a parameter loaded from an older checkpoint, within its bound.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: How far (relative) a start may exceed its bound and still be read as *at* the bound: a scale read
#: back from a checkpoint clamped at 100 (`clipkit convert`) is exp of a rounded log 100: 100.0000064
#: from fp32, 100.03 from fp16 (OpenAI's released weights), up to 102 from a bf16 rounded up.
START_TOLERANCE = 0.03


def check_start(
    name: str, value: float, bound_name: str, maximum: float | None, fix: str | None = None
) -> None:
    """Refuse a start ``value`` above its ``maximum`` (one-line ValueError naming both, and ``fix``).

    :func:`register_log_value` would store min(value, maximum): the run would start at the bound, not
    at the value the recipe asked for, and say nothing (``similarity.init_scale=200`` with CLIP's
    ``max_scale`` 100 trained at 100).
    """
    if maximum is not None and value > maximum * (1 + START_TOLERANCE):
        fix = fix or f"raise {bound_name} (null: no bound) or lower {name}"
        raise ValueError(
            f"{name} ({value:g}) must be <= {bound_name} ({maximum:g}): the value would start clamped "
            f"to {maximum:g}, unseen; {fix}"
        )


def register_log_value(
    module: nn.Module, name: str, value: float, *, learnable: bool, maximum: float | None = None
) -> None:
    """Store log(min(value, maximum)) on ``module`` as a parameter (learnable) or a buffer (fixed,
    still saved).

    Stored with shape [1], not as a 0-d tensor: DeepSpeed's engine cannot broadcast 0-d
    parameters (it views each as bytes); :func:`bounded_exp` still returns a 0-d value.
    """
    start = value if maximum is None else min(value, maximum)
    log_value = torch.tensor([math.log(start)])
    if learnable:
        setattr(module, name, nn.Parameter(log_value))
    else:
        module.register_buffer(name, log_value)


def bounded_exp(log_value: Tensor, maximum: float | None) -> Tensor:
    """0-d tensor exp(min(log_value, log maximum)) (None: no bound); ``log_value`` has one element.

    Within the bound this is exp(log_value) with its full gradient (also at the bound itself), as
    open_clip's ``logit_scale.exp()``; the bound is the parameter's, applied after each step.
    """
    if maximum is not None:
        log_value = log_value.clamp(max=math.log(maximum))
    return log_value.exp().reshape(())


def log_bounds(
    module: nn.Module, name: str, maximum: float | None
) -> dict[str, tuple[float | None, float | None]]:
    """``{name: (None, log maximum)}`` when ``module.<name>`` is a learnable parameter with a bound,
    else ``{}``: a similarity's ``parameter_bounds()`` (clamped in place after each optimiser step)."""
    if maximum is None or not isinstance(getattr(module, name), nn.Parameter):
        return {}
    return {name: (None, math.log(maximum))}


def scale_refusal(similarity: nn.Module, inverse_tau: float, loss_key: str, *, fixed: bool) -> str | None:
    """Why ``similarity``'s logits are not scaled by 1/τ = ``inverse_tau``, the temperature a loss
    assumes (its argument ``loss_key``), or — with ``fixed`` — may leave it while training (a learnt
    scale or bias); None when they are, or when the similarity has no ``scale()`` to compare.

    A loss that folds τ into its own formula (NUCLR's Σ = τ·L, CLOOB's factor τ) reads another
    objective, silently, when the two slots disagree, e.g. after a recipe override of one of them.
    """
    scale = getattr(similarity, "scale", None)
    if not callable(scale):
        return None
    value = float(scale().detach())
    name = type(similarity).__name__
    if not math.isclose(value, inverse_tau, rel_tol=1e-4):
        return (
            f"{loss_key} needs logits scaled by 1/τ = {inverse_tau:g}, but the similarity ({name}) scales "
            f"them by {value:g}: the two must share one τ; set the similarity's scale "
            f"(similarity.init_scale, or similarity.inverse_tau for hopfield, not clipped by max_scale) "
            f"to {inverse_tau:g}, or the loss's τ to match it"
        )
    learned = sorted(name for name, parameter in similarity.named_parameters() if parameter.requires_grad)
    if fixed and learned:
        return (
            f"{loss_key} needs a fixed logit scale 1/τ, but the similarity ({name}) learns "
            f"{', '.join(learned)}; set similarity.learn_scale=false (and no bias)"
        )
    return None
