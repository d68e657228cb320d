"""Positive learnable scalars (logit scales, kernel bandwidths) shared by the similarities.

Stored as a log so the optimiser works on an unconstrained value; clamped in the forward
pass (not in place), which keeps similarities pure and stops the gradient above the
clamp, as CLIP's ``logit_scale.clamp`` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def register_log_value(module: nn.Module, name: str, value: float, *, learnable: bool) -> None:
    """Store log(value) on ``module`` as a parameter (learnable) or a buffer (fixed, still saved).

    Stored with shape [1], not as a 0-d tensor: DeepSpeed's engine cannot broadcast 0-d
    parameters (it views each as bytes); :func:`clamped_exp` still returns a 0-d value.
    """
    log_value = torch.tensor([math.log(value)])
    if learnable:
        setattr(module, name, nn.Parameter(log_value))
    else:
        module.register_buffer(name, log_value)


def clamped_exp(log_value: Tensor, maximum: float | None) -> Tensor:
    """0-d tensor exp(log_value), clamped to at most ``maximum`` (None: no clamp); ``log_value`` has
    one element."""
    value = log_value.exp().reshape(())
    return value.clamp(max=maximum) if maximum is not None else value
