"""The training step's tiled branch: :func:`clipkit.train.objective.contrastive_loss` calls
:func:`tiled_contrastive_loss` when ``loss.tiled`` applies. It mirrors the full path (same gather,
same targets, same LossContext, built by the caller) with the logits replaced by
:class:`clipkit.tiled.TiledLogits`.
"""

from __future__ import annotations

from typing import Any

from clipkit.tiled.contract import tiled_global_loss, tiled_local_loss
from clipkit.types import LossContext, LossOutput, PointSet


def tiled_contrastive_loss(
    trainer: Any,
    similarity: Any,
    local_a: PointSet,
    local_b: PointSet,
    a: PointSet,
    b: PointSet,
    ctx: LossContext,
    step: int,
) -> LossOutput:
    """local_a, local_b [n, M, d]: this process's point sets; a, b [N, M, d]: the gathered batch.

    ``trainer`` supplies the runtime (local loss, rank, the step's generator), the loss and
    ``tiling`` (clipkit.tiled.settings.Tiling).
    """
    rt, loss, tile_size = trainer.runtime, trainer.loss, trainer.tiling.tile_size

    def generator_for():
        return rt.generator(step)  # a fresh, identically seeded generator per side (WPSE's features)

    if rt.local_loss:
        offset = rt.rank * local_a.batch_size
        sides = (local_a.float(), b, a, local_b.float())
        return tiled_local_loss(
            loss, similarity, *sides, offset, ctx, tile_size=tile_size, generator_for=generator_for
        )
    return tiled_global_loss(loss, similarity, a, b, ctx, tile_size=tile_size, generator_for=generator_for)
