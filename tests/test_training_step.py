"""The step module (clipkit/train/step.py) and the loss's ``stateful`` declaration, without training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clipkit.config.recipe import load_recipe
from clipkit.contract.registry import default_registry
from clipkit.contract.types import optional_member
from clipkit.errors import ClipkitError
from clipkit.model import build_model
from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss
from clipkit.train.objective import build_objective, check_loss_fits_runtime
from clipkit.train.runtime.strategy import StepResult
from clipkit.train.step import TrainingStep


@pytest.fixture(scope="module")
def recipe_and_model():
    registry = default_registry()
    recipe = load_recipe("quickstart@smoke", [], registry=registry)
    return recipe, build_model(recipe, registry)


@pytest.fixture(scope="module")
def model(recipe_and_model):
    return recipe_and_model[1]


@pytest.fixture(scope="module")
def objective(recipe_and_model):
    recipe, model = recipe_and_model
    return build_objective(recipe, default_registry(), model)


def test_the_step_module_has_exactly_the_models_parameters_and_state(model, objective):
    """What DDP buckets, ZeRO partitions and checkpoints see must not change with the wrapper."""
    step = TrainingStep(model, objective)
    assert [n for n, _ in step.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(step.parameters(), model.parameters(), strict=True))
    assert list(step.state_dict()) == list(model.state_dict())
    assert step.model is model and "model" not in dict(step.named_children())


def test_the_step_module_trains_and_evaluates_the_model_its_way(model, objective):
    """``train()`` is the model's own (locked towers stay in eval mode)."""
    step = TrainingStep(model, objective)
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
    from clipkit.config.recipe import DistributedConfig
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


# ----------------------------------------------------------------------------- the loss pass alone


def test_the_loss_pass_needs_only_a_model_an_objective_and_a_batch(recipe_and_model, objective):
    """No trainer: the step's loss is the recipe's loss on the model's similarity of its features."""
    from clipkit.contract.testing import synthetic_batch

    recipe, model = recipe_and_model
    batch = synthetic_batch(model, 8, recipe["model"]["image_size"], seed=3)
    loss, out = TrainingStep(model, objective)(batch, 0, 0.0)
    a, b = model(batch)
    logits = model.similarity(a.float(), b.float())
    by_hand = objective.loss(logits, torch.arange(8), objective.context({}, a, b, 0, 0.0))
    assert objective.tile_size is None and out.loss is loss
    assert float(loss) == pytest.approx(float(by_hand.loss), rel=1e-6)


def test_a_tiled_objective_equals_the_full_one_in_value_and_gradient(recipe_and_model, objective):
    from dataclasses import replace

    from clipkit.contract.testing import synthetic_batch

    recipe, model = recipe_and_model
    batch = synthetic_batch(model, 7, recipe["model"]["image_size"], seed=4)  # 7: ragged tiles of 3
    results = []
    for tile_size in (None, 3):
        model.zero_grad(set_to_none=True)
        loss, _ = TrainingStep(model, replace(objective, tile_size=tile_size))(batch, 0, 0.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss), grads))
    (full, full_grads), (tiled, tiled_grads) = results
    assert tiled == pytest.approx(full, rel=1e-5) and set(full_grads) == set(tiled_grads)
    assert "similarity.log_scale" in full_grads
    for name, grad in full_grads.items():  # fp32: a tile's sums round differently than the whole row's
        scale = max(float(grad.abs().max()), 1e-3)
        assert float((tiled_grads[name] - grad).abs().max()) <= 1e-4 * scale, name


def test_the_built_trainer_runs_the_same_objective(tmp_path):
    """build_trainer's step and a step built from the recipe alone give the same loss on a batch."""
    from clipkit.contract.testing import synthetic_batch
    from clipkit.train.build import build_trainer

    registry = default_registry()
    recipe = load_recipe("quickstart@smoke", ["data.num_workers=0"], registry=registry)
    trainer = build_trainer(recipe, tmp_path / "run", registry)
    batch = synthetic_batch(trainer.model, 32, recipe["model"]["image_size"], seed=5)
    alone = TrainingStep(trainer.model, build_objective(recipe, registry, trainer.model))
    trained, built_alone = float(trainer.step(batch, 0, 0.0).loss), float(alone(batch, 0, 0.0).loss)
    assert trained == pytest.approx(built_alone, rel=1e-7)
    assert trainer.loss is trainer.objective.loss and trainer.objective.tile_size is None


def test_check_training_step_passes_a_good_loss_and_catches_a_broken_one():
    from clipkit.contract.hookspecs import hookimpl
    from clipkit.contract.testing import check_training_step
    from clipkit.contract.types import LossOutput

    assert torch.isfinite(check_training_step(["loss.name=siglip"]).loss)

    class NaNLoss:
        requires = frozenset()

        def __call__(self, logits, targets, ctx):
            return LossOutput(logits.i2t.sum() * float("nan"), {})

    class Plugin:
        @hookimpl
        def register_losses(self, register):
            register("nan_loss", NaNLoss)

    with pytest.raises(AssertionError, match="loss is"):
        check_training_step(["loss.name=nan_loss"], plugin=Plugin())


def test_the_in_memory_stream_resumes_where_it_stopped():
    from clipkit.data.memory import InMemoryStream

    batches = [{"index": torch.arange(i * 2, i * 2 + 2)} for i in range(3)]
    stream = InMemoryStream(batches)
    taken = iter(stream)
    first = [next(taken)["index"][0].item() for _ in range(4)]  # 0, 2, 4, then 0 again
    assert first == [0, 2, 4, 0] and stream.position() == {"epoch": 1, "batch_in_epoch": 1}
    again = InMemoryStream(batches)
    again.restore(stream.position())
    assert next(iter(again))["index"][0].item() == 2 and stream.num_samples == 6
