"""Optimizers and schedules: parameter groups, and lr curves against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from clipkit.plugins import optim


def lrs(schedule_factory, steps: int, **kwargs) -> list[float]:
    """The lr seen by each of ``steps`` optimiser steps (base lr 1)."""
    parameter = nn.Parameter(torch.zeros(2, 2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    schedule = schedule_factory(optimizer, total_steps=steps, **kwargs)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def test_cosine_warms_up_linearly_then_decays_to_the_floor():
    seen = lrs(optim.cosine, 10, warmup_steps=2, min_lr_ratio=0.1)
    assert seen[:2] == pytest.approx([0.5, 1.0])
    # step 2 starts the cosine at progress 0; progress = (step - 2) / 8.
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]
    assert seen[2:] == pytest.approx(expected)


def test_cosine_restarts_jump_back_to_the_base_lr_every_cycle():
    seen = lrs(optim.cosine_restarts, 11, cycle_steps=4, warmup_steps=3)
    assert seen[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    cycle = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]  # 1, .854, .5, .146
    assert seen[3:] == pytest.approx(cycle + cycle)


def test_step_schedule_multiplies_by_gamma_every_step_size():
    seen = lrs(optim.step, 7, step_size=3, gamma=0.9)
    assert seen == pytest.approx([1, 1, 1, 0.9, 0.9, 0.9, 0.81])


@pytest.mark.parametrize(
    "factory, kwargs",
    [
        (optim.step, {"step_size": 0}),
        (optim.step, {"step_size": 2, "gamma": 0}),
        (optim.cosine_restarts, {"cycle_steps": 0}),
    ],
)
def test_bad_schedule_settings_are_refused(factory, kwargs):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError):
        factory(optimizer, total_steps=5, **kwargs)


def test_adam_couples_decay_into_the_gradient_of_matrices_only():
    """One Adam step on zero gradients: the decay term alone drives the update, so a decayed
    matrix moves by exactly lr (Adam normalises the step), a bias does not move."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    optimizer = optim.adam(list(layer.named_parameters()), lr=0.01, weight_decay=0.5)
    layer.weight.grad, layer.bias.grad = torch.zeros_like(layer.weight), torch.zeros_like(layer.bias)
    optimizer.step()
    # grad = wd * w; first Adam step = lr * sign(grad) (up to eps).
    torch.testing.assert_close(layer.weight.detach(), weight - 0.01 * torch.sign(weight), atol=1e-6, rtol=0)
    assert torch.equal(layer.bias.detach(), bias)
    assert isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW)
