"""DeepSpeed ZeRO 1–3: clipkit builds the engine itself from the recipe's config.

Accelerate's own DeepSpeed glue needs ``transformers``, so Accelerate only starts the process
group here. Half precision is DeepSpeed's own (half parameters, fp32 master weights, dynamic loss
scaling for fp16): no autocast, and float inputs are cast to the engine's dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from clipkit import install_hint
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.train.runtime.strategy import HALF, StepResult


class DeepSpeedStrategy:
    """The strategy for DeepSpeed ZeRO (see :class:`clipkit.train.runtime.strategy.Strategy`)."""

    name = "deepspeed"
    state_in_checkpoint_file = False  # the engine writes its own partitions
    skips_overflow_steps = True  # DeepSpeed's loss scaler skips overflowing fp16 steps; bf16/fp32 never

    def __init__(self, *, precision: str, zero_stage: int, config: dict) -> None:
        self.precision, self.zero_stage, self.config = precision, zero_stage, config
        self.scaler = None  # DeepSpeed scales the loss itself

    @property
    def exact_accumulation_refusal(self) -> str | None:
        if self.zero_stage == 3:
            return (
                "exact gradient accumulation is not supported under ZeRO-3 (its loss pass runs the "
                "similarity outside DeepSpeed's forward, where ZeRO-3 has partitioned its parameters); "
                "use zero_stage 2, DDP, or more processes"
            )
        return None

    def prepare(self, model, optimizer):
        try:
            import deepspeed
        except ImportError as error:
            raise ClipkitError(
                f"train.distributed.strategy=deepspeed needs DeepSpeed: {install_hint('deepspeed')}"
            ) from error
        # DeepSpeed calls collectives torch 2.13 deprecated; one warning per call floods the log.
        warnings.filterwarnings(
            "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        engine, engine_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, dist_init_required=False
        )
        return engine, engine_optimizer

    def unwrap(self, model):
        return getattr(model, "module", model)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # DeepSpeed casts the parameters instead

    def full_precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """Float inputs meet half-precision parameters in the engine's dtype."""
        if self.precision in HALF and tensor.is_floating_point():
            return tensor.to(HALF[self.precision])
        return tensor

    def no_sync(self, model, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine reduces at the accumulation boundary itself

    def backward(self, loss: torch.Tensor, model, *, last: bool, micro_batches: int) -> None:
        """DeepSpeed reduces at ``last`` and divides every micro-batch's gradient by the
        accumulation steps (its hooks do so whatever ``scale_wrt_gas`` says); the caller's
        surrogates already carry the full-batch scale, so the loss is multiplied back first."""
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss * micro_batches)

    def step(self, model, optimizer) -> StepResult:
        skipped_before = model.skipped_steps
        model.step()
        return StepResult(model.skipped_steps == skipped_before, _float_or_none(model.get_global_grad_norm()))

    def zero_grad(self, model, optimizer) -> None:
        model.zero_grad()

    # ------------------------------------------------------------------ state

    def checkpoint_state(self, model, optimizer) -> dict:
        return {"model": None, "optimizer": None}

    def save_sharded(self, model, directory: Path) -> None:
        """Every process writes its ZeRO partition (model + optimiser) under ``directory``."""
        model.save_checkpoint(str(directory), tag="zero", save_latest=False)

    def load_sharded(self, model, directory: Path) -> None:
        path, _ = model.load_checkpoint(
            str(directory), tag="zero", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ClipkitError(f"{directory}: no DeepSpeed checkpoint (tag 'zero') to resume from")

    def full_state_dict(self, model, is_main: bool) -> dict[str, torch.Tensor] | None:
        """Every process must call: under ZeRO-3 the partitions are gathered."""
        with self.gathered(model.module):
            state = {k: v.detach().float().cpu().clone() for k, v in model.module.state_dict().items()}
        return state if is_main else None

    def gathered(self, module) -> contextlib.AbstractContextManager:
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)

    def model_for_evaluation(self, model, rebuild, device, is_main: bool):
        """A fresh fp32 model from ``rebuild()`` with the gathered full weights (the engine's may be
        partitioned or half precision); every process must call."""
        state = self.full_state_dict(model, is_main)
        if not is_main:
            return None
        fresh = rebuild()
        fresh.load_state_dict(state)
        return fresh.to(device)

    def scaler_state(self) -> dict | None:
        return None

    def load_scaler_state(self, state: dict | None) -> None:
        """DeepSpeed's scaler state is in its own checkpoint."""


def consolidate_zero_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1/2/3 partitions -> one fp32 state dict (DeepSpeed's zero_to_fp32, in-process)."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as error:
        raise ClipkitError(
            f"{directory.parent} is a DeepSpeed checkpoint; install deepspeed ({install_hint('deepspeed')})"
        ) from error
    try:  # the files passed check_deepspeed_files in load_state: nothing but allowed types to unpickle
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag="zero")
    except Exception as error:  # DeepSpeed raises ValueError, KeyError, FileNotFoundError, asserts
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ArtifactError(
            f"{directory}: cannot consolidate the ZeRO partitions ({first_line}); the checkpoint is "
            f"damaged or incomplete — export another one (--checkpoint)"
        ) from error
    return {key: value.float().contiguous() for key, value in state.items()}


def _float_or_none(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)
