"""Gradient checkpointing holds no more than open_clip's (issue 38): the ViT's residual stream — what
checkpointing keeps per block — stays in the towers' half dtype under autocast, as open_clip's does
(benchmarks/checkpoint_memory.py measures the memory; docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clipkit.plugins.encoders.text_transformer import text_transformer_tiny
from clipkit.plugins.encoders.vit import LayerNorm, vit_tiny


@pytest.fixture
def cuda_layer_norm_policy(monkeypatch):
    """``F.layer_norm`` as CUDA autocast runs it — upcast to fp32, an fp32 result — where CPU
    autocast would keep bf16: the GPU's behaviour, on the CPU."""
    plain = F.layer_norm

    def fp32_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        if not torch.is_autocast_enabled("cpu"):
            return plain(x, shape, weight, bias, eps)
        with torch.autocast("cpu", enabled=False):
            return plain(x.float(), shape, *(None if t is None else t.float() for t in (weight, bias)), eps)

    monkeypatch.setattr(F, "layer_norm", fp32_layer_norm)


def block_input_dtypes(tower, inputs) -> list[torch.dtype]:
    """The dtype of every Transformer block's input (what a checkpointed block keeps) in one
    training forward under bf16 autocast."""
    seen = []
    hooks = [
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        for block in tower.transformer.blocks
    ]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tower.train()(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_vit_blocks_keep_the_half_dtype_their_input_arrives_in(cuda_layer_norm_policy):
    """Under CUDA's layer_norm policy every ViT block receives bf16 (2 bytes a value kept per block
    under checkpointing, as open_clip); torch's own LayerNorm, the previous towers', hands on fp32."""
    torch.manual_seed(0)
    vit = vit_tiny(embed_dim=16)
    vit.grad_checkpointing = True
    images = torch.randn(2, 3, 32, 32)
    assert block_input_dtypes(vit, images) == [torch.bfloat16] * len(vit.transformer.blocks)
    for module in vit.modules():
        if isinstance(module, LayerNorm):
            module.forward = torch.nn.LayerNorm.forward.__get__(module)
    assert set(block_input_dtypes(vit, images)) == {torch.float32}


def test_text_stream_stays_fp32_and_fp32_towers_are_unchanged(cuda_layer_norm_policy):
    """The text tower's stream starts from the fp32 embedding table, so it stays fp32 (open_clip's
    too); without autocast the towers' LayerNorm is torch's, bit for bit."""
    torch.manual_seed(0)
    text = text_transformer_tiny(embed_dim=16, vocab_size=50, context_length=8)
    tokens = torch.tensor([[1, 5, 7, 2, 0, 0, 0, 0], [1, 3, 2, 0, 0, 0, 0, 0]])
    assert set(block_input_dtypes(text, tokens)) == {torch.float32}
    norm = LayerNorm(8)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), torch.nn.LayerNorm.forward(norm, x))
    assert list(norm.state_dict()) == ["weight", "bias"]
