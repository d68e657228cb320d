"""3-D DenseNet-BC encoder (y-Aware's MRI recipe): sizes, shapes, checkpointing, export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model, save_model

from clipkit.contract.testing import check_encoder
from clipkit.plugins.encoders import densenet3d
from clipkit.plugins.encoders.densenet3d import densenet3d_121, densenet3d_tiny

EMBED_DIM = 8


def make_tiny(seed: int = 0, **kwargs) -> densenet3d.DenseNet3d:
    torch.manual_seed(seed)
    return densenet3d_tiny(embed_dim=EMBED_DIM, **kwargs)


def volumes(batch: int = 3, size: int = 16) -> torch.Tensor:
    return torch.randn(batch, 1, size, size, size, generator=torch.Generator().manual_seed(1))


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def densenet_bc_backbone_parameters(
    dims: int, in_channels: int, growth=32, blocks=(6, 12, 24, 16), init=64, bn_size=4
) -> int:
    """Parameters of a DenseNet-BC backbone (stem .. final BN), counted by hand.

    A k×k (2-D) convolution becomes k×k×k in 3-D, so a conv C_in -> C_out of kernel k has
    C_in·C_out·k^dims weights (no bias); a BatchNorm over C channels has 2C (γ, β).
      stem:        conv 7^dims in_channels -> init, BN(init)
      dense layer  (C inputs): BN(C) + conv1 C -> 4g (1^dims) + BN(4g) + conv2 4g -> g (3^dims)
                   = 2C + 4g·C + 8g + 4g·g·3^dims
      transition   (C inputs): BN(C) + conv C -> C/2 (1^dims) = 2C + C·C/2
      final BN     over the last block's C channels.
    """
    bottleneck = bn_size * growth
    total = in_channels * init * 7**dims + 2 * init
    channels = init
    for i, layers in enumerate(blocks):
        for _ in range(layers):
            total += 2 * channels + channels * bottleneck + 2 * bottleneck + bottleneck * growth * 3**dims
            channels += growth
        if i != len(blocks) - 1:
            total += 2 * channels + channels * (channels // 2)
            channels //= 2
    return total + 2 * channels


def test_densenet121_parameter_count():
    """The formula reproduces torchvision's 2-D DenseNet-121 backbone (7 978 856 total − the
    1024·1000 + 1000 classifier = 6 953 856); in 3-D, one input channel:

      stem conv 64·7³ = 21 952 (2-D RGB: 3·64·7² = 9 408)
      58 dense layers' 3×3(×3) convs 58·128·32·27 = 6 414 336 (2-D: 58·128·32·9 = 2 138 112)
      everything else (BNs, 1×1 convs, transitions) unchanged: 4 806 336
      -> 11 242 624 = 6 953 856 + 58·128·32·18 + (21 952 − 9 408).
    Head: "mlp" 1024·512 + 512 + 512·128 + 128 = 590 464; "linear" 1024·128 + 128 = 131 200.
    """
    assert densenet_bc_backbone_parameters(dims=2, in_channels=3) == 6_953_856
    assert densenet_bc_backbone_parameters(dims=3, in_channels=1) == 11_242_624
    assert 6_953_856 + 58 * 128 * 32 * 18 + (21_952 - 9_408) == 11_242_624
    with torch.device("meta"):
        model = densenet3d_121(embed_dim=128)
        linear = densenet3d_121(embed_dim=128, head="linear")
        no_final_norm = densenet3d_121(embed_dim=128, final_norm=False)
    assert model.num_features == 1024
    assert count(model.backbone) == 11_242_624
    assert count(model.head) == 590_464
    assert count(linear.head) == 131_200
    assert count(no_final_norm.backbone) == 11_242_624 - 2 * 1024


def test_tiny_parameter_count_matches_formula():
    model = make_tiny()
    expected = densenet_bc_backbone_parameters(dims=3, in_channels=1, growth=4, blocks=(1, 1), init=8)
    assert model.num_features == (8 + 4) // 2 + 4
    assert count(model.backbone) == expected


def test_output_is_one_unit_point_per_volume():
    out = check_encoder(make_tiny(), volumes())
    assert out.points.shape == (3, 1, EMBED_DIM)
    assert out.weights is None and out.mask is None
    out = make_tiny(head="linear")(volumes())
    assert out.points.shape == (3, 1, EMBED_DIM)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((2, 1, 16, 16), "expected volumes"),
        ((2, 3, 16, 16, 16), "expected volumes"),
        ((2, 1, 16, 16, 8), "expected volumes"),
    ],
)
def test_rejects_wrong_volumes(shape, match):
    with pytest.raises(ValueError, match=match):
        make_tiny()(torch.zeros(shape))


def test_rejects_integer_volumes():
    with pytest.raises(ValueError, match="floating-point"):
        make_tiny()(torch.zeros(1, 1, 16, 16, 16, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"image_size": 4}, "image_size must be >= 8"),
        ({"blocks": ()}, "blocks"),
        ({"blocks": (1, 0)}, "blocks"),
        ({"head": "mlp3"}, "head"),
        ({"growth": 0}, "growth"),
        ({"in_channels": 0}, "in_channels"),
    ],
)
def test_bad_arguments(kwargs, match):
    arguments = {"embed_dim": EMBED_DIM, "image_size": 16, "growth": 4, "blocks": (1, 1), "init_features": 8}
    with pytest.raises(ValueError, match=match):
        densenet3d.densenet3d(**(arguments | kwargs))


def test_in_channels():
    torch.manual_seed(0)
    model = densenet3d_tiny(embed_dim=EMBED_DIM, in_channels=2)
    assert model(torch.randn(2, 2, 16, 16, 16)).points.shape == (2, 1, EMBED_DIM)


def run_step(model, inputs):
    """Forward + backward in training mode -> (points, grads, BatchNorm buffers)."""
    model.train()
    model.zero_grad(set_to_none=True)
    points = model(inputs).points
    (points * torch.linspace(-1, 1, points.numel()).view_as(points)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return points.detach(), grads, buffers


def test_grad_checkpointing_matches_and_updates_running_stats_once(monkeypatch):
    reference = make_tiny()
    checkpointed = make_tiny()
    ref_points, ref_grads, ref_buffers = run_step(reference, volumes())

    calls = []
    real_checkpoint = densenet3d.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(densenet3d, "checkpoint", counting_checkpoint)
    checkpointed.grad_checkpointing = True
    points, grads, buffers = run_step(checkpointed, volumes())
    assert calls == [False, False]  # one per dense layer (blocks (1, 1)), non-reentrant
    torch.testing.assert_close(points, ref_points)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=name)
    # Recomputation in backward must not update BatchNorm statistics a second time.
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, ref_buffers[name], msg=name)
    assert int(buffers["backbone.denseblock1.layers.0.norm1.num_batches_tracked"]) == 1

    calls.clear()
    checkpointed.eval()
    with torch.no_grad():
        checkpointed(volumes())
    assert calls == []


def test_gradients_reach_every_parameter():
    _, grads, _ = run_step(make_tiny(), volumes())
    assert not [name for name, grad in grads.items() if not grad.abs().sum() > 0]


def test_train_one_step_lowers_the_loss():
    model = make_tiny()
    target = torch.nn.functional.normalize(
        torch.randn(3, EMBED_DIM, generator=torch.Generator().manual_seed(2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs = volumes()

    def loss() -> torch.Tensor:
        return -(model(inputs).points[:, 0] * target).sum()

    before = loss()
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = loss()
    assert torch.isfinite(after) and after < before


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    model = make_tiny()
    run_step(model, volumes())  # non-trivial BatchNorm running statistics
    save_model(model, str(tmp_path / "model.safetensors"))
    clone = make_tiny(seed=123)
    load_model(clone, str(tmp_path / "model.safetensors"))
    model.eval()
    clone.eval()
    with torch.no_grad():
        assert torch.equal(clone(volumes()).points, model(volumes()).points)
