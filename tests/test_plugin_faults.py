"""A misbehaving third-party plugin is one line naming the slot, the plugin and what is wrong: never
a traceback deep in the loop, never a run that trains on something else (docs/plugins.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.contract.types import LossOutput, PointSet
from clipkit.errors import PluginError
from clipkit.model import build_slot


class Tower(nn.Module):
    def forward(self, x):
        return PointSet(torch.zeros(x.shape[0], 1, 4))


class Loss:
    requires = frozenset()

    def __call__(self, logits, targets, ctx):
        return LossOutput(logits.i2t.sum(), {})


class WrongLoss(Loss):
    requires = ("index", "colour")  # "colour" is no LossContext field: it would be ignored


class StringLoss(Loss):
    requires = "index"  # a string: frozenset("index") is five letters


class CapabilityLoss(Loss):
    compiles = "yes"


def broken_encoder(embed_dim):
    raise TypeError("unexpected keyword 'colour'")


class Faulty:
    """One plugin registering every kind of broken factory."""

    @hookimpl
    def register_encoders(self, register):
        register("function_tower", lambda embed_dim: lambda x: PointSet(torch.zeros(x.shape[0], 1, 4)))
        register("raising_tower", broken_encoder)
        register("good_tower", lambda embed_dim: Tower())

    @hookimpl
    def register_similarities(self, register):
        register("int_similarity", lambda: 3)

    @hookimpl
    def register_losses(self, register):
        register("wrong_requires", WrongLoss)
        register("string_requires", StringLoss)
        register("string_capability", CapabilityLoss)
        register("uncallable", lambda: object())


@pytest.fixture(scope="module")
def faulty_registry():
    return Registry(make_plugin_manager(autoload=False, extra_plugins=[Faulty()]))


@pytest.mark.parametrize(
    "kind, name, expected",
    [
        ("encoder", "function_tower", "returned a function, not an nn.Module"),
        ("encoder", "raising_tower", "the factory raised TypeError: unexpected keyword 'colour'"),
        ("similarity", "int_similarity", "returned an int, not an nn.Module"),
        ("loss", "uncallable", "returned an object, not a callable"),
        ("loss", "wrong_requires", "requires names unknown LossContext field(s) colour"),
        ("loss", "string_requires", "requires must be a frozenset of names, got 'index'"),
        ("loss", "string_capability", "CapabilityLoss.compiles must be True or False, got 'yes'"),
    ],
)
def test_a_broken_factory_is_one_line_naming_slot_and_plugin(faulty_registry, kind, name, expected):
    with pytest.raises(PluginError) as error:
        build_slot(faulty_registry, kind, {"name": name}, "the.slot", embed_dim=4)
    message = str(error.value)
    assert message.startswith(f"the.slot ({name}, plugin ") and "Faulty" in message
    assert expected in message and "\n" not in message


def test_a_good_factory_still_builds(faulty_registry):
    built = build_slot(faulty_registry, "encoder", {"name": "good_tower"}, "slot", embed_dim=4)
    assert isinstance(built, Tower)


class RaisingHook:
    @hookimpl
    def register_losses(self, register):
        raise RuntimeError("boom in the hook")


def test_a_registration_hook_that_raises_is_one_line_naming_the_plugin():
    """It used to be a bare traceback from every command that builds the registry."""
    pm = make_plugin_manager(autoload=False, extra_plugins=[RaisingHook()])
    with pytest.raises(PluginError) as error:
        Registry(pm)
    message = str(error.value)
    assert "RaisingHook" in message and "(not installed)" in message
    assert "its register_losses hook raised RuntimeError: boom in the hook" in message


class TensorSimilarity(nn.Module):
    def forward(self, a, b, *, generator=None):
        return a.points[:, 0] @ b.points[:, 0].T  # a plain tensor, not Logits


class ShortSimilarity(nn.Module):
    def forward(self, a, b, *, generator=None):
        from clipkit.contract.types import Logits

        scores = a.points[:, 0] @ b.points[:, 0].T
        return Logits(i2t=scores[:, 1:], t2i=scores.T[:, 1:])  # one candidate short


class TensorLoss(Loss):
    def __call__(self, logits, targets, ctx):
        return nn.functional.cross_entropy(logits.i2t, targets)


class VectorLoss(Loss):
    def __call__(self, logits, targets, ctx):
        return LossOutput(nn.functional.cross_entropy(logits.i2t, targets, reduction="none"), {})


class WrongOutputs:
    """Plugins whose objects build fine but return the wrong thing every step."""

    @hookimpl
    def register_similarities(self, register):
        register("tensor_similarity", TensorSimilarity)
        register("short_similarity", ShortSimilarity)

    @hookimpl
    def register_losses(self, register):
        register("tensor_loss", TensorLoss)
        register("vector_loss", VectorLoss)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("similarity.name=tensor_similarity", "forward returned a Tensor, not Logits(i2t, t2i)"),
        ("similarity.name=short_similarity", "Logits.i2t has shape (16, 15) for 16 x 16 point sets"),
        ("loss.name=tensor_loss", "returned a Tensor, not LossOutput(loss=<scalar tensor>, metrics)"),
        ("loss.name=vector_loss", "LossOutput.loss is a tensor of shape (16,), not a scalar tensor"),
    ],
)
def test_a_similarity_or_loss_returning_the_wrong_thing_is_named_at_the_first_step(
    override, expected, in_tmp, smoke_shards
):
    """Was a traceback from the loop ('Tensor' object has no attribute 'loss', "Boolean value of
    Tensor with more than one value", cross-entropy's "Target 15 is out of bounds")."""
    from smoke_data import place_smoke_shards

    from clipkit.app import api

    place_smoke_shards(in_tmp, smoke_shards)
    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=[WrongOutputs()]))
    overrides = [override, "data.batch_size=16", "train.steps=1", "train.export=false", "data.num_workers=0"]
    with pytest.raises(PluginError) as refused:
        api.train("quickstart@smoke", overrides, run_dir=in_tmp / "run", registry=registry)
    kind = override.split(".")[0]
    assert f"the {kind} {__name__}." in str(refused.value) and expected in str(refused.value)
