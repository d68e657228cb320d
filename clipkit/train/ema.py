"""Weight EMA (``train.ema``): an fp32 exponential moving average of the trainable weights.

After every ``every``-th *applied* optimiser step t (a skipped step — non-finite loss, fp16
overflow — is not counted)::

    d_t = (decay · min(1, t / warmup)) ** every      (warmup 0: decay ** every)
    ema <- d_t · ema + (1 - d_t) · w                  (per parameter, in fp32)

Raising to ``every`` keeps the averaging horizon, in optimiser steps, independent of how often
the average is taken. Only trainable parameters are averaged (a locked tower never changes, so its
EMA is itself); buffers are the live model's. The copy lives on the training device in fp32: 4
bytes per trainable parameter, whatever ``train.precision`` is.

Processes: under DDP and DeepSpeed ZeRO-1/2 every process holds the whole updated weights after a
step, so every process keeps the same average (no communication) and the main process checkpoints
it in state.pt (``ema``). Under ZeRO-1/2 with bf16/fp16 the module's weights are the engine's
half-precision copy, so the average is of those (its fp32 master weights are partitioned).
ZeRO-3 and FSDP2 are refused at validation (:func:`clipkit.config.recipe.ema_refusal`).

Resuming restores the average, its update count and applied-step count bit for bit;
``clipkit export --ema`` writes the averaged weights (:func:`ema_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from clipkit.config.settings_schema import EmaConfig
from clipkit.errors import ArtifactError, ClipkitError

#: The checkpoint's state.pt key the average is kept under.
STATE_KEY = "ema"


class WeightEMA:
    """The fp32 average of ``model``'s trainable parameters, keyed by their names in
    ``model.state_dict()`` (the names an export uses)."""

    def __init__(self, model: torch.nn.Module, config: EmaConfig) -> None:
        self.config = config
        # The model, not its parameters: moving it to another device may replace them (CPU -> meta
        # does; CPU -> CUDA sets .data), so each update reads them by name. DDP and ZeRO-1/2
        # update the module's own parameters in place.
        self.model = model
        self.average = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.applied_steps = 0  # optimiser steps applied so far (the t of the decay)
        self.updates = 0  # averages taken so far

    @property
    def num_bytes(self) -> int:
        """Memory the average holds (fp32, one copy of every trainable parameter)."""
        return sum(t.numel() * t.element_size() for t in self.average.values())

    def decay_at(self, applied_steps: int) -> float:
        """d_t for the update after applied optimiser step ``applied_steps`` (t >= 1)."""
        ramp = min(1.0, applied_steps / self.config.warmup) if self.config.warmup else 1.0
        return (self.config.decay * ramp) ** self.config.every

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count one applied optimiser step; average the live weights in on every ``every``-th."""
        self.applied_steps += 1
        if self.applied_steps % self.config.every:
            return
        decay = self.decay_at(self.applied_steps)
        for name, live in self.model.named_parameters():
            if name not in self.average:
                continue
            average = self.average[name]
            if average.device != live.device:
                # The EMA is built before runtime.prepare moves the model to its device (seen on
                # CUDA): the average follows its weight there once, at the first update.
                average = self.average[name] = average.to(live.device)
            # lerp: ema + (1 - d)·(w - ema) = d·ema + (1 - d)·w, one fused op per tensor
            average.lerp_(live.detach().float(), 1.0 - decay)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the average (CPU copies), the step and update counts."""
        return {
            "weights": {name: tensor.detach().cpu().clone() for name, tensor in self.average.items()},
            "applied_steps": self.applied_steps,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Any, where: str) -> None:
        """Restore :meth:`state_dict`'s output bit for bit; ``where`` names the file in errors."""
        weights = check_ema_state(state, where)
        missing = sorted(set(self.average) - set(weights))
        extra = sorted(set(weights) - set(self.average))
        if missing or extra:
            raise ArtifactError(
                f"{where}: its EMA weights do not fit the model (missing {missing[:3]}, unexpected "
                f"{extra[:3]}); resume with the recipe the run was trained with"
            )
        for name, tensor in weights.items():
            expected = tuple(self.average[name].shape)
            if tuple(tensor.shape) != expected or tensor.dtype != torch.float32:
                raise ArtifactError(
                    f"{where}: EMA weight {name} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                    f"{expected} float32; the checkpoint is damaged"
                )
            self.average[name].copy_(tensor)
        self.applied_steps, self.updates = int(state["applied_steps"]), int(state["updates"])

    def model_state(self, live_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``live_state`` (a full model state dict) with the averaged weights in place of the
        trainable parameters, each cast to the live tensor's dtype."""
        return ema_state_dict(live_state, {"weights": self.average}, "the in-memory EMA")


def check_ema_state(state: Any, where: str) -> dict[str, torch.Tensor]:
    """The ``weights`` of a checkpoint's EMA state, after checking its form."""
    if not isinstance(state, dict) or not isinstance(state.get("weights"), dict):
        raise ArtifactError(f"{where}: `{STATE_KEY}` is not an EMA state; the checkpoint is damaged")
    for key in ("applied_steps", "updates"):
        if not isinstance(state.get(key, 0), int):
            raise ArtifactError(f"{where}: `{STATE_KEY}.{key}` is not an integer; the checkpoint is damaged")
    weights = state["weights"]
    if not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ArtifactError(f"{where}: `{STATE_KEY}.weights` holds a non-tensor; the checkpoint is damaged")
    return weights


def ema_state_dict(
    live_state: dict[str, torch.Tensor], ema_state: Any, where: str
) -> dict[str, torch.Tensor]:
    """A model state dict whose trainable parameters are the EMA's (``clipkit export --ema``):
    every key of ``live_state`` kept, those the EMA averaged replaced (cast to the live dtype)."""
    weights = check_ema_state(ema_state, where)
    unknown = sorted(set(weights) - set(live_state))
    if unknown:
        raise ArtifactError(f"{where}: EMA weights {unknown[:3]} are not in the model; it is damaged")
    merged = dict(live_state)
    for name, tensor in weights.items():
        merged[name] = tensor.to(dtype=live_state[name].dtype, device=live_state[name].device)
    return merged


# ----------------------------------------------------------------------------- the trainer's side


def build_ema(model: torch.nn.Module, config: EmaConfig | None, *, announce: bool) -> WeightEMA | None:
    """The run's EMA (None without ``train.ema``), its memory cost said once."""
    if config is None:
        return None
    ema = WeightEMA(model, config)
    if announce:
        print(
            f"train.ema: averaging {len(ema.average)} trainable tensors in fp32 "
            f"({ema.num_bytes / 2**20:.1f} MiB on the training device), decay {config.decay:g}, "
            f"warm-up {config.warmup} steps, every {config.every}",
            flush=True,
        )
    return ema


def update_ema(ema: WeightEMA | None, applied: bool) -> None:
    """After a training step: average the weights in when the optimiser step was applied."""
    if ema is not None and applied:
        ema.after_optimizer_step()


def ema_checkpoint_state(ema: WeightEMA | None) -> dict[str, Any]:
    """The run's EMA for state.pt (nothing without one)."""
    return {STATE_KEY: ema.state_dict()} if ema is not None else {}


def restore_ema(ema: WeightEMA | None, state: dict[str, Any], where: str) -> None:
    """The checkpoint's EMA into the trainer's; a recipe with ``train.ema`` resuming a checkpoint
    without one is refused (the average would silently restart from the resumed weights)."""
    if ema is None:
        return
    if state.get(STATE_KEY) is None:
        raise ClipkitError(
            f"{where}: the checkpoint holds no EMA weights (its run had no train.ema), so the average "
            "cannot continue; resume without train.ema, or start a new run from an export (model.init)"
        )
    ema.load_state_dict(state[STATE_KEY], where)


def weights_to_evaluate(
    ema: WeightEMA | None, model: torch.nn.Module, rebuild: Callable[[], torch.nn.Module]
) -> Iterator[tuple[str, torch.nn.Module]]:
    """(metric prefix, model) pairs the in-training evaluation scores (main process): the live
    ``model`` as ``eval``, and with ``train.ema.eval`` ema/both a fresh copy holding the EMA
    weights as ``eval_ema`` (the live model is never touched)."""
    chosen = ema.config.eval if ema is not None else "live"
    if chosen in ("live", "both"):
        yield "eval", model
    if chosen in ("ema", "both"):
        averaged = rebuild().to(next(model.parameters()).device)
        averaged.load_state_dict(ema.model_state(model.state_dict()))
        yield "eval_ema", averaged
