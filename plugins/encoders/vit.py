"""CLIP-style Vision Transformer image encoder, plus the pre-norm Transformer it shares with text.

Pure torch (no torchvision/timm). The residual block and the block stack defined here are
reused by :mod:`clipkit.plugins.encoders.text_transformer`, which only adds a causal mask.

Shapes: B batch, H = W = image_size, P = (image_size / patch_size) ** 2 patches,
D = width (transformer width), d = embed_dim (output width), M = points per image.

Point-set options shared with the text tower (KME-CLIP and WPSE, METHODS §2, §3, §11):
``weights`` adds a per-point weight head (:class:`PointWeightHead`).
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from clipkit.config.constraints import POSITIVE, OneOf
from clipkit.contract.registry import preset
from clipkit.contract.types import PointSet
from clipkit.errors import check_choice

OUTPUTS = ("cls", "tokens")

#: Per-point weight heads (None = no weights: uniform 1/M).
WEIGHT_HEADS = (None, "softplus", "scaled_tanh")

# Sizes and choices `clipkit validate` checks (docs/plugins.md, "Declaring ranges"); one argument
# against another (width by heads, image_size by patch_size, num_points) stays the factory's.
SIZE = Annotated[int, POSITIVE]
RATIO = Annotated[float, POSITIVE]
WEIGHT_HEAD = Annotated[str | None, OneOf(WEIGHT_HEADS)]


def check_positive(**values: float) -> None:
    """Raise ValueError naming the first argument that is not > 0."""
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_heads(width: int, heads: int) -> None:
    """Multi-head attention splits ``width`` evenly across ``heads``."""
    if width % heads != 0:
        raise ValueError(f"width ({width}) must be divisible by heads ({heads})")


class SelfAttention(nn.Module):
    """Multi-head self-attention over ``[B, N, D]`` via ``scaled_dot_product_attention``.

    ``causal=True`` lets position i attend only to positions <= i (text). Every position
    attends at least to itself, so no row of the softmax is empty and no NaN can appear.
    """

    def __init__(self, width: int, heads: int, *, causal: bool = False) -> None:
        super().__init__()
        check_heads(width, heads)
        self.heads = heads
        self.causal = causal
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, N, D] -> [B, N, D]."""
        batch, length, width = x.shape
        # [B, N, 3D] -> 3 x [B, heads, N, D/heads]
        qkv = self.in_proj(x).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that returns its input's dtype; [*, D] -> [*, D].

    Under CUDA autocast ``layer_norm`` computes in fp32 and returns fp32, so a plain LayerNorm
    turns the towers' bf16/fp16 residual stream into fp32 from ``ln_pre`` on: every block then
    adds its half-precision output to an fp32 stream, and gradient checkpointing keeps each block's
    input at 4 bytes per value instead of 2 (+29 % peak memory against open_clip at ViT-B/16, batch
    256: docs/benchmarks.md). Casting back keeps the stream in the dtype it arrives in — half
    precision from the patch embedding, fp32 from a text tower's embedding table or without
    autocast — as open_clip's LayerNorm does. The normalisation itself still runs in fp32.
    """

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).to(x.dtype)


class QuickGELU(nn.Module):
    """x·sigmoid(1.702·x): the GELU approximation OpenAI's CLIP weights were trained with (and the
    Hugging Face CLIP default, ``hidden_act="quick_gelu"``); [*] -> [*]."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class ResidualBlock(nn.Module):
    """Pre-norm Transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; [B, N, D] -> [B, N, D].

    ``quick_gelu`` swaps the MLP's exact GELU for :class:`QuickGELU` (no parameter changes, so the
    same weights load either way; pick the activation the weights were trained with).
    """

    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float = 4.0,
        *,
        causal: bool = False,
        quick_gelu: bool = False,
    ) -> None:
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal=causal)
        self.ln_2 = LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden),
            QuickGELU() if quick_gelu else nn.GELU(),
            nn.Linear(hidden, width),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """A stack of :class:`ResidualBlock`; [B, N, D] -> [B, N, D].

    With ``grad_checkpointing`` (and only while training with grad enabled) each block's
    activations are recomputed in backward instead of stored, trading compute for memory.
    """

    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float = 4.0,
        *,
        causal: bool = False,
        grad_checkpointing: bool = False,
        quick_gelu: bool = False,
    ) -> None:
        super().__init__()
        check_positive(width=width, layers=layers, heads=heads, mlp_ratio=mlp_ratio)
        check_heads(width, heads)
        self.grad_checkpointing = grad_checkpointing
        self.blocks = nn.ModuleList(
            ResidualBlock(width, heads, mlp_ratio, causal=causal, quick_gelu=quick_gelu)
            for _ in range(layers)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """CLIP's init: attention/MLP std shrinks with width, residual outputs also with depth."""
        width, layers = self.blocks[0].ln_1.normalized_shape[0], len(self.blocks)
        attn_std = width**-0.5
        proj_std = width**-0.5 * (2 * layers) ** -0.5
        fc_std = (2 * width) ** -0.5
        for block in self.blocks:
            nn.init.normal_(block.attn.in_proj.weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp[0].weight, std=fc_std)
            nn.init.normal_(block.mlp[2].weight, std=proj_std)
            for linear in (block.attn.in_proj, block.attn.out_proj, block.mlp[0], block.mlp[2]):
                nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        use_checkpoint = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        return x


class PointWeightHead(nn.Module):
    """Per-point weights from the same (final-LayerNorm'ed) token features as the points.

    A separate ``Linear(width, 1)`` then an activation; features [B, M, D] -> weights [B, M]:
      "softplus":    w = softplus(z) > 0, KME-CLIP's weights (METHODS §3), normalised by their
                     sum (PointSet weight_normalization "sum");
      "scaled_tanh": w = a·tanh(z / a) in (−a, a), the WPSE authors' code (METHODS §11, their
                     ``ScaledTanh(alpha)``): weights may be negative and the weighted mean divides
                     by the number of points, not by Σw (weight_normalization "count").
    Init as the WPSE authors' weight projection: weight std width**-0.5, bias 0.
    """

    def __init__(self, width: int, activation: str, scale: float = 1.0) -> None:
        super().__init__()
        check_choice("weights", activation, WEIGHT_HEADS[1:])
        check_positive(weight_scale=scale)
        self.activation = activation
        self.scale = float(scale)
        self.linear = nn.Linear(width, 1)
        self.reset_parameters()

    @property
    def normalization(self) -> str:
        """The :attr:`PointSet.weight_normalization` these weights are meant for."""
        return "sum" if self.activation == "softplus" else "count"

    def reset_parameters(self) -> None:
        nn.init.normal_(self.linear.weight, std=self.linear.in_features**-0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        """features: [B, M, D] -> weights [B, M]."""
        z = self.linear(features).squeeze(-1)
        if self.activation == "softplus":
            return F.softplus(z)
        return self.scale * torch.tanh(z / self.scale)

    def extra_repr(self) -> str:
        scale = f", scale={self.scale}" if self.activation == "scaled_tanh" else ""
        return f"activation={self.activation}{scale}"


def point_set(
    points: Tensor, features: Tensor, head: PointWeightHead | None, mask: Tensor | None = None
) -> PointSet:
    """Projected points [B, M, d] (normalised here) and their features [B, M, D] -> PointSet,
    with the weight head's weights (and normalisation) when there is one."""
    points = F.normalize(points, dim=-1)
    if head is None:
        return PointSet(points, mask=mask)
    return PointSet(points, head(features), mask, head.normalization)


class TransformerTower(nn.Module):
    """What CLIP's image and text towers share: the ``grad_checkpointing`` switch of their
    :class:`Transformer` (``self.transformer``) and the optional point-weight head, built after
    the tower's own initialisation."""

    transformer: Transformer

    def finish_tower(self, width: int, weights: str | None, weight_scale: float) -> None:
        """Initialise (``reset_parameters``), then add the weight head. Built last, so that the
        tower's own initialisation does not depend on whether it has a weight head (same seed ->
        same points with and without weights)."""
        self.weight_head = None
        self.reset_parameters()
        if weights is not None:
            self.weight_head = PointWeightHead(width, weights, weight_scale)

    @property
    def grad_checkpointing(self) -> bool:
        return self.transformer.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enabled: bool) -> None:
        self.transformer.grad_checkpointing = enabled


class VisionTransformer(TransformerTower):
    """CLIP ViT: patchify -> [CLS] + patches + positions -> ln_pre -> blocks -> ln_post -> proj.

    forward(images [B, 3, H, W] float) -> PointSet with L2-normalised points
      output="cls":    [B, 1, d]      the class token only (CLIP's image embedding);
      output="tokens": [B, M, d]      the class token first, then the patches in raster order;
                                      M = 1 + P, or the first ``num_points`` of them (KME-CLIP's
                                      point-set-size ablation m ∈ {2, 10, 50, 100, 197}, METHODS §3:
                                      every token still goes through the transformer, only the
                                      first m outputs are kept).
    ``weights``: None (uniform), or a :class:`PointWeightHead` ("softplus" | "scaled_tanh", with
    ``weight_scale`` the scaled tanh's a) giving [B, M] weights. ``mask`` is None (all points real).
    """

    #: The final projection; its input is the linear probe's "pre_projection" feature.
    projection_module_name = "proj"

    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int,
        patch_size: SIZE,
        width: SIZE,
        layers: SIZE,
        heads: SIZE,
        mlp_ratio: RATIO = 4.0,
        output: Annotated[str, OneOf(OUTPUTS)] = "cls",
        num_points: int | None = None,
        weights: WEIGHT_HEAD = None,
        weight_scale: RATIO = 1.0,
        grad_checkpointing: bool = False,
        quick_gelu: bool = False,
    ) -> None:
        super().__init__()
        check_positive(embed_dim=embed_dim, image_size=image_size, patch_size=patch_size)
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        check_choice("output", output, OUTPUTS)
        check_choice("weights", weights, WEIGHT_HEADS)
        num_patches = (image_size // patch_size) ** 2
        check_num_points(num_points, output, 1 + num_patches)
        self.image_size = image_size
        self.output = output
        self.num_points = None if num_points is None else int(num_points)
        # No bias: ln_pre follows immediately and would cancel a per-channel shift anyway.
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.positional_embedding = nn.Parameter(torch.empty(1 + num_patches, width))
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(
            width, layers, heads, mlp_ratio, grad_checkpointing=grad_checkpointing, quick_gelu=quick_gelu
        )
        self.ln_post = LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        self.finish_tower(width, weights, weight_scale)

    def reset_parameters(self) -> None:
        """Embeddings std 0.02; projection std width**-0.5 as in CLIP (unit-variance outputs)."""
        width = self.class_embedding.shape[0]
        nn.init.normal_(self.class_embedding, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.02)
        nn.init.normal_(self.proj.weight, std=width**-0.5)
        if self.weight_head is not None:
            self.weight_head.reset_parameters()

    def kept_points(self) -> int | None:
        """How many leading tokens become points: 1 ([CLS]), ``num_points``, or None for all."""
        return 1 if self.output == "cls" else self.num_points

    def forward(self, images: Tensor) -> PointSet:
        """images: [B, 3, H, W] with H = W = image_size -> PointSet (see class docstring)."""
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, self.image_size, self.image_size):
            raise ValueError(
                f"expected images [B, 3, {self.image_size}, {self.image_size}], got {tuple(images.shape)}"
            )
        x = self.conv1(images).flatten(2).transpose(1, 2)  # [B, P, D]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # [B, 1, D]
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # [B, 1 + P, D]
        x = self.transformer(self.ln_pre(x))
        x = self.ln_post(x[:, : self.kept_points()])  # [B, M, D]
        return point_set(self.proj(x), x, self.weight_head)


