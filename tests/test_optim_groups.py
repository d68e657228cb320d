"""Optimizer groups (issue 39 item 2): layer-wise lr decay per tower, per-tower and similarity lr
and weight decay, their recipe validation, and LAMB from pytorch-optimizer (skipped without it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.errors import ClipkitError, RecipeError
from clipkit.model import build_model, build_slot
from clipkit.plugins import optim
from clipkit.plugins.optim_groups import layer_ids

SMOKE = "quickstart@smoke"


class Tower(nn.Module):
    """Embedding, ``depth`` blocks, final norm and projection: the layout of a ViT / text tower."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.pos = nn.Parameter(torch.zeros(3, 4))
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(depth))
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Parameter(torch.zeros(4, 2))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image_encoder, self.text_encoder = Tower(3), Tower(2)
        self.similarity = nn.Module()
        self.similarity.log_scale = nn.Parameter(torch.tensor(2.0))


def group_of(optimizer, parameter) -> dict:
    (group,) = [g for g in optimizer.param_groups if any(p is parameter for p in g["params"])]
    return group


def test_layer_ids_follow_the_blocks_the_names_show():
    names = [name for name, _ in Tower(3).named_parameters()]
    ids, depth = layer_ids(names)
    assert depth == 3
    assert ids["embed.weight"] == ids["pos"] == 0
    assert [ids[f"blocks.{i}.1.weight"] for i in range(3)] == [1, 2, 3]
    assert ids["norm.weight"] == ids["proj"] == 4
    assert layer_ids(["a.weight", "b.bias"]) == ({"a.weight": 1, "b.bias": 1}, 0)


def test_every_group_holds_its_tower_layer_and_similarity_lr_and_decay():
    model = Model()
    optimizer = optim.adamw(
        list(model.named_parameters()),
        lr=1.0,
        weight_decay=0.1,
        layer_decay=0.5,
        text_layer_decay=0.8,
        text_lr=2.0,
        similarity_lr=0.01,
        image_weight_decay=0.3,
    )
    image, text = model.image_encoder, model.text_encoder
    # image: L = 3, lr = 1 · 0.5^(4 - layer)
    expected_image = {image.embed.weight: 0.5**4, image.pos: 0.5**4, image.blocks[0][1].weight: 0.5**3,
                      image.blocks[2][0].bias: 0.5**1, image.norm.weight: 1.0, image.proj: 1.0}  # fmt: skip
    for parameter, lr in expected_image.items():
        assert group_of(optimizer, parameter)["lr"] == pytest.approx(lr)
    # text: L = 2, its own lr 2 and layer decay 0.8
    expected_text = {text.embed.bias: 2 * 0.8**3, text.blocks[1][1].weight: 2 * 0.8, text.proj: 2.0}
    for parameter, lr in expected_text.items():
        assert group_of(optimizer, parameter)["lr"] == pytest.approx(lr)
    # weight decay: the tower's own on matrices, none on vectors; the scale keeps its lr, undecayed
    assert group_of(optimizer, image.blocks[0][1].weight)["weight_decay"] == 0.3
    assert group_of(optimizer, image.blocks[0][1].bias)["weight_decay"] == 0.0
    assert group_of(optimizer, text.blocks[0][1].weight)["weight_decay"] == 0.1
    scale = group_of(optimizer, model.similarity.log_scale)
    assert scale["lr"] == 0.01 and scale["weight_decay"] == 0.0 and scale["name"] == "similarity/no_decay"
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_the_schedule_keeps_the_ratios_and_an_explicit_similarity_decay_applies():
    model = Model()
    optimizer = optim.sgd(
        list(model.named_parameters()), lr=1.0, layer_decay=0.5, similarity_weight_decay=0.05
    )
    schedule = optim.constant(optimizer, total_steps=10, warmup_steps=4)  # factor 1/4 at step 0
    head, embed = model.image_encoder.proj, model.image_encoder.embed.weight
    assert group_of(optimizer, head)["lr"] == pytest.approx(0.25)
    assert group_of(optimizer, embed)["lr"] == pytest.approx(0.25 * 0.5**4)
    assert group_of(optimizer, model.similarity.log_scale)["weight_decay"] == 0.05
    del schedule


def test_uniform_settings_keep_the_two_groups_clipkit_always_had():
    model = Model()
    optimizer = optim.adamw(list(model.named_parameters()), lr=0.1, weight_decay=0.2)
    assert [g["name"] for g in optimizer.param_groups] == ["all/decay", "all/no_decay"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]


def test_locked_parameters_are_left_out():
    model = Model()
    model.text_encoder.requires_grad_(False)
    optimizer = optim.adamw(list(model.named_parameters()), layer_decay=0.9)
    assert not any(name.startswith("text_encoder") for name in (g["name"] for g in optimizer.param_groups))


def test_a_real_recipes_towers_get_their_depth(registry):
    recipe = validate_or_raise(
        load_recipe(SMOKE, ["optimizer.layer_decay=0.5", "optimizer.lr=1.0"], registry=registry), registry
    )
    model = build_model(recipe, registry)
    optimizer = build_slot(
        registry, "optimizer", recipe["optimizer"], "optimizer", list(model.named_parameters())
    )
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    image_layers = sorted(
        int(n.split("/layer")[1].split("/")[0]) for n in lrs if n.startswith("image_encoder")
    )
    depth = image_layers[-1] - 1
    assert depth >= 1 and image_layers[0] == 0
    assert lrs[f"image_encoder/layer{depth + 1}/decay"] == pytest.approx(1.0)
    assert lrs["image_encoder/layer1/decay"] == pytest.approx(0.5**depth)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.layer_decay=1.5", "optimizer.layer_decay: must be > 0 and <= 1, got 1.5"),
        ("optimizer.layer_decay=0", "optimizer.layer_decay: must be > 0"),
        ("optimizer.text_lr=-1", "optimizer.text_lr: must be > 0"),
        ("optimizer.similarity_weight_decay=-0.1", "optimizer.similarity_weight_decay: must be >= 0"),
        ("optimizer.image_layer_decay=2", "optimizer.image_layer_decay: must be > 0 and <= 1, got 2"),
        ("optimizer.image_lr=fast", "optimizer.image_lr"),
    ],
)
def test_validate_names_the_bad_key(registry, override, message):
    with pytest.raises(RecipeError, match=message):
        validate_or_raise(load_recipe(SMOKE, [override], registry=registry), registry)


def test_lamb_comes_from_pytorch_optimizer_with_the_groups():
    pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer import Lamb

    model = Model()
    optimizer = optim.lamb(list(model.named_parameters()), lr=0.5, layer_decay=0.5, similarity_lr=0.1)
    assert isinstance(optimizer, Lamb)
    assert group_of(optimizer, model.image_encoder.proj)["lr"] == 0.5
    assert group_of(optimizer, model.similarity.log_scale)["lr"] == 0.1
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    before = model.image_encoder.proj.detach().clone()
    optimizer.step()
    assert not torch.equal(model.image_encoder.proj.detach(), before)


def test_lamb_without_the_package_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import fails as if not installed
    with pytest.raises(ClipkitError, match=r"pip install 'clipkit-contrastive\[lamb\]'"):
        optim.lamb(list(Model().named_parameters()))
