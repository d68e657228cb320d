"""Exact contrastive losses at bounded memory: similarities scored tile by tile, losses computed from
row/column reductions of the tiles (online log-sum-exp, tile sums), with a backward pass that
recomputes tiles instead of storing the N×N logits. ``train.tiled`` in a recipe chooses it
(docs/plugins.md "Tiled losses"; docs/distributed.md).

Names are imported lazily so that :mod:`clipkit.tiled.settings` (read by recipe validation) does not
import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ArgMax": "clipkit.tiled.engine",
    "LogSumExp": "clipkit.tiled.engine",
    "Max": "clipkit.tiled.engine",
    "RowSum": "clipkit.tiled.engine",
    "ScaledLogits": "clipkit.tiled.terms",
    "Separable": "clipkit.tiled.terms",
    "SigmoidPairTerms": "clipkit.tiled.terms",
    "SoftmaxWeightedLogits": "clipkit.tiled.terms",
    "Tile": "clipkit.tiled.engine",
    "TiledLogits": "clipkit.tiled.logits",
    "loss_refusal": "clipkit.tiled.contract",
    "refusal": "clipkit.tiled.contract",
    "similarity_refusal": "clipkit.tiled.contract",
    "tiled_global_loss": "clipkit.tiled.contract",
    "tiled_local_loss": "clipkit.tiled.contract",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'clipkit.tiled' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
