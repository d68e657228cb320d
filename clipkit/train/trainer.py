"""What a training run holds once built: :class:`Trainer`, :class:`RunInfo` and the batch-stream
protocol (:class:`TrainingStream`), apart from the code that builds (clipkit.train.build), runs
(clipkit.train.loop) and checkpoints (clipkit.train.checkpoint) them — so none of those needs another
to name these types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from clipkit.config.recipe import TrainConfig
from clipkit.contract.registry import Registry
from clipkit.contract.types import Loss
from clipkit.model import ContrastiveModel
from clipkit.train.ema import WeightEMA
from clipkit.train.objective import Objective
from clipkit.train.runtime import Runtime


@dataclass(frozen=True)
class RunInfo:
    """What ``on_metrics`` loggers get to know about the run."""

    directory: Path
    recipe: str
    is_main: bool


class TrainingStream(Protocol):
    """This process's batches: a :class:`clipkit.data.loader.BatchStream` over shards, a registered
    stream (``data.stream``; see :func:`clipkit.contract.hookspecs.register_streams`), or
    :class:`clipkit.data.memory.InMemoryStream` (batches already in memory)."""

    num_samples: int
    epoch: int
    batch_in_epoch: int

    def __iter__(self) -> Iterator[dict]: ...
    def position(self) -> dict[str, int]: ...
    def restore(self, position: dict[str, int]) -> None: ...


def fractional_epoch(stream: TrainingStream, global_batch_size: int) -> float:
    """The epoch the stream is in, with the batches of it already taken as a fraction (losses with
    schedules read it: NUCLR's ζ warm-up, y-Aware's annealing)."""
    return stream.epoch + stream.batch_in_epoch * global_batch_size / stream.num_samples


@dataclass
class Trainer:
    """Everything the loop touches, built from a validated recipe.

    Who changes what: :func:`clipkit.train.build.build_trainer` sets every field once;
    :func:`clipkit.train.checkpoint.restore_trainer` sets ``start_step`` and ``skipped_steps`` from a
    checkpoint; afterwards only the training loop (:mod:`clipkit.train.loop`) changes ``skipped_steps``.
    """

    recipe: dict
    settings: TrainConfig  # the recipe's ``train`` section, typed, with defaults
    registry: Registry
    runtime: Runtime
    model: ContrastiveModel  # the plain model (towers + similarity): what evaluation and export see
    step: torch.nn.Module  # TrainingStep over ``model``, as wrapped by the runtime (DDP or DeepSpeed engine)
    objective: Objective  # gather -> similarity -> loss, tiling decided (clipkit.train.objective)
    optimizer: torch.optim.Optimizer  # as wrapped by the runtime
    schedule: torch.optim.lr_scheduler.LRScheduler
    stream: TrainingStream
    run: RunInfo
    start_step: int = 0
    skipped_steps: int = 0  # optimiser steps skipped (non-finite loss with nonfinite: skip, fp16 overflow)
    augment: Callable[[dict, int], dict] | None = None  # data.augment: batched (crops on the device)
    ema: WeightEMA | None = None  # train.ema: the fp32 weight average (clipkit.train.ema)

    @property
    def loss(self) -> Loss:
        """The recipe's loss (the objective's; checkpoints hold its per-sample state)."""
        return self.objective.loss

    def epoch(self) -> float:
        """The fractional epoch of the batch the stream gave last."""
        return fractional_epoch(self.stream, self.runtime.plan.global_size)
