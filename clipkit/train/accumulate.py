"""Exact gradient accumulation (``train.micro_batch_size``; open_clip's scheme, METHODS §11).

The loss sees the whole contrastive batch however small the micro-batches are, at the price of
encoding every sample twice (once without gradient to cache the features, once with).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from clipkit.train.objective import contrastive_loss, forward_loss, loss_is_finite
from clipkit.types import LossOutput, PointSet

if TYPE_CHECKING:
    from clipkit.train.build import Trainer


def accumulate_exactly(trainer: Trainer, batch: dict, step: int) -> tuple[LossOutput, bool]:
    """Exact gradient accumulation (open_clip's scheme, METHODS §11): the loss sees the whole
    contrastive batch however small the micro-batches are.

    1. encode every micro-batch without gradient and cache the features [n, M, d];
    2. compute the loss on the cached (gathered) batch and its gradient g w.r.t. the cached features;
    3. re-encode each micro-batch with gradient and back-propagate Σ features · g (its share of
       the full-batch gradient); the last one also back-propagates the loss recomputed on the
       detached cache, which gives the similarity's own parameters (logit scale) their gradient.
    Passes 1 and 3 run inside the model's forward (see :func:`forward_loss`); pass 2 needs no parameter.
    """
    rt, model = trainer.runtime, trainer.model
    micro = split_batch_rows(batch, rt.plan.micro_size)
    with torch.no_grad(), rt.autocast():
        parts = [model(piece) for piece in micro]
    cached_a = leaf_points(PointSet.cat([p[0] for p in parts]))
    cached_b = leaf_points(PointSet.cat([p[1] for p in parts]))
    # Outside the model's forward on purpose: only the cached features' gradient is wanted, and
    # DDP / DeepSpeed hooks must not see a backward that reduces nothing (ZeRO-3 is refused).
    with rt.full_precision():
        out = contrastive_loss(trainer, cached_a, cached_b, batch, step)
    if not loss_is_finite(trainer, out, step):
        return out, False
    leaves = point_tensors(cached_a) + point_tensors(cached_b)
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    rows = rt.plan.micro_size
    for k, piece in enumerate(micro):
        last = k == len(micro) - 1

        def surrogate(part_a, part_b, k=k, last=last):
            tensors = point_tensors(part_a.float()) + point_tensors(part_b.float())
            total = sum(
                (tensor * grad[k * rows : (k + 1) * rows]).sum()
                for tensor, grad in zip(tensors, grads, strict=True)
                if grad is not None
            )
            if last:
                detached_a, detached_b = cached_a.detach(), cached_b.detach()
                total = total + contrastive_loss(trainer, detached_a, detached_b, batch, step).loss
            return LossOutput(loss=total)

        with rt.no_sync(model, last):
            piece_loss, _ = forward_loss(trainer, piece, surrogate)
            rt.backward(piece_loss, model, last=last)
    return out, True


def split_batch_rows(batch: dict, rows: int) -> list[dict]:
    """A batch dict -> micro-batches of ``rows`` samples (tensors and per-sample lists are cut)."""
    size = batch["index"].shape[0]

    def cut(value, start):
        if isinstance(value, (torch.Tensor, list)):
            return value[start : start + rows]
        if isinstance(value, dict):
            return {key: cut(item, start) for key, item in value.items()}
        return value

    return [{key: cut(value, start) for key, value in batch.items()} for start in range(0, size, rows)]


def point_tensors(points: PointSet) -> list[torch.Tensor]:
    """The differentiable tensors of a point set: points, and weights when present."""
    return [points.points] + ([] if points.weights is None else [points.weights])


def leaf_points(points: PointSet) -> PointSet:
    """fp32 copies that are autograd leaves (the cache whose gradient step 2 computes)."""
    leaf = points.detach().float()
    for tensor in point_tensors(leaf):
        tensor.requires_grad_()
    return leaf
