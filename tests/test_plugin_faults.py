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
