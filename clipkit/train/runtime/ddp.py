"""One process or several under DDP (Accelerate), with torch autocast and fp16 loss scaling.

Precision: the towers run under ``torch.autocast`` (bf16 or fp16); fp16 adds a
``torch.amp.GradScaler`` (dynamic loss scaling: a step whose gradients overflow is skipped and
the scale lowered). Similarities and losses leave autocast (:meth:`full_precision`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from clipkit.artifacts.safe_load import first_line
from clipkit.errors import ArtifactError
from clipkit.train.runtime import dcp_files
from clipkit.train.runtime.strategy import HALF, StepResult


class DDPStrategy:
    """The strategy for plain and DDP training (see :class:`clipkit.train.runtime.strategy.Strategy`)."""

    name = "ddp"
    exact_accumulation_refusal = None  # exact accumulation works with DDP
    divides_by_accumulation_steps = False  # each backward adds its gradient as it is
    parameter_clamp_refusal = None  # bounded parameters are clamped in place after each step
    # Compiled towers and scoring inside DDP's forward: the reducer's hooks sit on the parameters'
    # gradient accumulators, which the compiled backward feeds like eager code does.
    compile_refusal = None

    def __init__(self, accelerator, *, precision: str, grad_clip: float) -> None:
        self.accelerator, self.precision, self.grad_clip = accelerator, precision, grad_clip
        self.scaler = torch.amp.GradScaler(accelerator.device.type) if precision == "fp16" else None

    def prepare(self, model, optimizer):
        model, optimizer = self.accelerator.prepare(model, optimizer)
        self._wrapped = model  # close() releases its reducer
        return model, optimizer

    def unwrap(self, model):
        """The plain module inside DDP. DDP's own wrapper is stripped here: Accelerate's
        ``unwrap_model`` imports DeepSpeed (~2 s and its CPU warning in every run) and reads
        package metadata on every call (~1.5 ms a step)."""
        parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        return model.module if isinstance(model, parallel) else model

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, dtype=HALF[self.precision])

    def full_precision(self) -> contextlib.AbstractContextManager:
        if self.precision == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, enabled=False)

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # autocast casts inside the towers

    def no_sync(self, model, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on every micro-batch but the last."""
        if last or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, model, *, last: bool) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, model, optimizer) -> StepResult:
        """Unscale (fp16), measure/clip the norm, step unless non-finite, zero the gradients."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        # The norm is measured every step (not only when clipping): a NaN/inf gradient must not reach
        # the weights unnoticed. DDP has already averaged the gradients, so all processes agree.
        norm = self._grad_norm(model)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)  # skips the update itself when the gradients overflowed
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale
        else:
            applied = math.isfinite(norm)
            if applied:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Only the GradScaler skips a step because of overflow; without one, an unapplied step had
        # a non-finite gradient.
        return StepResult(applied, norm, overflowed=not applied and self.scaler is not None)

    def _grad_norm(self, model) -> float:
        if self.grad_clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def zero_grad(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def clamp_parameters(self, bounds: tuple) -> None:
        """The optimiser steps the module's own parameters (every process alike), so clamping them in
        place is the whole update."""
        from clipkit.train.bounds import clamp_in_place

        clamp_in_place(bounds)

    # ------------------------------------------------------------------ state

    def save(self, model, optimizer, checkpoint: Path) -> dict:
        """Nothing per process: the model, optimiser and scaler go into the main process's state.pt."""
        scaler = None if self.scaler is None else self.scaler.state_dict()
        return {
            "model": self.unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler,
        }

    def load_before_wrapping(self, model, optimizer, state: dict, checkpoint: Path) -> None:
        """The checkpoint's model and optimiser, loaded before DDP wraps them (every process loads
        the same, so DDP's initial broadcast changes nothing): state.pt's, or an FSDP2 run's shards
        gathered whole (:mod:`~clipkit.train.runtime.dcp_files`)."""
        if state.get("model") is None and dcp_files.present(checkpoint):
            model_state, optimizer_state = dcp_files.full_state(checkpoint, state.get("sharded") or {})
            state = {**state, "model": model_state, "optimizer": by_index(optimizer_state, model, optimizer)}
        load_full_state(model, optimizer, state, checkpoint)

    def load_after_wrapping(self, model, checkpoint: Path, state: dict) -> None:
        """The fp16 loss scale (nothing else is left once the weights are loaded)."""
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    def gathered(self, module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def model_for_evaluation(self, model, plain, rebuild, device, is_main: bool):
        """The in-memory ``plain`` model on the main process (None elsewhere); ``rebuild`` is unused."""
        return plain if is_main else None

    def close(self) -> None:
        """Release DDP's reducer while the process group is still registered (Accelerate owns the
        group). The reducer holds the group; freed last, its C++ destructor would destroy the group
        with the GIL held and join gloo's worker threads, one of which may need the GIL to free a
        finished all-reduce's tensors: a deadlock at exit (torch issue 56297; seen once at the end
        of a two-process run). Destroyed through ``destroy_process_group`` instead, the group is
        released without the GIL."""
        wrapped = getattr(self, "_wrapped", None)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            for attribute in ("logger", "reducer"):
                if hasattr(wrapped, attribute):
                    delattr(wrapped, attribute)
        self._wrapped = None


def load_full_state(model, optimizer, state: dict, checkpoint: Path) -> None:
    """state's full ``model`` and ``optimizer`` into the plain model and optimiser; a mismatch is
    reported as the checkpoint's problem rather than a traceback."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        check_optimizer_kind(optimizer, checkpoint)
    except (RuntimeError, TypeError, ValueError, AttributeError, KeyError) as error:
        raise ArtifactError(
            f"{Path(checkpoint) / 'state.pt'}: its model weights do not fit the recipe's model "
            f"({first_line(error)}); resume with the recipe the run was trained with"
        ) from error


def check_optimizer_kind(optimizer, checkpoint: Path) -> None:
    """ArtifactError unless the loaded groups hold every setting ``optimizer`` reads: torch's
    ``load_state_dict`` takes the saved groups' settings as they are (filling in only the ones a
    newer torch added), so resuming an AdamW run with ``optimizer.name=sgd`` failed in the first
    step (KeyError: 'momentum')."""
    missing = sorted(
        {key for group in optimizer.param_groups for key in optimizer.defaults if key not in group}
    )
    if missing:
        raise ArtifactError(
            f"{Path(checkpoint) / 'state.pt'}: its optimiser state is another optimiser's than "
            f"{type(optimizer).__name__} (its groups lack {', '.join(map(repr, missing))}); resume "
            "with the optimizer the run was trained with (see the run's recipe.yaml), or start a new "
            "run from its export"
        )


def by_index(optimizer_state: dict, model, optimizer) -> dict:
    """An optimiser state keyed by parameter names (FSDP2's checkpoints) -> ``optimizer``'s own
    ``state_dict`` form (keyed by position), for a plain ``optimizer`` over ``model``'s parameters."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    saved_groups = optimizer_state.get("param_groups") or []
    position, state, groups = 0, {}, []
    for index, group in enumerate(optimizer.param_groups):
        saved = dict(saved_groups[index]) if index < len(saved_groups) else {}
        indices = []
        for parameter in group["params"]:
            slots = optimizer_state["state"].get(names.get(id(parameter)))
            if slots:
                state[position] = {
                    k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in slots.items()
                }
            indices.append(position)
            position += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **saved, "params": indices})
    return {"state": state, "param_groups": groups}
