"""Convolutional image encoders: CLIP's modified ResNet and the standard ResNet.

Parameter counts are compared with published numbers (CLIP / OpenCLIP's model profile for the
modified ResNets, torchvision for the standard ones) and with closed-form counts derived here from
the architecture description; big presets are built on the meta device (nothing allocated).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from clipkit.contract.testing import check_encoder
from clipkit.contract.types import PointSet
from clipkit.plugins import encoders as conv_encoders
from clipkit.plugins.encoders import clip_resnet, conv_common, resnet
from clipkit.plugins.encoders.clip_resnet import AttentionPool2d, rn_tiny
from clipkit.plugins.encoders.resnet import resnet_tiny

EMBED_DIM = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny convolutions run fastest single-threaded; extra threads only contend on a busy CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_rn(**kwargs) -> clip_resnet.ModifiedResNet:
    torch.manual_seed(0)
    return rn_tiny(embed_dim=EMBED_DIM, **kwargs)


def make_resnet(**kwargs) -> resnet.ResNet:
    torch.manual_seed(0)
    return resnet_tiny(embed_dim=EMBED_DIM, **kwargs)


def images(size: int, batch: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


# name -> (builder, image size, number of points with output="tokens")
TINY = {
    "rn_tiny": (make_rn, 64, 1 + 2 * 2),  # 64 px / 32 = 2x2 grid, plus the pooled token
    "resnet_tiny": (make_resnet, 32, 4 * 4),  # CIFAR stem: 32 px / 8 = 4x4 grid
    "resnet_tiny_mlp": (lambda **kw: make_resnet(head="mlp", **kw), 32, 4 * 4),
}


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- Parameter counts ---------------------------------------------------------------------


def conv_bn(cin: int, cout: int, k: int) -> int:
    """A bias-free k x k conv followed by BatchNorm (gain + bias; running stats are buffers)."""
    return cin * cout * k * k + 2 * cout


def clip_resnet_params(layers, width: int, embed_dim: int, grid: int) -> int:
    """Closed-form count of CLIP's modified ResNet, from the paper's architecture description."""
    total = conv_bn(3, width // 2, 3) + conv_bn(width // 2, width // 2, 3) + conv_bn(width // 2, width, 3)
    inplanes = width
    for index, blocks in enumerate(layers):
        planes = width * 2**index
        for block in range(blocks):
            total += (
                conv_bn(inplanes, planes, 1) + conv_bn(planes, planes, 3) + conv_bn(planes, 4 * planes, 1)
            )
            if block == 0:  # the shortcut projection (the avg pool has no parameters)
                total += conv_bn(inplanes, 4 * planes, 1)
            inplanes = 4 * planes
    features = inplanes
    # positions (grid^2 + 1) x E, q/k/v E x E with bias, c_proj E -> d with bias
    return (
        total
        + (grid * grid + 1) * features
        + 3 * (features * features + features)
        + features * embed_dim
        + embed_dim
    )


def torchvision_resnet_backbone_params(layers, block: str, stem: str, width: int = 64) -> int:
    """Closed-form count of a torchvision-layout ResNet without ``fc``."""
    total = conv_bn(3, width, 7 if stem == "imagenet" else 3)
    expansion = 4 if block == "bottleneck" else 1
    inplanes = width
    for index, blocks in enumerate(layers):
        planes = width * 2**index
        for b in range(blocks):
            if block == "bottleneck":
                total += (
                    conv_bn(inplanes, planes, 1) + conv_bn(planes, planes, 3) + conv_bn(planes, 4 * planes, 1)
                )
            else:
                total += conv_bn(inplanes, planes, 3) + conv_bn(planes, planes, 3)
            if b == 0 and (index > 0 or inplanes != planes * expansion):
                total += conv_bn(inplanes, planes * expansion, 1)
            inplanes = planes * expansion
    return total


@pytest.mark.parametrize(
    "build, embed_dim, published, formula_args",
    [
        # CLIP's visual towers; OpenCLIP's model profile lists 38.32M / 56.26M / 87.14M image params.
        (clip_resnet.rn50, 1024, 38_316_896, ((3, 4, 6, 3), 64, 7)),
        (clip_resnet.rn101, 512, 56_259_936, ((3, 4, 23, 3), 64, 7)),
        (clip_resnet.rn50x4, 640, 87_137_080, ((4, 6, 10, 6), 80, 9)),  # 288 px / 32 = 9
    ],
)
def test_clip_resnet_parameter_counts(build, embed_dim, published, formula_args):
    layers, width, grid = formula_args
    assert clip_resnet_params(layers, width, embed_dim, grid) == published
    with torch.device("meta"):
        model = build(embed_dim=embed_dim)
    assert count(model) == published
    assert model.attnpool.positional_embedding.shape == (grid * grid + 1, width * 32)


def test_resnet50_parameter_count():
    # torchvision resnet50: 25 557 032 parameters, of which fc holds 2048 * 1000 + 1000.
    assert 25_557_032 - (2048 * 1000 + 1000) == 23_508_032
    assert torchvision_resnet_backbone_params((3, 4, 6, 3), "bottleneck", "imagenet") == 23_508_032
    with torch.device("meta"):
        model = resnet.resnet50(embed_dim=256)
    assert count(model) - count(model.proj) == 23_508_032
    assert count(model.proj) == 2048 * 256 + 256  # NUCLR: linear projection to 256


def test_resnet18_cifar_parameter_count():
    # torchvision resnet18 without fc: 11 689 512 - 513 000 = 11 176 512; the CIFAR stem swaps
    # the 7x7x3x64 conv (9408) for a 3x3x3x64 one (1728).
    assert 11_689_512 - 513_000 - 9408 + 1728 == 11_168_832
    assert torchvision_resnet_backbone_params((2, 2, 2, 2), "basic", "cifar") == 11_168_832
    with torch.device("meta"):
        model = resnet.resnet18_cifar(embed_dim=128)
    assert count(model) - count(model.proj) == 11_168_832
    assert count(model.proj) == (512 * 512 + 512) + (512 * 128 + 128)  # SimCLR's 2-layer MLP head


def test_full_size_output_shapes_on_meta():
    with torch.device("meta"):
        rn50 = clip_resnet.rn50(embed_dim=1024, output="tokens")
        rn50x4 = clip_resnet.rn50x4(embed_dim=640)
        r50 = resnet.resnet50(embed_dim=256, output="tokens")
        assert rn50(torch.empty(2, 3, 224, 224)).points.shape == (2, 1 + 7 * 7, 1024)
        assert rn50x4(torch.empty(2, 3, 288, 288)).points.shape == (2, 1, 640)
        assert r50(torch.empty(2, 3, 224, 224)).points.shape == (2, 7 * 7, 256)


# --- Architecture details -----------------------------------------------------------------


def strided_convs(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.stride != (1, 1)]


def test_modified_resnet_is_anti_aliased():
    with torch.device("meta"):
        model = clip_resnet.rn50(embed_dim=1024)
    # Only the stem's first conv strides (CLIP); every stage downsamples by average pooling.
    assert strided_convs(model) == ["conv1"]
    for stage in (model.layer2, model.layer3, model.layer4):
        first = stage[0]
        assert isinstance(first.avgpool, nn.AvgPool2d) and first.avgpool.kernel_size == 2
        assert isinstance(first.downsample[0], nn.AvgPool2d)  # pool, then the 1x1 conv
        assert isinstance(first.downsample[1], nn.Conv2d) and first.downsample[1].kernel_size == (1, 1)
    assert isinstance(model.avgpool, nn.AvgPool2d)
    # The standard ResNet, by contrast, strides its 3x3 convs and shortcut convs (torchvision v1.5).
    with torch.device("meta"):
        standard = resnet.resnet50(embed_dim=256)
    assert strided_convs(standard) == ["conv1"] + [
        f"layer{i}.0.{conv}" for i in (2, 3, 4) for conv in ("conv2", "downsample.0")
    ]


def test_state_dict_names_follow_clip_and_torchvision():
    clip_keys = set(make_rn().state_dict())
    for key in (
        "conv1.weight", "bn3.running_var", "layer1.0.downsample.0.weight",
        "layer2.0.downsample.1.bias", "layer4.0.bn3.weight", "attnpool.positional_embedding",
        "attnpool.q_proj.bias", "attnpool.c_proj.weight",
    ):  # fmt: skip
        assert key in clip_keys, key
    standard_keys = set(make_resnet().state_dict())
    for key in ("conv1.weight", "bn1.running_mean", "layer1.0.conv2.weight", "layer2.0.downsample.0.weight"):
        assert key in standard_keys, key
    assert not any(key.startswith("fc.") for key in standard_keys)


def test_clip_init():
    model = make_rn()
    for stage in model.stages():
        for block in stage:
            assert torch.equal(block.bn3.weight, torch.zeros_like(block.bn3.weight))
    width = model.attnpool.c_proj.in_features  # 8 * 32 = 256
    assert width == 256
    for weight in (model.attnpool.q_proj.weight, model.attnpool.c_proj.weight):
        assert abs(weight.std().item() - width**-0.5) < 0.02 * width**-0.5


def naive_attention_pool(pool: AttentionPool2d, x: torch.Tensor, all_queries: bool) -> torch.Tensor:
    """Attention pooling written out with loops and an explicit softmax over positions."""
    batch, width, grid, _ = x.shape
    heads, head_dim = pool.heads, width // pool.heads
    out = []
    for b in range(batch):
        positions = [x[b, :, i // grid, i % grid] for i in range(grid * grid)]  # raster order
        tokens = [sum(positions) / len(positions)] + positions
        tokens = [t + pool.positional_embedding[n] for n, t in enumerate(tokens)]
        rows = []
        for query_token in tokens if all_queries else tokens[:1]:
            q = pool.q_proj.weight @ query_token + pool.q_proj.bias
            head_outputs = []
            for h in range(heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                scores = []
                for t in tokens:
                    k = pool.k_proj.weight @ t + pool.k_proj.bias
                    scores.append(torch.dot(q[part], k[part]) / math.sqrt(head_dim))
                exps = [torch.exp(s) for s in scores]
                total = sum(exps)
                mixed = sum(
                    (e / total) * (pool.v_proj.weight @ t + pool.v_proj.bias)[part]
                    for e, t in zip(exps, tokens, strict=True)
                )
                head_outputs.append(mixed)
            rows.append(pool.c_proj.weight @ torch.cat(head_outputs) + pool.c_proj.bias)
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("all_queries", [False, True])
def test_attention_pool_matches_naive_reference(all_queries):
    torch.manual_seed(0)
    pool = AttentionPool2d(grid=2, width=8, heads=2, output_dim=5).double()
    for parameter in pool.parameters():  # biases start at zero: randomise everything
        nn.init.normal_(parameter, std=0.5)
    x = torch.randn(3, 8, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = pool(x, all_queries=all_queries)
        expected = naive_attention_pool(pool, x, all_queries)
    assert got.shape == (3, 5 if all_queries else 1, 5)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# --- Outputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("output", ["cls", "tokens"])
def test_shapes_unit_norm_and_contract(name, output):
    build, size, num_tokens = TINY[name]
    out = check_encoder(build(output=output), images(size))
    assert out.points.shape == (4, 1 if output == "cls" else num_tokens, EMBED_DIM)
    assert out.weights is None and out.mask is None
    torch.testing.assert_close(out.points.norm(dim=-1), torch.ones(out.points.shape[:2]))


def test_clip_resnet_cls_is_first_token():
    model = make_rn(output="tokens").eval()
    with torch.no_grad():
        tokens = model(images(64)).points
        model.output = "cls"
        torch.testing.assert_close(model(images(64)).points, tokens[:, :1])


def test_resnet_cls_is_projected_mean_of_positions():
    # With a linear head, projecting the mean feature equals the mean of the projected positions.
    model = make_resnet(output="tokens").eval()
    with torch.no_grad():
        features = model.features(images(32)).flatten(2).transpose(1, 2)  # [B, HW, F]
        raw_tokens = model.proj(features)
        model.output = "cls"
        cls = model(images(32)).points
    torch.testing.assert_close(cls, nn.functional.normalize(raw_tokens.mean(dim=1, keepdim=True), dim=-1))


@pytest.mark.parametrize("name", TINY)
def test_gradients_reach_every_parameter(name):
    build, size, _ = TINY[name]
    model = build(output="tokens")
    for module in model.modules():  # CLIP zero-inits each bottleneck's last BN gain: undo it
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
    points = model(images(size)).points
    (points * torch.linspace(-1, 1, points.numel()).view_as(points)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("name", TINY)
def test_eval_mode_is_deterministic_and_per_sample(name):
    build, size, _ = TINY[name]
    model = build(output="tokens")
    model(images(size))  # one training forward moves the BatchNorm running statistics
    model.eval()
    with torch.no_grad():
        first, second = model(images(size)).points, model(images(size)).points
        alone = model(images(size)[:1]).points
    assert torch.equal(first, second)
    torch.testing.assert_close(alone, first[:1])  # eval BN uses running stats: no batch coupling


# --- Gradient checkpointing ----------------------------------------------------------------


def forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    points = model(inputs).points
    (points * torch.linspace(-1, 1, points.numel()).view_as(points)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return points.detach(), grads, {name: b.clone() for name, b in model.named_buffers()}


@pytest.mark.parametrize("name", TINY)
def test_grad_checkpointing_matches(name, monkeypatch):
    build, size, _ = TINY[name]
    reference = forward_backward(build(), images(size))

    calls = []
    real_checkpoint = conv_common.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(conv_common, "checkpoint", counting_checkpoint)
    model = build(grad_checkpointing=True)
    points, grads, buffers = forward_backward(model, images(size))
    assert calls == [False] * 4  # one per residual block (4 stages x 1 block), non-reentrant
    torch.testing.assert_close(points, reference[0])
    for key, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][key], msg=key)
    # The recomputation in backward must not update BatchNorm's running statistics a second time.
    for key, buffer in buffers.items():
        torch.testing.assert_close(buffer, reference[2][key], msg=key, rtol=0, atol=0)

    calls.clear()
    model.eval()
    model(images(size))
    with torch.no_grad():
        model.train()(images(size))
    assert calls == []  # evaluation and no-grad forwards never checkpoint


# --- Training and export -------------------------------------------------------------------


def contrastive_loss(model, x):
    """InfoNCE between two noisy views of the same batch (temperature 0.1)."""
    a = model(x).points[:, 0]
    b = model(x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))).points[:, 0]
    return nn.functional.cross_entropy(a @ b.t() / 0.1, torch.arange(x.shape[0]))


@pytest.mark.parametrize("name", TINY)
def test_one_optimisation_step_lowers_the_loss(name):
    build, size, _ = TINY[name]
    model = build()
    x = images(size, batch=8)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    before = contrastive_loss(model, x)
    before.backward()
    old = [p.detach().clone() for p in model.parameters()]
    optimiser.step()
    with torch.no_grad():
        after = contrastive_loss(model, x)
    assert torch.isfinite(after) and after < before
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), old, strict=True))


@pytest.mark.parametrize("name", TINY)
def test_safetensors_round_trip_is_bit_exact(name, tmp_path):
    build, size, _ = TINY[name]
    model = build(output="tokens")
    model(images(size))  # non-trivial running statistics, which must travel too
    save_model(model, str(tmp_path / "model.safetensors"))
    torch.manual_seed(123)
    clone = build(output="tokens")
    clone.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    load_model(clone, str(tmp_path / "model.safetensors"))
    model.eval(), clone.eval()
    with torch.no_grad():
        assert torch.equal(clone(images(size)).points, model(images(size)).points)


# --- Errors and registration ---------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("shape", ["size", "channels", "rank", "dtype"])
def test_rejects_wrong_images(name, shape):
    build, size, _ = TINY[name]
    bad = {
        "size": torch.zeros(1, 3, size + 32, size + 32),
        "channels": torch.zeros(1, 1, size, size),
        "rank": torch.zeros(3, size, size),
        "dtype": torch.zeros(1, 3, size, size, dtype=torch.uint8),
    }[shape]
    with pytest.raises(ValueError, match="expected"):
        build()(bad)


@pytest.mark.parametrize(
    "build, kwargs, match",
    [
        (clip_resnet.clip_resnet, {"image_size": 48}, "multiple of 32"),
        (clip_resnet.clip_resnet, {"layers": (1, 1, 1)}, "layers"),
        (clip_resnet.clip_resnet, {"layers": (1, 0, 1, 1)}, "layers"),
        (clip_resnet.clip_resnet, {"width": 8, "heads": 3}, "divisible by heads"),
        (clip_resnet.clip_resnet, {"width": 7}, "even"),
        (clip_resnet.clip_resnet, {"output": "mean"}, "output"),
        (resnet.resnet, {"block": "wide"}, "block"),
        (resnet.resnet, {"stem": "tiny"}, "stem"),
        (resnet.resnet, {"head": "conv"}, "head"),
        (resnet.resnet, {"head_hidden": 64}, "head_hidden"),
        (resnet.resnet, {"output": "cls_token"}, "output"),
        (resnet.resnet, {"layers": (2, 2)}, "layers"),
    ],
)
def test_bad_arguments(build, kwargs, match):
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        build(embed_dim=EMBED_DIM, **kwargs)


def test_hook_registers_builders():
    registered = {}
    conv_encoders.register_encoders(register=registered.__setitem__)
    assert (
        registered.items()
        >= {
            "clip_resnet": clip_resnet.clip_resnet,
            "rn50": clip_resnet.rn50,
            "rn101": clip_resnet.rn101,
            "rn50x4": clip_resnet.rn50x4,
            "rn_tiny": clip_resnet.rn_tiny,
            "resnet": resnet.resnet,
            "resnet50": resnet.resnet50,
            "resnet18_cifar": resnet.resnet18_cifar,
            "resnet_tiny": resnet.resnet_tiny,
        }.items()
    )


def test_registry_builds_through_the_plugin_manager():
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    registry = Registry(make_plugin_manager(autoload=False))
    assert {"rn50", "rn_tiny", "resnet50", "resnet18_cifar"} <= set(registry.names("encoder"))
    model = registry.factory("encoder", "rn_tiny")(embed_dim=EMBED_DIM)
    assert isinstance(model(images(64, batch=2)), PointSet)


def test_plugin_module_imports_without_torch():
    code = (
        "import sys\n"
        "import clipkit.plugins.encoders\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
