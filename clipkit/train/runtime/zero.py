"""DeepSpeed ZeRO 1–3: clipkit builds the engine itself from the recipe's config.

Accelerate's own DeepSpeed glue needs ``transformers``, so Accelerate only starts the process
group here. Half precision is DeepSpeed's own (half parameters, fp32 master weights, dynamic loss
scaling for fp16): no autocast, and float inputs are cast to the engine's dtype.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from pathlib import Path

import torch

from clipkit import install_hint
from clipkit.errors import ClipkitError
from clipkit.train.runtime import partitions
from clipkit.train.runtime.strategy import HALF, StepResult


def _skip_the_cpu_inference_kernel() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce kernel on CPU.

    DeepSpeed's communication backend JIT-compiles that C++ kernel (about a minute of g++, and a
    failure without a compiler) the first time a process group starts on a CPU accelerator, and
    again for every new environment. Only ``inference_all_reduce`` uses it; training never does, and
    without it DeepSpeed falls back to ``torch.distributed.all_reduce`` (deepspeed/comm/torch.py).
    A DeepSpeed without ``build_shm_op`` is left as it is.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    # By module path: ``import deepspeed.comm.torch as x`` binds the attribute ``torch`` of
    # deepspeed.comm, which is the torch package that module imports, not this submodule.
    backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


class DeepSpeedStrategy:
    """The strategy for DeepSpeed ZeRO (see :class:`clipkit.train.runtime.strategy.Strategy`)."""

    name = "deepspeed"
    divides_by_accumulation_steps = True  # its hooks divide every micro-batch's gradient (see backward)

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

    @property
    def compile_refusal(self) -> str | None:
        """ZeRO-3 refuses ``train.compile`` (why: :func:`clipkit.config.recipe.compile_refusal`,
        which validation asks too, so `clipkit validate` refuses what the run would)."""
        from clipkit.config.recipe import compile_refusal

        return compile_refusal(self.name, self.zero_stage)

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
        _skip_the_cpu_inference_kernel()
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

    def backward(self, loss: torch.Tensor, model, *, last: bool) -> None:
        """DeepSpeed reduces the gradients at ``last`` (the accumulation boundary); it divides every
        micro-batch's gradient by the accumulation steps, which :meth:`Runtime.backward` undoes."""
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss)

    def step(self, model, optimizer) -> StepResult:
        """The engine's step; it skips a step only when its fp16 loss scaler saw an overflow (bf16
        and fp32 steps are always applied), so an unapplied step is an overflow."""
        skipped_before = model.skipped_steps
        model.step()
        applied = model.skipped_steps == skipped_before
        return StepResult(applied, _float_or_none(model.get_global_grad_norm()), overflowed=not applied)

    def zero_grad(self, model, optimizer) -> None:
        model.zero_grad()

    #: DeepSpeed's optimiser steps its own fp32 partitions, not the module's parameters, so an
    #: in-place clamp of the module's copy would be overwritten by the next step.
    parameter_clamp_refusal = (
        "under DeepSpeed the optimiser updates ZeRO's fp32 partitions, not the module's parameters, so "
        "bounded parameters (the logit scale) are kept in bounds in the forward pass only: the gradient "
        "stops at the bound (use DDP for open_clip's clamp after the step)"
    )

    def clamp_parameters(self, bounds: tuple) -> None:
        raise AssertionError(self.parameter_clamp_refusal)  # Runtime.clamp_parameters never calls it

    # ------------------------------------------------------------------ state

    def save(self, model, optimizer, checkpoint: Path) -> dict:
        """Every process writes its ZeRO partition (model, optimiser, loss scaler) under the
        checkpoint; state.pt gets none of them."""
        model.save_checkpoint(str(partitions.directory(checkpoint)), tag=partitions.TAG, save_latest=False)
        return {"model": None, "optimizer": None, "scaler": None}

    def load_before_wrapping(self, model, optimizer, state: dict, checkpoint: Path) -> None:
        """Nothing: the weights are in the partitions, which only the engine can load."""

    def load_after_wrapping(self, model, checkpoint: Path, state: dict) -> None:
        """This process's ZeRO partition into the engine (the files were checked before: see
        :func:`clipkit.train.runtime.partitions.check_files`)."""
        directory = partitions.directory(checkpoint)
        path, _ = model.load_checkpoint(
            str(directory), tag=partitions.TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ClipkitError(
                f"{directory}: no DeepSpeed checkpoint (tag '{partitions.TAG}') to resume from"
            )

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

    def model_for_evaluation(self, model, plain, rebuild, device, is_main: bool):
        """A fresh fp32 model from ``rebuild()`` with the gathered full weights (the engine's may be
        partitioned or half precision); every process must call."""
        state = self.full_state_dict(model, is_main)
        if not is_main:
            return None
        fresh = rebuild()
        fresh.load_state_dict(state)
        return fresh.to(device)

    def close(self) -> None:
        """Nothing of its own to release (Accelerate owns the process group)."""


def _float_or_none(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)
