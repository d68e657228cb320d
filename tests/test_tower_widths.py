"""A tower whose points the similarity cannot compare (another width than the other tower's), or
that cannot even build its PointSet (points [B, d]), is one line naming the slot and plugin: never a
matmul traceback deep in the similarity, nor PointSet's own ValueError inside the plugin."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.contract.types import PointSet, PointSetError
from clipkit.errors import PluginError
from clipkit.model import build_model

runner = CliRunner()


class WideTower(nn.Module):
    """Ignores the embed_dim it is given: its points are 96 wide."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 96)

    def forward(self, x):
        return PointSet(self.proj(torch.ones(x.shape[0], 1, 1)))


class FlatTower(nn.Module):
    """Builds a PointSet from a plain [B, d] embedding (it needs [B, 1, d])."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(1, embed_dim)

    def forward(self, x):
        return PointSet(self.proj(torch.ones(x.shape[0], 1)))


class Towers:
    @hookimpl
    def register_encoders(self, register):
        register("wide_tower", WideTower)
        register("flat_tower", FlatTower)


def plugin_manager():
    return make_plugin_manager(autoload=False, extra_plugins=[Towers()])


def smoke_model(encoder: str):
    registry = Registry(plugin_manager())
    recipe = api.resolve("quickstart@smoke", [f"model.image_encoder.name={encoder}"], registry=registry)
    return build_model(recipe, registry), recipe


def smoke_batch(model, size: int = 3) -> dict:
    return {"image": torch.rand(size, 3, 48, 48), "text": torch.as_tensor(model.tokenizer(["a"] * size))}


def test_towers_of_two_widths_are_one_line_naming_both_towers_and_the_similarity():
    """Was ``mat1 and mat2 shapes cannot be multiplied (32x96 and 64x32)`` from dot.products."""
    model, _ = smoke_model("wide_tower")
    with pytest.raises(PluginError) as refused:
        model(smoke_batch(model))
    message = str(refused.value)
    assert "model.image_encoder (wide_tower, plugin " in message and "width 96" in message
    assert "model.text_encoder (text_transformer_tiny, plugin " in message and "width 64" in message
    assert "the similarity (dot, plugin " in message and "\n" not in message


def test_a_two_dimensional_point_set_names_the_slot_and_what_a_point_set_holds():
    model, _ = smoke_model("flat_tower")
    with pytest.raises(PluginError) as refused:
        model.encode_image(torch.rand(2, 3, 48, 48))
    message = str(refused.value)
    assert message.startswith("model.image_encoder (flat_tower, plugin ")
    assert "got shape (2, 64)" in message and "points [B, M, d]" in message
    assert isinstance(refused.value.__cause__, PointSetError)


def test_a_point_set_error_is_still_a_value_error():
    """Plugins' own tests that expect PointSet's ValueError keep passing."""
    with pytest.raises(ValueError, match=r"must be \[B, M, d\]"):
        PointSet(torch.zeros(2, 4))


@pytest.mark.parametrize(
    "encoder, expected",
    [
        ("wide_tower", "returns points of width 96 but model.text_encoder"),
        ("flat_tower", "forward built an invalid PointSet: PointSet.points must be [B, M, d]"),
    ],
)
def test_train_refuses_such_a_tower_in_one_line_before_the_first_step(
    encoder, expected, in_tmp, smoke_shards
):
    """``clipkit train`` printed a traceback; now one line, from the model's first forward (the
    memory estimate's, before a step is taken)."""
    from smoke_data import place_smoke_shards

    place_smoke_shards(in_tmp, smoke_shards)
    app = make_app(plugin_manager())
    overrides = [f"model.image_encoder.name={encoder}", "train.steps=1", "data.num_workers=0"]
    result = runner.invoke(app, ["train", "quickstart@smoke", *overrides, "--run-dir", "run"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and f"({encoder}, plugin " in errors[0]
    assert "Traceback" not in result.output and not (in_tmp / "run" / "checkpoints").exists()
