"""``clipkit.load(export, device="cuda")``: a tiny export encodes images and text on CUDA and scores them
as the same export loaded on the CPU does.

Exports of clip@tiny (one point per side), kme_clip@tiny (weighted token sets) and wpse@tiny (random
features drawn on the CPU with the export's eval seed, then moved) are written from freshly built,
untrained models (loading does not care whether a model was trained).

Tolerance (relative error ‖cuda − cpu‖/‖cpu‖, NaN/inf never passes): 1e-4 for the image and text
points, the weights and the logits. Both sides compute in IEEE fp32: the test sets torch's matmul
precision to "highest" and turns off cuDNN's TF32 (on by default, it would round the ViT's
patch-embedding convolution inputs to 10 mantissa bits, ~3e-4 relative). What remains is the order
of fp32 operations in different kernels, ~1e-6 relative through these few layers.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import clipkit
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.model import build_model

pytestmark = pytest.mark.gpu
CAPTIONS = ["a small red circle at the top left", "a large blue square", "a green triangle at the bottom"]
COLOURS = ["red", "blue", "green", "yellow"]


def write_tiny_export(spec: str, directory, registry):
    recipe = validate_or_raise(load_recipe(spec, [], registry=registry), registry)
    torch.manual_seed(0)
    return write_export(build_model(recipe, registry), recipe, directory, registry)


def encode(export, device, registry):
    """(image points, image weights, text points, text weights, logits) on ``device``, back on the CPU."""
    model, preprocess, _ = clipkit.load(export, device=device, registry=registry)
    pictures = [Image.new("RGB", (52, 44), colour) for colour in COLOURS]
    images = torch.stack([preprocess(p) for p in pictures])
    images = images + 0.05 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    image_points, text_points = model.encode_image(images), model.encode_text(CAPTIONS)
    logits = model.similarity(image_points, text_points)
    assert logits.device.type == torch.device(device).type
    out = {"image": image_points.points, "text": text_points.points, "logits": logits}
    if image_points.weights is not None:
        out["image_weights"] = image_points.weights
    if text_points.weights is not None:
        out["text_weights"] = text_points.weights
    return {name: tensor.float().cpu() for name, tensor in out.items()}


@pytest.mark.parametrize("spec", ["clip@tiny", "kme_clip@tiny", "wpse@tiny"])
def test_export_loaded_on_device_matches_cpu(
    spec, gpu_device, gpu_registry, tmp_path, relative_error, fp32_matmul_precision
):
    """Points, weights and logits from ``clipkit.load(device=cuda)`` vs ``device=cpu``, all in IEEE
    fp32: within 1e-4."""
    fp32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # restored by the fixture
    export = write_tiny_export(spec, tmp_path / "export", gpu_registry)
    on_device, on_cpu = encode(export, gpu_device, gpu_registry), encode(export, "cpu", gpu_registry)
    assert on_device.keys() == on_cpu.keys()
    errors = {name: relative_error(on_device[name], on_cpu[name]) for name in on_cpu}
    print(f"load {spec} on {gpu_device}: {errors}")
    assert all(error <= 1e-4 for error in errors.values()), errors
