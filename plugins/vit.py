"""CLIP-style Vision Transformer image encoder, plus the pre-norm Transformer it shares with text.

Pure torch (no torchvision/timm). The residual block and the block stack defined here are
reused by :mod:`clipkit.plugins.text_transformer`, which only adds a causal mask.

Shapes: B batch, H = W = image_size, P = (image_size / patch_size) ** 2 patches,
D = width (transformer width), d = embed_dim (output width).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from clipkit.types import PointSet

OUTPUTS = ("cls", "tokens")


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


class ResidualBlock(nn.Module):
    """Pre-norm Transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; [B, N, D] -> [B, N, D]."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0, *, causal: bool = False) -> None:
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal=causal)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden),
            nn.GELU(),
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
    ) -> None:
        super().__init__()
        check_positive(width=width, layers=layers, heads=heads, mlp_ratio=mlp_ratio)
        check_heads(width, heads)
        self.grad_checkpointing = grad_checkpointing
        self.blocks = nn.ModuleList(
            ResidualBlock(width, heads, mlp_ratio, causal=causal) for _ in range(layers)
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


class VisionTransformer(nn.Module):
    """CLIP ViT: patchify -> [CLS] + patches + positions -> ln_pre -> blocks -> ln_post -> proj.

    forward(images [B, 3, H, W] float) -> PointSet with L2-normalised points
      output="cls":    [B, 1, d]      the class token only (CLIP's image embedding);
      output="tokens": [B, 1 + P, d]  the class token first, then the patches in raster order.
    ``weights`` and ``mask`` are None (all points real, uniform weights).
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int,
        patch_size: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float = 4.0,
        output: str = "cls",
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_positive(embed_dim=embed_dim, image_size=image_size, patch_size=patch_size)
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.image_size = image_size
        self.output = output
        num_patches = (image_size // patch_size) ** 2
        # No bias: ln_pre follows immediately and would cancel a per-channel shift anyway.
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.positional_embedding = nn.Parameter(torch.empty(1 + num_patches, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(width, layers, heads, mlp_ratio, grad_checkpointing=grad_checkpointing)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        self.reset_parameters()

    @property
    def grad_checkpointing(self) -> bool:
        return self.transformer.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enabled: bool) -> None:
        self.transformer.grad_checkpointing = enabled

    def reset_parameters(self) -> None:
        """Embeddings std 0.02; projection std width**-0.5 as in CLIP (unit-variance outputs)."""
        width = self.class_embedding.shape[0]
        nn.init.normal_(self.class_embedding, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.02)
        nn.init.normal_(self.proj.weight, std=width**-0.5)

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
        if self.output == "cls":
            x = x[:, :1]  # [B, 1, D]
        points = self.proj(self.ln_post(x))  # [B, M, d]
        return PointSet(F.normalize(points, dim=-1))


def vit(
    *,
    embed_dim: int,
    image_size: int = 224,
    patch_size: int = 16,
    width: int = 768,
    layers: int = 12,
    heads: int = 12,
    mlp_ratio: float = 4.0,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> VisionTransformer:
    """Build a :class:`VisionTransformer` (defaults: ViT-B/16 at 224 px)."""
    return VisionTransformer(
        embed_dim=embed_dim,
        image_size=image_size,
        patch_size=patch_size,
        width=width,
        layers=layers,
        heads=heads,
        mlp_ratio=mlp_ratio,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )


def vit_tiny(
    *,
    embed_dim: int,
    image_size: int = 32,
    patch_size: int = 8,
    width: int = 64,
    layers: int = 2,
    heads: int = 2,
    output: str = "cls",
    grad_checkpointing: bool = False,
) -> VisionTransformer:
    """A tiny ViT for tests and CPU smoke runs (32 px, 16 patches, width 64, 2 layers)."""
    return vit(
        embed_dim=embed_dim,
        image_size=image_size,
        patch_size=patch_size,
        width=width,
        layers=layers,
        heads=heads,
        output=output,
        grad_checkpointing=grad_checkpointing,
    )
