"""`dot`: CLIP's scaled dot product (METHODS.md §1; SigLIP's bias: §7).

For point sets with M > 1 the points are first pooled by their weighted mean
(ū = Σ_i w_i u_i), so ``dot`` on point sets is the linear term of WPSE (§2); for
CLIP's M == 1 unit vectors it is exactly s·x·y.

Hand-derived case (tested): x = [[1, 0]], y = [[0.6, 0.8]], s = 10 -> logit 6.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.similarities.temperature import clamped_exp, register_log_value
from clipkit.plugins.similarities.tiles import ScaledEmbeddingTiles


class DotSimilarity(ScaledEmbeddingTiles, nn.Module):
    """L_ab = s·ū_a·v̄_b (+ c), s = exp(t). Tileable (``train.tiled``): a tile is s·E_a·E_bᵀ (+ c).

    init_scale:  initial s (CLIP: 1/0.07 ≈ 14.29; SigLIP: 10).
    learn_scale: learn t = log s; otherwise s is a fixed buffer.
    max_scale:   s is clamped to at most this in the forward pass (CLIP: 100). Clamping the
                 value rather than the parameter keeps the math pure (works the same on
                 sharded parameters) and stops the gradient above the clamp, as CLIP does.
    bias:        initial learnable bias c (SigLIP: -10), or None for no bias.
    """

    def __init__(
        self,
        init_scale: float = 1 / 0.07,
        learn_scale: bool = True,
        max_scale: float | None = 100.0,
        bias: float | None = None,
    ) -> None:
        super().__init__()
        if init_scale <= 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        register_log_value(self, "log_scale", init_scale, learnable=learn_scale)
        self.max_scale = max_scale
        # [1], not 0-d: DeepSpeed cannot broadcast 0-d parameters (see register_log_value).
        self.bias = nn.Parameter(torch.tensor([float(bias)])) if bias is not None else None

    def scale(self) -> Tensor:
        """0-d tensor s = exp(t), clamped to ``max_scale``."""
        return clamped_exp(self.log_scale, self.max_scale)

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor:
        """[B, M, d] -> [B, d] pooled vectors with logits = s·embed(a) @ embed(b).T (+ c)."""
        return x.points[:, 0] if x.num_points == 1 and x.mask is None else x.mean()

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Ma, d], b: [Nb, Mb, d] -> Logits(i2t [Na, Nb], t2i [Nb, Na])."""
        i2t = self.scale() * self.embed(a) @ self.embed(b).t()
        if self.bias is not None:
            i2t = i2t + self.bias
        return Logits.symmetric(i2t)

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """CLIP's prompt ensembling: mean of the prompts' unit vectors, renormalised.

        x: [B, M, d] prompt point sets, groups: [B] class id in [0, G) -> PointSet [G, 1, d].
        """
        pooled = nn.functional.normalize(self.embed(x), dim=-1)
        num_groups = int(groups.max()) + 1
        sums = pooled.new_zeros(num_groups, pooled.shape[1]).index_add_(0, groups, pooled)
        return PointSet(nn.functional.normalize(sums, dim=-1).unsqueeze(1))

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        out = {"logit_scale": float(self.scale().detach())}
        if self.bias is not None:
            out["logit_bias"] = float(self.bias.detach())
        return out
