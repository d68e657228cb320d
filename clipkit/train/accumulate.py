"""Exact gradient accumulation (``train.micro_batch_size``; open_clip's scheme, METHODS §11).

The loss sees the whole contrastive batch however small the micro-batches are, at the price of
encoding every sample twice (once without gradient to cache the features, once with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from clipkit.contract.types import LossOutput, PointSet
from clipkit.train.objective import Objective


@dataclass(frozen=True)
class FeatureGradient:
    """Pass 3 of exact accumulation for one micro-batch: the full-batch loss's gradient with
    respect to the cached features, and which rows of it are this micro-batch's.

    grads: d loss / d cached tensors (points [N, M, d], then weights [N, M] when present; None for
           a tensor the loss does not depend on), in :func:`point_tensors` order, a's then b's.
    rows:  this micro-batch's rows of the cache.
    last:  on the last micro-batch only, (cached a, cached b, the whole batch), detached: see
           :meth:`clipkit.train.step.TrainingStep.gradient_share`.
    """

    grads: tuple[torch.Tensor | None, ...]
    rows: slice
    last: tuple[PointSet, PointSet, dict] | None = None

    def surrogate(self, a: PointSet, b: PointSet) -> torch.Tensor:
        """Σ features · g over this micro-batch's rows: a scalar whose gradient with respect to the
        towers' parameters is exactly this micro-batch's share of the full-batch gradient (g is a
        constant, so d/dθ Σ f(θ)·g = Σ (df/dθ)·g, the chain rule's term for these rows)."""
        tensors = point_tensors(a.float()) + point_tensors(b.float())
        return sum(
            (tensor * grad[self.rows]).sum()
            for tensor, grad in zip(tensors, self.grads, strict=True)
            if grad is not None
        )


def accumulate_exactly(
    training_step: torch.nn.Module,
    objective: Objective,
    batch: dict,
    step: int,
    epoch: float,
    is_finite: Callable[[LossOutput], bool],
) -> tuple[LossOutput, bool]:
    """Exact gradient accumulation (open_clip's scheme, METHODS §11): the loss sees the whole
    contrastive batch however small the micro-batches are.

    1. encode every micro-batch without gradient and cache the features [n, M, d];
    2. compute the loss on the cached (gathered) batch and its gradient g w.r.t. the cached features;
    3. re-encode each micro-batch with gradient and back-propagate Σ features · g (its share of
       the full-batch gradient); the last one also back-propagates the loss recomputed on the
       detached cache, which gives the similarity's own parameters (logit scale) their gradient.

    Why the recompute is exact: the full-batch loss L depends on the towers' parameters θ only
    through the features, so dL/dθ = Σ_k (df_k/dθ)·g_k over the micro-batches k. Pass 3's surrogates
    are those terms one micro-batch at a time; their gradients add up to dL/dθ. The similarity's
    parameters are not behind the features, so their gradient comes from the loss itself,
    recomputed once on the detached cache (detached: it adds nothing to the towers' gradient).
    Each surrogate already carries the full-batch scale; :meth:`clipkit.train.runtime.Runtime.backward`
    keeps it (the accumulation scaling contract).

    ``training_step``: the step module as the runtime wrapped it (see :mod:`clipkit.train.step`);
    passes 1 and 3 run through it, pass 2 needs no parameter. ``is_finite(out)``: whether every
    process's full-batch loss is finite (the loop's rule; it also drops the step's gradients).
    Returns (the full-batch LossOutput, whether it was finite).
    """
    rt = objective.runtime
    micro = split_batch_rows(batch, rt.plan.micro_size)
    with torch.no_grad():
        parts = [training_step(piece, step, epoch, towers_only=True) for piece in micro]
    cached_a = leaf_points(PointSet.cat([p[0] for p in parts]))
    cached_b = leaf_points(PointSet.cat([p[1] for p in parts]))
    # Outside the step's forward on purpose: only the cached features' gradient is wanted, and
    # DDP / DeepSpeed hooks must not see a backward that reduces nothing (ZeRO-3 is refused).
    with rt.full_precision():
        out = objective(cached_a, cached_b, batch, step=step, epoch=epoch)
    if not is_finite(out):
        return out, False
    leaves = point_tensors(cached_a) + point_tensors(cached_b)
    grads = tuple(torch.autograd.grad(out.loss, leaves, allow_unused=True))
    rows = rt.plan.micro_size
    for k, piece in enumerate(micro):
        last = k == len(micro) - 1
        whole = (cached_a.detach(), cached_b.detach(), batch) if last else None
        gradient = FeatureGradient(grads, slice(k * rows, (k + 1) * rows), whole)
        with rt.no_sync(training_step, last):
            share, _ = training_step(piece, step, epoch, gradient)
            rt.backward(share, training_step, last=last)
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
