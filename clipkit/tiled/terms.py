"""Named reduction pieces: callables the generic engine runs as they are, and that the fused kernels
(:mod:`clipkit.tiled.fused`) recognise by type and compute on chip.

A loss that builds its reductions only from these (and plain ``LogSumExp`` / ``ArgMax`` / ``Max``)
can declare ``fused_reductions = True`` (docs/plugins.md "Fused kernels"). An arbitrary lambda
still works everywhere: its reduction then runs in the generic engine.

Orientation: a tile of direction d has rows = d's anchors and cols = d's candidates (``Tile``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from clipkit.tiled.engine import Tile


@dataclass(frozen=True, eq=False)
class Separable:
    """A ``LogSumExp`` offset (or a term's log-weight) row[r] + col[c]: row [rows] and col
    [candidates] constants of the direction (either None for 0); detached on construction."""

    row: Tensor | None = None
    col: Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("row", "col"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, value.detach())

    def __call__(self, tile: Tile) -> Tensor:
        """[tr, tc] (or broadcastable) offsets of the tile."""
        total = torch.zeros((), device=tile.rows.device)
        if self.row is not None:
            total = total + self.row[tile.rows].unsqueeze(1)
        if self.col is not None:
            total = total + self.col[tile.cols].unsqueeze(0)
        return total


@dataclass(frozen=True, eq=False)
class SigmoidPairTerms:
    """SigLIP's pair terms: ``−log σ(z·L)``, z = +1 on the row's positive and −1 elsewhere."""

    def __call__(self, logits: Tensor, tile: Tile) -> Tensor:
        return -F.logsigmoid(torch.where(tile.positive, logits, -logits))


@dataclass(frozen=True, eq=False)
class ScaledLogits:
    """``factor·L`` (label smoothing's mean logit with factor = 1 / candidates)."""

    factor: float

    def __call__(self, logits: Tensor, tile: Tile) -> Tensor:
        return logits * self.factor


@dataclass(frozen=True, eq=False)
class SoftmaxWeightedLogits:
    """``factor·exp(L + weight)·L`` with the exponential detached, so its gradient is
    factor·exp(L + weight) (SogCLR / NUCLR's surrogate: a row of softmax weights times the logits);
    0 on the row's positive when ``exclude_positive``. weight: a :class:`Separable`."""

    factor: float
    weight: Separable
    exclude_positive: bool = True

    def __call__(self, logits: Tensor, tile: Tile) -> Tensor:
        coefficient = (logits.detach() + self.weight(tile)).exp() * self.factor
        if self.exclude_positive:
            coefficient = coefficient.masked_fill(tile.positive, 0.0)
        return coefficient * logits
