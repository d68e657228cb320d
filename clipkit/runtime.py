"""The ONLY module that touches Accelerate, torch.distributed, autocast and loss scaling.

Plugins (encoders, similarities, losses) never see ranks, devices or dtypes: the loop
asks the runtime to run the towers under autocast, to gather features into the global
batch in fp32, and to back-propagate and step. Single-process here; multi-process and
DeepSpeed (issue 7) extend this module only.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch

from clipkit.types import PointSet


class Runtime:
    """Thin wrapper around an ``accelerate.Accelerator``.

    precision: "no" (fp32), "bf16" or "fp16" — applies to the towers only; similarities and
               losses run in fp32 (METHODS §11: exp(Δ/τ) overflows in fp16).
    """

    def __init__(self, precision: str = "no", seed: int = 0) -> None:
        from accelerate import Accelerator

        cpu = not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=precision)
        self.seed = seed
        seed_everything(seed)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    def prepare(self, model, optimizer, schedule):
        """Wrap model/optimizer/schedule for the device and precision (never the data loader)."""
        return self.accelerator.prepare(model, optimizer, schedule)

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    def gather(self, points: PointSet) -> PointSet:
        """This rank's point sets -> the global batch, in fp32 (single process: a dtype cast)."""
        return points.float()

    def targets(self, points: PointSet) -> torch.Tensor:
        """[N] positive index of each anchor of the global batch (the diagonal)."""
        return torch.arange(points.batch_size, device=points.points.device)

    def generator(self, step: int) -> torch.Generator:
        """A generator seeded by (seed, step): identical randomness on every rank (e.g. WPSE's
        fresh random features), reproducible on resume."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 1_000_003 + step)
        return generator

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, model, max_norm: float) -> float:
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_norm))

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG the loop draws from, for checkpoints."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
