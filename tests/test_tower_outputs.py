"""A third-party tower whose forward returns the wrong thing is one line naming the slot and the
plugin, when the model first runs it (docs/plugins.md), not a traceback deep in the similarity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipkit.config.recipe import load_recipe
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.contract.types import PointSet
from clipkit.errors import PluginError
from clipkit.model import build_model


class Tower(nn.Module):
    """An image tower returning ``kind``: a plain tensor, one set too few, or a good PointSet."""

    def __init__(self, kind: str, embed_dim: int):
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(3, embed_dim)

    def forward(self, images):
        x = self.proj(images.mean(dim=(2, 3)))
        if self.kind == "tensor":
            return x
        return PointSet(x[1:, None] if self.kind == "short" else x[:, None])


class Towers:
    @hookimpl
    def register_encoders(self, register):
        for kind in ("tensor", "short", "good"):
            register(f"{kind}_tower", lambda embed_dim, kind=kind: Tower(kind, embed_dim))


@pytest.fixture(scope="module")
def registry():
    return Registry(make_plugin_manager(autoload=False, extra_plugins=[Towers()]))


def model_with(registry, tower: str):
    recipe = load_recipe("quickstart", [f"model.image_encoder={{name: {tower}}}"], registry=registry)
    return build_model(recipe, registry)


@pytest.mark.parametrize(
    "tower, expected",
    [
        ("tensor_tower", "forward returned a Tensor, not a PointSet"),
        ("short_tower", "forward returned 2 point sets for a batch of 3"),
    ],
)
def test_a_wrong_tower_output_is_one_line_naming_slot_and_plugin(registry, tower, expected):
    model = model_with(registry, tower)
    with pytest.raises(PluginError) as error:
        model.encode_image(torch.zeros(3, 3, 48, 48))
    message = str(error.value)
    assert message.startswith(f"model.image_encoder ({tower}, plugin ") and "Towers" in message
    assert expected in message and "\n" not in message


def test_a_good_tower_output_passes(registry):
    model = model_with(registry, "good_tower")
    assert model.encode_image(torch.zeros(3, 3, 48, 48)).points.shape == (3, 1, 64)
