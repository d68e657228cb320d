"""What a training strategy owns: everything that differs between plain/DDP and DeepSpeed runs.

:class:`clipkit.train.runtime.Runtime` picks one (:class:`~clipkit.train.runtime.ddp.DDPStrategy` or
:class:`~clipkit.train.runtime.zero.DeepSpeedStrategy`) from the recipe and delegates to it, so the
training loop never asks which one it has. Nothing outside :mod:`clipkit.train.runtime` holds a
strategy (tests/test_architecture.py checks that no code outside the package reads ``.strategy``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step did.

    applied:    the weights were updated.
    grad_norm:  the gradient norm before clipping (None when the engine does not report one).
    overflowed: an unapplied step was loss scaling at work (fp16 gradients overflowed and the scale
                was lowered): expected, not an error. An unapplied step that did not overflow had a
                non-finite gradient (:attr:`bad_gradient`).
    """

    applied: bool
    grad_norm: float | None
    overflowed: bool = False

    @property
    def bad_gradient(self) -> bool:
        """The step was refused because its gradient was non-finite (not a loss-scaling skip)."""
        return not self.applied and not self.overflowed


class Strategy(Protocol):
    name: str
    scaler: Any  # torch.amp.GradScaler under fp16 without DeepSpeed, else None
    exact_accumulation_refusal: str | None  # why exact accumulation cannot run, or None
    # DeepSpeed divides every micro-batch's gradient by the accumulation steps; DDP does not.
    divides_by_accumulation_steps: bool
    parameter_clamp_refusal: str | None  # why bounded parameters cannot be clamped in place, or None
    compile_refusal: str | None  # why train.compile cannot run under this strategy, or None

    def prepare(self, model, optimizer) -> tuple[Any, Any]: ...
    def unwrap(self, model) -> Any: ...
    def autocast(self) -> contextlib.AbstractContextManager: ...
    def full_precision(self) -> contextlib.AbstractContextManager: ...
    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def no_sync(self, model, last: bool) -> contextlib.AbstractContextManager: ...
    def backward(self, loss: torch.Tensor, model, *, last: bool) -> None: ...
    def step(self, model, optimizer) -> StepResult: ...
    def zero_grad(self, model, optimizer) -> None: ...
    def clamp_parameters(self, bounds: tuple) -> None: ...
    def load_before_wrapping(self, model, optimizer, state: dict, checkpoint: Path) -> None: ...
    def load_after_wrapping(self, model, checkpoint: Path, state: dict) -> None: ...
    def save(self, model, optimizer, checkpoint: Path) -> dict: ...
    def gathered(self, module) -> contextlib.AbstractContextManager: ...
    def model_for_evaluation(self, model, plain, rebuild, device, is_main: bool) -> Any: ...
    def close(self) -> None: ...
