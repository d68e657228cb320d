"""The plugin side of tiling: which similarities and losses have a tiled form, and the call that
scores a batch with one.

A similarity is *tileable* when it declares (clipkit.contract.types.OPTIONAL_MEMBERS)

    tile_features(x: PointSet, *, generator) -> tuple[Tensor, ...]   each [B, ...], rows = the sets
    score_tile(a_features, b_features) -> Tensor [ta, tb]             the logits of those rows
    score_pairs(a_features, b_features) -> Tensor [n]   (optional)   row-aligned pairs' logits
    largest_tile(a_features, b_features) -> int | None  (optional)   a cap on the tile side

with ``score_tile(tile_features(a), tile_features(b))`` equal to ``forward(a, b).i2t``. A loss is
tileable when it declares ``tiled_loss(logits: TiledLogits, ctx) -> LossOutput`` equal to its
``__call__`` on the full logits. Either may instead declare ``tiled_unsupported = "why"``; the
host then refuses ``train.tiled: true`` with that reason (``auto`` falls back to the full path).

Fused kernels (:mod:`clipkit.tiled.fused`): a similarity whose tiles are an affine dot product
declares ``fused_form() -> AffineDot | None`` and a loss declares ``fused_reductions = True``; on
CUDA the pair's sweeps then run in Triton kernels (``fused=None``, the default), the generic engine
staying the fallback. ``fused=True`` demands them (CPU tensors: under ``TRITON_INTERPRET=1``, for
tests), ``fused=False`` turns them off.
"""

from __future__ import annotations

from typing import Any

import torch

from clipkit.contract.types import LossContext, LossOutput, PointSet, optional_member
from clipkit.tiled.fused import fused_sweeps
from clipkit.tiled.logits import TiledLogits, global_logits, local_logits


def _name(plugin: Any) -> str:
    return plugin.__name__ if isinstance(plugin, type) else type(plugin).__name__


def similarity_refusal(similarity: Any) -> str | None:
    """Why ``similarity`` cannot be scored tile by tile, or None when it can."""
    reason = optional_member(similarity, "tiled_unsupported")
    if reason:
        return f"the similarity {_name(similarity)} has no tiled form: {reason}"
    missing = [m for m in ("tile_features", "score_tile") if optional_member(similarity, m) is None]
    if missing:
        return f"the similarity {_name(similarity)} does not declare {' and '.join(missing)}"
    return None


def loss_refusal(loss: Any) -> str | None:
    """Why ``loss`` cannot run on tiled logits, or None when it can."""
    reason = optional_member(loss, "tiled_unsupported")
    if reason:
        return f"the loss {_name(loss)} has no tiled form: {reason}"
    if optional_member(loss, "tiled_loss") is None:
        return f"the loss {_name(loss)} does not declare tiled_loss"
    return None


def refusal(loss: Any, similarity: Any) -> str | None:
    """The first reason the pair cannot be tiled, or None."""
    return similarity_refusal(similarity) or loss_refusal(loss)


def _scorers(similarity: Any):
    parameters = similarity.parameters() if hasattr(similarity, "parameters") else ()
    parameters = [p for p in parameters if p.requires_grad]
    return similarity.score_tile, optional_member(similarity, "score_pairs"), parameters


def _tile_size(similarity: Any, features_a: tuple, features_b: tuple, tile_size: int) -> int:
    """``train.tile_size``, capped by the similarity's ``largest_tile`` when it declares one (KME: the
    largest tile its block kernels score in one pass, whose kept scores spare the backward a
    recompute)."""
    largest = optional_member(similarity, "largest_tile")
    cap = None if largest is None else largest(features_a, features_b)
    return tile_size if cap is None else max(1, min(tile_size, int(cap)))


def _features(similarity: Any, x: PointSet, generator_for) -> tuple:
    """The similarity's tile features of ``x``, from a fresh generator (the same draw each call)."""
    return tuple(similarity.tile_features(x, generator=None if generator_for is None else generator_for()))


def tiled_global_loss(
    loss: Any,
    similarity: Any,
    a: PointSet,
    b: PointSet,
    ctx: LossContext,
    *,
    tile_size: int,
    generator_for=None,
    fused: bool | None = None,
) -> LossOutput:
    """The loss of every anchor against every candidate of the batch (a, b [N, M, d]), tiled.

    generator_for: () -> a fresh generator, identically seeded on each call (random-feature
    similarities draw the same features for both sides).
    fused: None = the fused kernels on CUDA when both plugins declare them; True = demand them;
    False = the generic engine only (:mod:`clipkit.tiled.fused`).
    """
    score, pairs, parameters = _scorers(similarity)
    features_a, features_b = _features(similarity, a, generator_for), _features(similarity, b, generator_for)
    targets = torch.arange(a.batch_size, device=a.points.device)
    tile_size = _tile_size(similarity, features_a, features_b, tile_size)
    runner = fused_sweeps(loss, similarity, features_a, features_b, fused)
    logits = global_logits(score, features_a, features_b, targets, parameters, tile_size, pairs, fused=runner)
    return loss.tiled_loss(logits, ctx)


def tiled_local_loss(
    loss: Any,
    similarity: Any,
    local_a: PointSet,
    b: PointSet,
    a: PointSet,
    local_b: PointSet,
    offset: int,
    ctx: LossContext,
    *,
    tile_size: int,
    generator_for=None,
    fused: bool | None = None,
) -> LossOutput:
    """This process's anchors (local_a, local_b [n, M, d]) against the gathered batch (a, b [N, M, d]);
    their positives are candidates offset .. offset + n − 1. fused: as :func:`tiled_global_loss`."""
    score, pairs, parameters = _scorers(similarity)
    sides = [_features(similarity, x, generator_for) for x in (local_a, b, a, local_b)]
    targets = offset + torch.arange(local_a.batch_size, device=local_a.points.device)
    tile_size = _tile_size(similarity, sides[0], sides[1], tile_size)
    runner = fused_sweeps(loss, similarity, sides[0], sides[1], fused)
    logits = local_logits(score, *sides, targets, parameters, tile_size, pairs, fused=runner)
    return loss.tiled_loss(logits, ctx)


__all__ = [
    "TiledLogits",
    "loss_refusal",
    "refusal",
    "similarity_refusal",
    "tiled_global_loss",
    "tiled_local_loss",
]
