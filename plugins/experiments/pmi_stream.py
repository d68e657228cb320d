"""The ``pmi_pairs`` stream: fresh joint samples of the PMI task, as a recipe's ``data.stream``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from clipkit.plugins.experiments.pmi_distribution import LatentPairDistribution


class LatentPairStream:
    """The ``pmi_pairs`` stream: every batch is ``batch_size`` fresh joint samples of a
    :class:`LatentPairDistribution` (``batch["x"]`` [B, dx], ``batch["y"]`` [B, dy]).

    seed:               the sample stream (the run's seed; rank r > 0 draws from its own stream).
    distribution_seed:  the task's means (LatentPairDistribution's ``seed``); the other keys are
                        the distribution's own arguments.
    samples_per_epoch:  the nominal epoch (sample ids are counted modulo it; nothing repeats).

    ``position`` is the number of batches drawn; ``restore`` replays that many, so a resumed run
    sees the batches an uninterrupted one would.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_latent: int = 8,
        x_dim: int = 8,
        y_dim: int = 8,
        prior: list | None = None,
        separation: float = 1.0,
        noise_x: float = 1.0,
        noise_y: float = 1.0,
        distribution_seed: int = 0,
        samples_per_epoch: int = 65_536,
    ) -> None:
        self.distribution = LatentPairDistribution(
            num_latent, x_dim, y_dim, prior=prior, separation=separation, noise_x=noise_x,
            noise_y=noise_y, seed=distribution_seed,
        )  # fmt: skip
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.num_samples = samples_per_epoch
        self._restart(0)

    def _restart(self, batches: int) -> None:
        # Rank 0 draws from ``seed`` itself, so one process sees the stream the study documents.
        self.generator = torch.Generator().manual_seed(self.seed + 7_919 * self.rank)
        self.drawn = 0
        for _ in range(batches):
            next(self)

    @property
    def epoch(self) -> int:
        return self.drawn * self.batch_size * self.world_size // self.num_samples

    @property
    def batch_in_epoch(self) -> int:
        per_epoch = max(1, self.num_samples // (self.batch_size * self.world_size))
        return self.drawn % per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Tensor]:
        x, y, _ = self.distribution.sample_pairs(self.batch_size, self.generator)
        first = (self.drawn * self.world_size + self.rank) * self.batch_size
        self.drawn += 1
        index = torch.arange(first, first + self.batch_size) % self.num_samples
        return {"x": x, "y": y, "index": index}

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "batches": self.drawn}

    def restore(self, position: dict[str, int]) -> None:
        self._restart(int(position["batches"]))


def study_stream(distribution: LatentPairDistribution) -> dict[str, Any]:
    """The recipe's ``data.stream`` that samples ``distribution`` (its config, seed renamed)."""
    config = dict(distribution.config)
    distribution_seed = config.pop("seed")
    return {"name": "pmi_pairs", **config, "distribution_seed": distribution_seed}
