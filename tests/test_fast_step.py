"""What makes the step fast on a GPU, checked without one (issue 38): every attention tower calls
``F.scaled_dot_product_attention`` (so CUDA may pick its flash or memory-efficient kernel) and never
a hand-written softmax attention; the towers' graph breaks under TorchDynamo are listed; Adam(W)
choose torch's fused kernel on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from clipkit.plugins.encoders.bert import distilbert_tiny
from clipkit.plugins.encoders.clip_resnet import rn_tiny
from clipkit.plugins.encoders.text_transformer import text_transformer_tiny
from clipkit.plugins.encoders.vit import vit_tiny
from clipkit.plugins.optim import adam, adamw, kernel_choice

EMBED, VOCAB, CONTEXT = 16, 64, 8


def tokens() -> torch.Tensor:
    """[2, CONTEXT] ids with zero padding in the second row."""
    return torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 0, 0, 0, 0, 0]])


#: (name, tower, input, attention modules it must hold): the tiny form of every attention tower.
ATTENTION_TOWERS = {
    "vit": (lambda: vit_tiny(embed_dim=EMBED), lambda: torch.randn(2, 3, 32, 32), 2),
    "text_transformer": (
        lambda: text_transformer_tiny(embed_dim=EMBED, vocab_size=VOCAB, context_length=CONTEXT),
        tokens,
        2,
    ),
    "clip_resnet attention pool": (lambda: rn_tiny(embed_dim=EMBED), lambda: torch.randn(2, 3, 64, 64), 1),
    "bert": (
        lambda: distilbert_tiny(embed_dim=EMBED, vocab_size=VOCAB, context_length=CONTEXT),
        tokens,
        2,
    ),
}


def attention_modules(tower: torch.nn.Module) -> int:
    return sum("Attention" in type(module).__name__ for module in tower.modules())


@pytest.mark.parametrize("name", list(ATTENTION_TOWERS))
def test_every_attention_tower_calls_sdpa_once_per_attention_and_no_softmax(name, monkeypatch):
    build, inputs, expected = ATTENTION_TOWERS[name]
    tower = build().eval()
    assert attention_modules(tower) == expected
    calls = {"sdpa": 0, "softmax": 0}
    sdpa, softmax = functional.scaled_dot_product_attention, torch.softmax

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    def counting_softmax(*args, **kwargs):
        calls["softmax"] += 1
        return softmax(*args, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(functional, "softmax", counting_softmax)
    monkeypatch.setattr(torch, "softmax", counting_softmax)
    with torch.no_grad():
        tower(inputs())
    assert calls == {"sdpa": expected, "softmax": 0}


def test_the_graph_break_check_lists_the_tiny_towers_breaks():
    """``torch._dynamo.explain`` over the tiny towers: the check runs on CPU (no compile) and lists
    every break with its reason; the two CLIP towers trace whole."""
    from clipkit.train.compile import graph_breaks

    towers = {
        "vit_tiny": (vit_tiny(embed_dim=EMBED), torch.randn(2, 3, 32, 32)),
        "text_transformer_tiny": (
            text_transformer_tiny(embed_dim=EMBED, vocab_size=VOCAB, context_length=CONTEXT),
            tokens(),
        ),
    }
    for name, (tower, inputs) in towers.items():
        report = graph_breaks(tower, inputs)
        assert report.graphs >= 1, name
        assert report.breaks == [], (name, report.breaks)


def test_the_graph_break_check_reports_a_break_it_is_shown():
    """A tower with a data-dependent Python branch breaks its graph: the check says where and why."""
    from clipkit.train.compile import graph_breaks

    class Branchy(torch.nn.Module):
        def forward(self, x):
            if float(x.sum()) > 0:  # a Python value read off a tensor: Dynamo must break here
                return x * 2
            return x - 1

    report = graph_breaks(Branchy(), torch.ones(3))
    assert report.graphs == 2 and len(report.breaks) == 1
    assert report.breaks[0]


def test_adamw_is_fused_on_cuda_and_torch_default_on_cpu():
    assert kernel_choice("auto", cuda=True) == {"fused": True, "foreach": False}
    assert kernel_choice("auto", cuda=False) == {}
    assert kernel_choice("foreach", cuda=True) == {"fused": False, "foreach": True}
    with pytest.raises(ValueError, match="implementation"):
        kernel_choice("fast", cuda=True)
    weight = torch.nn.Parameter(torch.ones(2, 2))
    for factory in (adamw, adam):
        cpu = factory([("w", weight)])
        assert not cpu.defaults["fused"]  # None or False: the per-parameter loop on the CPU
        explicit = factory([("w", weight)], implementation="fused")
        assert explicit.defaults["fused"] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("factory", [adamw, adam])
def test_foreach_on_the_cpu_takes_the_per_parameter_loops_steps_bit_for_bit(factory, dtype):
    """``implementation: foreach`` on the CPU (0.72x the loop's CPU for clip@tiny's optimiser step,
    1.10x for ViT-B/16's: benchmarks/cpu_optimizer.py) changes no update: 5 steps of a model with
    decayed matrices, undecayed vectors, a per-tower learning rate and a frozen parameter."""

    def trained(implementation: str) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        shapes = {"image_encoder.w": (8, 4), "image_encoder.b": (4,), "text_encoder.w": (4, 3), "scale": ()}
        named = [
            (name, torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)))
            for name, shape in shapes.items()
        ]
        named.append(("frozen", torch.nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=False)))
        optimizer = factory(named, lr=1e-2, text_lr=3e-3, implementation=implementation)
        for _ in range(5):
            for _, parameter in named:
                if parameter.requires_grad:
                    parameter.grad = torch.randn(parameter.shape, generator=generator, dtype=dtype)
            optimizer.step()
        return [parameter.detach() for _, parameter in named]

    assert all(torch.equal(a, b) for a, b in zip(trained("auto"), trained("for_loop"), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_clip_towers_run_on_the_flash_kernel_alone():
    """Only FlashAttention allowed: the ViT and the causal text tower still run in bf16 (BERT's
    padding mask takes the memory-efficient kernel, which flash cannot serve)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    towers = [
        (vit_tiny(embed_dim=EMBED), torch.randn(2, 3, 32, 32)),
        (text_transformer_tiny(embed_dim=EMBED, vocab_size=VOCAB, context_length=CONTEXT), tokens()),
    ]
    for tower, inputs in towers:
        tower = tower.cuda()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
            out = tower(inputs.cuda())
        assert torch.isfinite(out.points).all()
