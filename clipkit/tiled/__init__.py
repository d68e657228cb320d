"""Exact contrastive losses at bounded memory: similarities scored tile by tile, losses computed from
row/column reductions of the tiles (online log-sum-exp, tile sums), with a backward pass that
recomputes tiles instead of storing the N×N logits. ``loss.tiled`` in a recipe chooses it
(docs/plugins.md "Tiled losses"; docs/distributed.md).
"""

from clipkit.tiled.contract import (
    loss_refusal,
    refusal,
    similarity_refusal,
    tiled_global_loss,
    tiled_local_loss,
)
from clipkit.tiled.engine import ArgMax, LogSumExp, RowSum, Tile
from clipkit.tiled.logits import TiledLogits

__all__ = [
    "ArgMax",
    "LogSumExp",
    "RowSum",
    "Tile",
    "TiledLogits",
    "loss_refusal",
    "refusal",
    "similarity_refusal",
    "tiled_global_loss",
    "tiled_local_loss",
]
