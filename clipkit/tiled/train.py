"""The training step's tiled branch: :func:`clipkit.train.objective.contrastive_loss` calls
:func:`tiled_contrastive_loss` when ``loss.tiled`` applies. It mirrors the full path (same gather,
same targets, same LossContext) with the logits replaced by :class:`clipkit.tiled.TiledLogits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clipkit.tiled.contract import tiled_global_loss, tiled_local_loss
from clipkit.types import LossOutput, PointSet

if TYPE_CHECKING:
    from clipkit.train.build import Trainer


def tiled_contrastive_loss(
    trainer: Trainer, local_a: PointSet, local_b: PointSet, a: PointSet, b: PointSet, batch: dict, step: int,
    epoch: float,
) -> LossOutput:  # fmt: skip
    """local_a, local_b [n, M, d]: this process's point sets; a, b [N, M, d]: the gathered batch."""
    from clipkit.train.objective import global_fields, loss_context, similarity_of

    rt, similarity, tile_size = trainer.runtime, similarity_of(trainer), trainer.tiling.tile_size

    def generator_for():
        return rt.generator(step)  # a fresh, identically seeded generator per side (WPSE's features)

    if rt.local_loss:
        ctx = loss_context(trainer, {}, a, b, step, epoch)
        offset = rt.rank * local_a.batch_size
        return tiled_local_loss(
            trainer.loss, similarity, local_a.float(), b, a, local_b.float(), offset, ctx,
            tile_size=tile_size, generator_for=generator_for,
        )  # fmt: skip
    ctx = loss_context(trainer, global_fields(trainer, batch), a, b, step, epoch)
    loss = trainer.loss
    return tiled_global_loss(loss, similarity, a, b, ctx, tile_size=tile_size, generator_for=generator_for)
