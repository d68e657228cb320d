"""The tiled-path members shared by the similarities whose logits are an affine map of per-set
vectors, L_ab = s·e(a)·e(b) (+ c): ``dot``, ``cosine_mean`` and ``wpse`` (through its random-feature
embedding, METHODS §2). See :mod:`clipkit.tiled.contract` for the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clipkit.contract.types import PointSet
from clipkit.tiled.fused import AffineDot


class ScaledEmbeddingTiles:
    """Mixin for a module with ``embed(x, generator=...) -> [B, D]``, ``scale() -> 0-d`` and an
    optional ``bias`` ([1] parameter or None)."""

    def tile_features(self, x: PointSet, *, generator: torch.Generator | None = None) -> tuple[Tensor]:
        """[B, M, d] -> ([B, D] vectors,) with logits = score_tile of two such tuples."""
        return (self.embed(x, generator=generator),)

    def score_tile(self, a: tuple[Tensor], b: tuple[Tensor]) -> Tensor:
        """([ta, D],), ([tb, D],) -> [ta, tb] logits, computed as ``forward`` computes them."""
        logits = self.scale() * a[0] @ b[0].t()
        bias = getattr(self, "bias", None)
        return logits if bias is None else logits + bias

    def fused_form(self) -> AffineDot:
        """The fused kernels' view of ``score_tile``: scale·a[0] @ b[0].T + bias (clipkit.tiled.fused)."""
        return AffineDot(self.scale(), getattr(self, "bias", None))

    def score_pairs(self, a: tuple[Tensor], b: tuple[Tensor]) -> Tensor:
        """([n, D],), ([n, D],) -> [n] logits of the row-aligned pairs (the positives)."""
        logits = self.scale() * (a[0] * b[0]).sum(dim=1)
        bias = getattr(self, "bias", None)
        return logits if bias is None else logits + bias