def check_num_points(num_points: int | None, output: str, available: int) -> None:
    """``num_points`` (keep the first m tokens) needs output="tokens" and 1 <= m <= ``available``."""
    if num_points is None:
        return
    if output != "tokens":
        raise ValueError(f"num_points needs output='tokens' (got output={output!r})")
    if isinstance(num_points, bool) or int(num_points) != num_points or not 1 <= num_points <= available:
        raise ValueError(
            f"num_points must be an integer in [1, {available}] (1 + patches), got {num_points!r}"
        )


vit = preset(
    VisionTransformer,
    "Build a :class:`VisionTransformer` (defaults: ViT-B/16 at 224 px).",
    image_size=224,
    patch_size=16,
    width=768,
    layers=12,
    heads=12,
)
vit_b16 = preset(
    vit,
    "ViT-B/16 (patch 16, width 768, 12 layers, 12 heads; 197 tokens at 224 px): the image tower "
    "of WPSE and KME-CLIP (METHODS §9).",
    fixed={"patch_size": 16, "width": 768, "layers": 12, "heads": 12, "mlp_ratio": 4.0},
)
vit_b32 = preset(
    vit,
    "ViT-B/32 (patch 32, width 768, 12 layers, 12 heads; 50 tokens at 224 px).",
    fixed={"patch_size": 32, "width": 768, "layers": 12, "heads": 12, "mlp_ratio": 4.0},
)
vit_tiny = preset(
    vit,
    "A tiny ViT for tests and CPU smoke runs (32 px, 16 patches, width 64, 2 layers).",
    fixed={"mlp_ratio": 4.0},
    image_size=32,
    patch_size=8,
    width=64,
    layers=2,
    heads=2,
)
