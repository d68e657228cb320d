"""The step module (clipkit/train/step.py) and the loss's ``stateful`` declaration, without training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clipkit.errors import ClipkitError
from clipkit.model import build_model
from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss
from clipkit.recipe import load_recipe
from clipkit.registry import default_registry
from clipkit.train.build import check_loss_fits_runtime
from clipkit.train.runtime.strategy import StepResult
from clipkit.train.step import TrainingStep
from clipkit.types import optional_member


@pytest.fixture(scope="module")
def model():
    registry = default_registry()
    return build_model(load_recipe("quickstart@smoke", [], registry=registry), registry)


def test_the_step_module_has_exactly_the_models_parameters_and_state(model):
    """What DDP buckets, ZeRO partitions and checkpoints see must not change with the wrapper."""
    step = TrainingStep(model)
    assert [n for n, _ in step.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(step.parameters(), model.parameters(), strict=True))
    assert list(step.state_dict()) == list(model.state_dict())
    assert step.model is model and "model" not in dict(step.named_children())


def test_the_step_module_trains_and_evaluates_the_model_its_way(model):
    """``train()`` is the model's own (locked towers stay in eval mode)."""
    step = TrainingStep(model)
    model.frozen_towers = ("text_encoder",)
    try:
        step.train()
        assert step.training and model.training and model.image_encoder.training
        assert not model.text_encoder.training
        step.eval()
        assert not step.training and not model.image_encoder.training
    finally:
        model.frozen_towers = ()
        model.train()


class IndexReader:
    """A loss that reads sample ids but keeps no state."""

    requires = frozenset({"index"})


def accumulating_runtime():
    plan = SimpleNamespace(micro_batches=4)
    return SimpleNamespace(plan=plan, exact_accumulation_refusal=None, local_loss=False)


def test_stateful_is_declared_not_implied_by_index(model):
    assert optional_member(IndexReader(), "stateful") is False
    assert NUCLRLoss.stateful is True and SogCLRLoss.stateful is True
    check_loss_fits_runtime(IndexReader(), model.similarity, accumulating_runtime())  # accepted
    stateful = IndexReader()
    stateful.stateful = True
    with pytest.raises(ClipkitError, match="per-sample state"):
        check_loss_fits_runtime(stateful, model.similarity, accumulating_runtime())


def test_an_unapplied_step_is_an_overflow_or_a_bad_gradient():
    assert StepResult(False, float("inf"), overflowed=True).bad_gradient is False
    assert StepResult(False, float("nan")).bad_gradient is True
    assert StepResult(True, 1.0).bad_gradient is False


def test_a_non_finite_gradient_without_loss_scaling_is_a_bad_gradient():
    """fp32 (no GradScaler): the runtime refuses the step and says it was not an overflow."""
    from clipkit.recipe import DistributedConfig
    from clipkit.train.runtime import Runtime

    rt = Runtime(precision="no", seed=0, distributed=DistributedConfig(), global_batch_size=2)
    layer = torch.nn.Linear(2, 2)
    layer, optimizer = rt.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    before = layer.weight.detach().clone()
    rt.backward(layer(torch.full((1, 2), float("nan"))).sum(), layer)
    result = rt.step(layer, optimizer)
    assert not result.applied and result.bad_gradient
    assert torch.equal(layer.weight, before)
    rt.backward(layer(torch.ones(1, 2)).sum(), layer)
    assert rt.step(layer, optimizer).applied and not torch.equal(layer.weight, before)
