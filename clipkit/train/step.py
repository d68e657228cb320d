"""The training step as one module: :class:`TrainingStep`, whose forward *is* the step.

Why a module: DDP hooks its wrapped module's forward (the gradient all-reduce is prepared there),
and DeepSpeed ZeRO-3 gathers each sub-module's partitioned parameters around its forward and
backward. The similarity owns parameters (a temperature, a bandwidth), so the whole step — the
towers, the gather into the global batch, the similarity and the loss — must run inside the
forward of the one module the runtime wraps. That module is this one; the training loop calls it
through the wrapper (``trainer.step(batch, step)``) and reads the loss off its result.

Read :meth:`TrainingStep.forward` top to bottom: the towers encode this process's batch in the
recipe's precision (:meth:`ContrastiveModel.forward`), then :func:`~clipkit.train.objective.contrastive_loss`
gathers the point sets, compares them and scores the logits in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from clipkit.model import ContrastiveModel
from clipkit.train.objective import contrastive_loss
from clipkit.types import LossOutput, PointSet

if TYPE_CHECKING:
    from clipkit.train.accumulate import FeatureGradient
    from clipkit.train.build import Trainer


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
    """The module the runtime wraps (DDP or a DeepSpeed engine): ``forward(batch, step)`` is the step.

    It registers the model's own sub-modules (towers, similarity) under their own names, so its
    parameters are exactly the model's — same names, same order — and gradient buckets, ZeRO
    partitions, optimiser state and checkpoints are those of the model. The model itself is kept as
    a plain attribute (not a sub-module), so no parameter is listed twice.

    ``trainer`` is set once by :func:`clipkit.train.build.build_trainer`: the step reads the
    trainer's runtime, loss and stream when it runs.
    """

    model: ContrastiveModel  # the plain model (set in __init__, outside nn.Module's registry)

    def __init__(self, model: ContrastiveModel) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.__dict__["model"] = model  # not a sub-module: see the class docstring
        self.trainer: Trainer | None = None

    def train(self, mode: bool = True) -> TrainingStep:
        """The model's own ``train`` (locked towers stay in eval mode)."""
        self.training = mode
        self.model.train(mode)
        return self

    def forward(
        self, batch: dict, step: int, gradient: FeatureGradient | None = None, *, towers_only: bool = False
    ) -> StepOutput | tuple[PointSet, PointSet]:
        """One contrastive step on this process's ``batch``: towers -> gather -> similarity -> loss;
        returns the loss and its LossOutput.

        Exact accumulation (:mod:`clipkit.train.accumulate`) runs its two passes over the towers
        through this forward too (so DDP and DeepSpeed see every forward of the step):
        ``towers_only`` returns the point sets (pass 1, without gradient); ``gradient`` returns
        this micro-batch's share of the full-batch gradient as a surrogate loss (pass 3).
        """
        trainer = self.trainer
        rt = trainer.runtime
        with rt.autocast():  # only the towers run in reduced precision
            a, b = self.model(batch)
        if towers_only:
            return a, b
        with rt.full_precision():  # similarities and losses always compute in fp32
            if gradient is not None:
                return StepOutput(self.gradient_share(gradient, a, b, step), None)
            out = contrastive_loss(trainer, a, b, batch, step)
        return StepOutput(out.loss, out)

    def gradient_share(self, gradient: FeatureGradient, a: PointSet, b: PointSet, step: int) -> torch.Tensor:
        """A micro-batch's surrogate: Σ features · g; on the last micro-batch also the full-batch
        loss on the detached cache, the only path from the loss to the similarity's own parameters."""
        total = gradient.surrogate(a, b)
        if gradient.last is not None:
            cached_a, cached_b, whole_batch = gradient.last
            total = total + contrastive_loss(self.trainer, cached_a, cached_b, whole_batch, step).loss
        return total
