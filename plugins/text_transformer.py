"""CLIP-style causal text Transformer encoder.

Shapes: B batch, L sequence length (<= context_length), D = width, d = embed_dim.
Token id 0 is padding; the real tokens of a row are a prefix ``[start, ..., end, 0, 0, ...]``.
The residual blocks are :class:`clipkit.plugins.vit.Transformer`'s, with a causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clipkit.types import PointSet

# Relative (= clipkit.plugins.vit): plugins/ installs as clipkit.plugins, which ruff's isort
# cannot see from the source tree.
from .vit import Transformer, check_positive

OUTPUTS = ("eos", "tokens")


class TextTransformer(nn.Module):
    """Token + position embeddings -> causal pre-norm blocks -> ln_final -> proj.

    forward(tokens [B, L] long, 0 = padding) -> PointSet with L2-normalised points
      output="eos":    [B, 1, d]  the feature at the last non-padding position (the end token),
                                  which, being causal, is the only one that has seen the whole text;
      output="tokens": [B, L, d]  every position, with ``mask = tokens != 0`` [B, L] bool.
    Rows that are all padding give finite (meaningless) points: position 0 for "eos", all
    masked for "tokens".
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        vocab_size: int,
        context_length: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float = 4.0,
        output: str = "eos",
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_positive(embed_dim=embed_dim, vocab_size=vocab_size, context_length=context_length)
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.output = output
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        # Causal: padding sits after the real tokens, so real positions never attend to it and
        # no key-padding mask is needed (and no softmax row is ever empty, hence no NaN).
        self.transformer = Transformer(
            width, layers, heads, mlp_ratio, causal=True, grad_checkpointing=grad_checkpointing
        )
        self.ln_final = nn.LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        self.reset_parameters()

    @property
    def grad_checkpointing(self) -> bool:
        return self.transformer.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enabled: bool) -> None:
        self.transformer.grad_checkpointing = enabled

    def reset_parameters(self) -> None:
        """CLIP's init: tokens std 0.02, positions std 0.01, projection std width**-0.5."""
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.proj.weight, std=self.positional_embedding.shape[1] ** -0.5)

    def forward(self, tokens: Tensor) -> PointSet:
        """tokens: [B, L] long, L <= context_length -> PointSet (see class docstring)."""
        if tokens.dim() != 2:
            raise ValueError(f"expected tokens [B, L], got shape {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.context_length:
            raise ValueError(f"sequence length {length} exceeds context_length {self.context_length}")
        mask = tokens != 0  # [B, L]
        x = self.token_embedding(tokens) + self.positional_embedding[:length]  # [B, L, D]
        x = self.transformer(x)
        if self.output == "eos":
            x = x[torch.arange(x.shape[0], device=x.device), last_real_position(mask)].unsqueeze(1)
        points = F.normalize(self.proj(self.ln_final(x)), dim=-1)  # [B, M, d]
        return PointSet(points, mask=mask if self.output == "tokens" else None)


def last_real_position(mask: Tensor) -> Tensor:
    """mask: [B, L] bool -> [B] long index of the last True per row (0 for an all-False row).

    Unlike ``mask.sum(1) - 1`` this does not assume the real tokens form a prefix.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, 0).amax(dim=1)


def text_transformer(
    *,
    embed_dim: int,
    vocab_size: int,
    context_length: int,
    width: int = 512,
    layers: int = 12,
    heads: int = 8,
    mlp_ratio: float = 4.0,
    output: str = "eos",
    grad_checkpointing: bool = False,
) -> TextTransformer:
    """Build a :class:`TextTransformer` (defaults: CLIP's 512-wide, 12-layer text tower)."""
    return TextTransformer(
        embed_dim=embed_dim,
        vocab_size=vocab_size,
        context_length=context_length,
        width=width,
        layers=layers,
        heads=heads,
        mlp_ratio=mlp_ratio,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )


def text_transformer_tiny(
    *,
    embed_dim: int,
    vocab_size: int,
    context_length: int,
    width: int = 64,
    layers: int = 2,
    heads: int = 2,
    output: str = "eos",
    grad_checkpointing: bool = False,
) -> TextTransformer:
    """A tiny text tower for tests and CPU smoke runs (width 64, 2 layers)."""
    return text_transformer(
        embed_dim=embed_dim,
        vocab_size=vocab_size,
        context_length=context_length,
        width=width,
        layers=layers,
        heads=heads,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )
