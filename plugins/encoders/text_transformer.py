"""CLIP-style causal text Transformer encoder.

Shapes: B batch, L sequence length (<= context_length), D = width, d = embed_dim.
Rows are ``[start, ..., end, 0, 0, ...]``: the padding is the run of zeros after the last
non-zero id. A 0 *inside* the text is a real token (CLIP's BPE gives "!" the id 0, which OpenAI
also uses for padding), so the real tokens of a row are positions 0 .. (last non-zero position);
the end token (CLIP BPE: 49407) is never 0, so a non-empty row always ends on a real token.
The residual blocks are :class:`clipkit.plugins.encoders.vit.Transformer`'s, with a causal mask.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor, nn

from clipkit.config.constraints import OneOf
from clipkit.contract.registry import preset
from clipkit.contract.types import PointSet
from clipkit.errors import check_choice

# Relative (= clipkit.plugins.encoders.vit): plugins/ installs as clipkit.plugins, which ruff's isort
# cannot see from the source tree.
from .vit import (
    RATIO,
    SIZE,
    WEIGHT_HEAD,
    WEIGHT_HEADS,
    LayerNorm,
    Transformer,
    TransformerTower,
    check_positive,
    point_set,
)

OUTPUTS = ("eos", "tokens")
PAD_POINTS = ("mask", "include")


class TextTransformer(TransformerTower):
    """Token + position embeddings -> causal pre-norm blocks -> ln_final -> proj.

    forward(tokens [B, L] long) -> PointSet with L2-normalised points
      output="eos":    [B, 1, d]  the feature at the last real position (the end token), which,
                                  being causal, is the only one that has seen the whole text;
      output="tokens": [B, L, d]  every position (WPSE / KME-CLIP point sets, METHODS §2, §3), with
        pad_points="mask":    mask [B, L] bool = real positions (see the module docstring);
        pad_points="include": mask None: padding positions are real points too (the WPSE authors'
                              code, METHODS §11), so every set has M = L points.
      With output="tokens" padding positions take a learnable ``pad_embedding`` (plus their
      position embedding, so pads are distinct, position-dependent points: WPSE, METHODS §2)
      instead of the embedding of id 0, which is a real token. Causal attention means padding
      never changes the real positions' outputs, so output="eos" keeps CLIP's exact parameters.
    ``weights``: None, or a :class:`~clipkit.plugins.encoders.vit.PointWeightHead` ("softplus" |
    "scaled_tanh", ``weight_scale`` = the scaled tanh's a) on the ln_final'ed features -> [B, M].
    Rows that are all padding give finite (meaningless) points: position 0 for "eos", all
    masked for "tokens" with pad_points="mask".
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        vocab_size: int,
        context_length: int,
        width: SIZE,
        layers: SIZE,
        heads: SIZE,
        mlp_ratio: RATIO = 4.0,
        output: Annotated[str, OneOf(OUTPUTS)] = "eos",
        pad_points: Annotated[str, OneOf(PAD_POINTS)] = "mask",
        weights: WEIGHT_HEAD = None,
        weight_scale: RATIO = 1.0,
        grad_checkpointing: bool = False,
        quick_gelu: bool = False,
    ) -> None:
        super().__init__()
        check_positive(embed_dim=embed_dim, vocab_size=vocab_size, context_length=context_length)
        check_choice("output", output, OUTPUTS)
        check_choice("pad_points", pad_points, PAD_POINTS)
        check_choice("weights", weights, WEIGHT_HEADS)
        if pad_points == "include" and output != "tokens":
            raise ValueError(f"pad_points='include' needs output='tokens' (got output={output!r})")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.output = output
        self.pad_points = pad_points
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        # Causal: padding sits after the real tokens, so real positions never attend to it and
        # no key-padding mask is needed (and no softmax row is ever empty, hence no NaN).
        self.transformer = Transformer(
            width,
            layers,
            heads,
            mlp_ratio,
            causal=True,
            grad_checkpointing=grad_checkpointing,
            quick_gelu=quick_gelu,
        )
        self.ln_final = LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        # Only token outputs expose padding positions as points; for "eos" a pad vector would be
        # a parameter that never receives a gradient.
        self.pad_embedding = nn.Parameter(torch.empty(width)) if output == "tokens" else None
        self.finish_tower(width, weights, weight_scale)

    def reset_parameters(self) -> None:
        """CLIP's init: tokens std 0.02, positions std 0.01, projection std width**-0.5; the pad
        vector as a token (std 0.02)."""
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.proj.weight, std=self.positional_embedding.shape[1] ** -0.5)
        if self.pad_embedding is not None:
            nn.init.normal_(self.pad_embedding, std=0.02)
        if self.weight_head is not None:
            self.weight_head.reset_parameters()

    def forward(self, tokens: Tensor) -> PointSet:
        """tokens: [B, L] long, L <= context_length -> PointSet (see class docstring)."""
        if tokens.dim() != 2:
            raise ValueError(f"expected tokens [B, L], got shape {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.context_length:
            raise ValueError(f"sequence length {length} exceeds context_length {self.context_length}")
        last = last_real_position(tokens)  # [B], −1 for an all-padding row
        real = torch.arange(length, device=tokens.device) <= last.unsqueeze(1)  # [B, L]
        x = self.token_embedding(tokens)  # [B, L, D]
        if self.pad_embedding is not None:
            x = torch.where(real.unsqueeze(-1), x, self.pad_embedding.to(x.dtype))
        x = self.transformer(x + self.positional_embedding[:length])
        if self.output == "eos":
            x = x[torch.arange(x.shape[0], device=x.device), last.clamp_min(0)].unsqueeze(1)  # [B, 1, D]
        x = self.ln_final(x)
        mask = real if self.output == "tokens" and self.pad_points == "mask" else None
        return point_set(self.proj(x), x, self.weight_head, mask)


def last_real_position(tokens: Tensor) -> Tensor:
    """tokens: [B, L] long -> [B] long index of the last non-zero id per row (−1 for all zeros).

    Positions up to it are the text (a 0 before it is a real token); the zeros after it are padding.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return torch.where(tokens != 0, positions, -1).amax(dim=1)


text_transformer = preset(
    TextTransformer,
    "Build a :class:`TextTransformer` (defaults: CLIP's 512-wide, 12-layer text tower).",
    width=512,
    layers=12,
    heads=8,
)
clip_text = preset(
    text_transformer,
    "CLIP's text tower: 12 layers x 512 wide x 8 heads (WPSE, KME-CLIP: METHODS §9); the "
    "tokenizer supplies vocab_size and context_length (CLIP BPE: 49 408 and 77).",
    fixed={"width": 512, "layers": 12, "heads": 8, "mlp_ratio": 4.0},
)
text_transformer_tiny = preset(
    text_transformer,
    "A tiny text tower for tests and CPU smoke runs (width 64, 2 layers).",
    fixed={"mlp_ratio": 4.0},
    width=64,
    layers=2,
    heads=2,
)
