"""The training step as one module: :class:`TrainingStep`, whose forward *is* the step.

Why a module: DDP hooks its wrapped module's forward (the gradient all-reduce is prepared there),
and DeepSpeed ZeRO-3 gathers each sub-module's partitioned parameters around its forward and
backward. The similarity owns parameters (a temperature, a bandwidth), so the whole step — the
towers, the gather into the global batch, the similarity and the loss — must run inside the
forward of the one module the runtime wraps. That module is this one; the training loop calls it
through the wrapper (``trainer.step(batch, step, epoch)``) and reads the loss off its result.

Read :meth:`TrainingStep.forward` top to bottom: the towers encode this process's batch in the
recipe's precision (:meth:`ContrastiveModel.forward`), then the objective
(:class:`~clipkit.train.objective.Objective`) gathers the point sets, compares them and scores the
logits in fp32. The step needs a model, an objective and a batch — no trainer::

    step = TrainingStep(model, build_objective(recipe, registry, model))
    loss, out = step(batch, 0, 0.0)     # batch: image [B, 3, S, S], text [B, L], index [B]
    loss.backward()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from clipkit.contract.types import LossOutput, PointSet
from clipkit.model import ContrastiveModel
from clipkit.train.objective import Objective

if TYPE_CHECKING:
    from clipkit.train.accumulate import FeatureGradient


class StepOutput(NamedTuple):
    """What the step's forward returns, as a named tuple because DDP and DeepSpeed walk tuples of
    tensors in a module's output (ZeRO-3 hooks the tensors it finds there for its backward).

    loss: the 0-d tensor to back-propagate — this one, as returned through the wrapper, not
          ``out.loss`` (ZeRO-3 may hand back a hooked copy).
    out:  the loss's :class:`LossOutput` (loss and metrics); None for a pass of exact accumulation,
          whose ``loss`` is a surrogate.
    """

    loss: torch.Tensor
    out: LossOutput | None


class TrainingStep(nn.Module):
    """The module the runtime wraps (DDP or a DeepSpeed engine): ``forward(batch, step, epoch)`` is
    the step.

    It registers the model's own sub-modules (towers, similarity) under their own names, so its
    parameters are exactly the model's — same names, same order — and gradient buckets, ZeRO
    partitions, optimiser state and checkpoints are those of the model. The model itself is kept as
    a plain attribute (not a sub-module), so no parameter is listed twice; so is the objective (its
    loss may hold per-sample state, which checkpoints keep apart from the model's weights).
    """

    model: ContrastiveModel  # the plain model (set in __init__, outside nn.Module's registry)
    objective: Objective

    def __init__(self, model: ContrastiveModel, objective: Objective) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.__dict__["model"] = model  # not a sub-module: see the class docstring
        self.__dict__["objective"] = objective

    def train(self, mode: bool = True) -> TrainingStep:
        """The model's own ``train`` (locked towers stay in eval mode)."""
        self.training = mode
        self.model.train(mode)
        return self

    def forward(
        self,
        batch: dict,
        step: int,
        epoch: float = 0.0,
        gradient: FeatureGradient | None = None,
        *,
        towers_only: bool = False,
    ) -> StepOutput | tuple[PointSet, PointSet]:
        """One contrastive step on this process's ``batch``: towers -> gather -> similarity -> loss;
        returns the loss and its LossOutput. ``epoch``: the fractional epoch (scheduled losses).

        Exact accumulation (:mod:`clipkit.train.accumulate`) runs its two passes over the towers
        through this forward too (so DDP and DeepSpeed see every forward of the step):
        ``towers_only`` returns the point sets (pass 1, without gradient); ``gradient`` returns
        this micro-batch's share of the full-batch gradient as a surrogate loss (pass 3).
        """
        objective = self.objective
        rt = objective.runtime
        # 1. The towers encode this process's batch: the only part in reduced precision.
        with rt.autocast():
            a, b = self.model(batch)
        if towers_only:
            return a, b
        # 2-4. Gather, compare, score: similarities and losses always compute in fp32.
        with rt.full_precision():
            if gradient is not None:
                return StepOutput(self.gradient_share(gradient, a, b, step, epoch), None)
            out = objective(a, b, batch, step=step, epoch=epoch)
        return StepOutput(out.loss, out)

    def gradient_share(
        self, gradient: FeatureGradient, a: PointSet, b: PointSet, step: int, epoch: float
    ) -> torch.Tensor:
        """A micro-batch's surrogate: Σ features · g; on the last micro-batch also the full-batch
        loss on the detached cache, the only path from the loss to the similarity's own parameters."""
        total = gradient.surrogate(a, b)
        if gradient.last is not None:
            cached_a, cached_b, whole_batch = gradient.last
            total = total + self.objective(cached_a, cached_b, whole_batch, step=step, epoch=epoch).loss
        return total
