"""The ONLY module that touches Accelerate, DeepSpeed, torch.distributed, autocast and loss scaling.

Plugins (encoders, similarities, losses) never see ranks, devices or dtypes: the loop asks the
runtime to run the towers in the recipe's precision, to gather features into the global batch in
fp32 (with the recipe's gather semantics, METHODS §11), to back-propagate and to step. The same
code runs as one process (``clipkit train``), several DDP processes or DeepSpeed ZeRO 1–3
(``accelerate launch -m clipkit train``).

Precision. Without DeepSpeed the towers run under ``torch.autocast`` (bf16 or fp16) and fp16 adds
a ``torch.amp.GradScaler`` (dynamic loss scaling; a step whose gradients overflow is skipped and
the scale lowered). With DeepSpeed, bf16/fp16 are DeepSpeed's own (half-precision parameters,
fp32 master weights, dynamic loss scaling for fp16). Either way gathered features are upcast, so
similarities and losses compute in fp32.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clipkit.errors import ClipkitError
from clipkit.recipe import DistributedConfig
from clipkit.train import collectives
from clipkit.types import PointSet

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step did: ``applied`` False when loss scaling skipped it."""

    applied: bool
    grad_norm: float | None


class Runtime:
    """Thin wrapper around an ``accelerate.Accelerator`` (and, under DeepSpeed, its engine).

    precision:         "no" (fp32), "bf16" or "fp16" — the towers only.
    distributed:       the recipe's ``train.distributed`` (strategy, ZeRO stage, gather semantics).
    global_batch_size: the recipe's ``data.batch_size`` (the contrastive batch, over all processes).
    micro_batch_size:  samples per forward on one process (0: its whole share at once).
    """

    def __init__(
        self,
        precision: str = "no",
        seed: int = 0,
        distributed: DistributedConfig | None = None,
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int = 0,
        grad_clip: float = 0.0,
    ) -> None:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        self.config = distributed or DistributedConfig()
        self.precision, self.seed, self.grad_clip = precision, seed, grad_clip
        check_launcher_agrees(self.config)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_batch_size, self.micro_batch_size = split_batch(
            global_batch_size, micro_batch_size, world_size
        )
        cpu = not torch.cuda.is_available()
        handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu and world_size > 1 else []
        # Accelerate starts the processes' group and picks the device; DeepSpeed's engine is built in
        # prepare() from the recipe's config (Accelerate's own DeepSpeed glue needs transformers).
        self.accelerator = Accelerator(cpu=cpu, mixed_precision="no", kwargs_handlers=handlers)
        self.deepspeed_config = self._deepspeed_config(world_size) if self.uses_deepspeed else None
        if self.world_size != world_size:
            raise ClipkitError(
                f"WORLD_SIZE says {world_size} processes but Accelerate started {self.world_size}"
            )
        self.scaler = self._grad_scaler()
        self._unwrapped: dict[int, tuple[Any, Any]] = {}
        seed_everything(seed)

    # ------------------------------------------------------------------ set-up

    @property
    def uses_deepspeed(self) -> bool:
        return self.config.strategy == "deepspeed"

    @property
    def micro_batches(self) -> int:
        """Forwards per optimiser step on this process (1 without a batch size)."""
        return self.local_batch_size // self.micro_batch_size if self.micro_batch_size else 1

    def _deepspeed_config(self, world_size: int) -> dict:
        from clipkit.train.deepspeed_config import deepspeed_config

        return deepspeed_config(
            zero_stage=self.config.zero_stage,
            precision=self.precision,
            micro_batch_size=self.micro_batch_size,
            micro_batches=self.micro_batches,
            world_size=world_size,
            grad_clip=self.grad_clip,
            offload_optimizer=self.config.offload_optimizer,
            offload_params=self.config.offload_params,
        )

    def _grad_scaler(self):
        if self.precision != "fp16" or self.uses_deepspeed:
            return None
        return torch.amp.GradScaler(self.device.type)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    def prepare(self, model, optimizer):
        """Wrap model and optimiser (DDP, or a DeepSpeed engine); never the data loader."""
        if not self.uses_deepspeed:
            return self.accelerator.prepare(model, optimizer)
        try:
            import deepspeed
        except ImportError as error:
            raise ClipkitError(
                "train.distributed.strategy=deepspeed needs DeepSpeed: pip install 'clipkit[deepspeed]'"
            ) from error
        # DeepSpeed calls collectives torch 2.13 deprecated; one warning per call floods the log.
        warnings.filterwarnings(
            "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        engine, engine_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.deepspeed_config, dist_init_required=False
        )
        return engine, engine_optimizer

    def unwrap(self, model):
        """The plain ContrastiveModel inside DDP / a DeepSpeed engine (cached: Accelerate's unwrap
        reads package metadata on every call, ~1.5 ms a step)."""
        cached = self._unwrapped.get(id(model))
        if cached is None or cached[0] is not model:
            if self.uses_deepspeed:
                plain = getattr(model, "module", model)
            else:
                plain = self.accelerator.unwrap_model(model)
            cached = self._unwrapped[id(model)] = (model, plain)
        return cached[1]

    # ------------------------------------------------------------------ forward

    def autocast(self) -> contextlib.AbstractContextManager:
        """Reduced precision for the towers (DeepSpeed casts the parameters instead)."""
        if self.precision == "no" or self.uses_deepspeed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=HALF[self.precision])

    def full_precision(self) -> contextlib.AbstractContextManager:
        """Leave the towers' autocast: similarities and losses always compute in fp32."""
        if self.precision == "no" or self.uses_deepspeed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def to_device(self, batch: Any) -> Any:
        """Move a batch to the device; under DeepSpeed half precision, float inputs become half too."""
        if isinstance(batch, torch.Tensor):
            batch = batch.to(self.device, non_blocking=True)
            if self.uses_deepspeed and self.precision in HALF and batch.is_floating_point():
                batch = batch.to(HALF[self.precision])
            return batch
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch

    def gather(self, points: PointSet) -> PointSet:
        """This process's point sets -> the global batch [W·n, M, d] in fp32, per the recipe's
        ``gather_with_grad`` (one process: a dtype cast)."""
        gather = (
            collectives.gather_with_grad if self.config.gather_with_grad else collectives.gather_without_grad
        )
        points = points.float()
        return PointSet(
            gather(points.points),
            None if points.weights is None else gather(points.weights),
            None if points.mask is None else self.gather_rows(points.mask),
            points.weight_normalization,
        )

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per-sample values without gradient (global indices, meta-data tensors) -> [W·n, ...]."""
        return collectives.gather_with_grad(tensor.detach())

    def gather_list(self, values: list) -> list:
        return collectives.gather_objects(values)

    def local_rows(self, local_size: int) -> slice:
        """This process's rows of the global batch."""
        return slice(self.rank * local_size, (self.rank + 1) * local_size)

    def targets(self, anchors: int, offset: int = 0) -> torch.Tensor:
        """[anchors] column of each anchor's positive: the diagonal, shifted by ``offset`` for
        a local loss (this process's anchors against the global candidates)."""
        return torch.arange(offset, offset + anchors, device=self.device)

    def generator(self, step: int) -> torch.Generator:
        """A generator seeded by (seed, step): identical randomness on every rank (e.g. WPSE's
        fresh random features), reproducible on resume."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 1_000_003 + step)
        return generator

    def all_true(self, flag: bool) -> bool:
        """``flag`` on every process (e.g. "my loss is finite"), so all take the same branch."""
        return collectives.all_true(flag, self.device)

    # ------------------------------------------------------------------ backward and step

    def no_sync(self, model, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on every micro-batch but the last."""
        if last or self.uses_deepspeed or self.world_size == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, model, *, last: bool = True) -> None:
        """Accumulate gradients of ``loss``; the caller's micro-batch surrogates already carry the
        full-batch scale. DeepSpeed reduces at ``last`` and divides every micro-batch's gradient by
        the accumulation steps (its hooks on the engine's outputs do so whatever ``scale_wrt_gas``
        says), so the loss is multiplied back first."""
        if self.uses_deepspeed:
            model.set_gradient_accumulation_boundary(last)
            model.backward(loss * self.micro_batches)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, model, optimizer) -> StepResult:
        """Clip (``grad_clip`` > 0), step, zero the gradients. Under fp16 loss scaling a step whose
        gradients overflowed is skipped (``applied`` False) and the scale lowered."""
        if self.uses_deepspeed:
            skipped_before = model.skipped_steps
            model.step()
            norm = model.get_global_grad_norm()
            return StepResult(model.skipped_steps == skipped_before, _float_or_none(norm))
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        # The norm is measured every step (max_norm inf = measure only): a NaN/inf gradient must not
        # reach the weights unnoticed. DDP has already averaged the gradients, so all processes agree.
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
        return StepResult(applied, norm)

    def _grad_norm(self, model) -> float:
        """The global gradient norm, clipping to ``grad_clip`` when it is set."""
        if self.grad_clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def zero_grad(self, model, optimizer) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        if self.uses_deepspeed:
            model.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ state

    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        """The full fp32 weights on the main process (None elsewhere). Every process must call:
        under ZeRO-3 the shards are gathered."""
        if self.uses_deepspeed and self.config.zero_stage == 3:
            import deepspeed

            params = list(model.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                state = {k: v.detach().float().cpu().clone() for k, v in model.module.state_dict().items()}
            return state if self.is_main else None
        if not self.is_main:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in self.unwrap(model).state_dict().items()}

    def gathered(self, module) -> contextlib.AbstractContextManager:
        """Full parameters of ``module`` readable inside (ZeRO-3 partitions them); every process
        must enter it."""
        if self.uses_deepspeed and self.config.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def save_sharded(self, model, directory: Path) -> None:
        """DeepSpeed: every process writes its ZeRO partition (model + optimiser) under ``directory``."""
        model.save_checkpoint(str(directory), tag="zero", save_latest=False)

    def load_sharded(self, model, directory: Path) -> None:
        path, _ = model.load_checkpoint(
            str(directory), tag="zero", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ClipkitError(f"{directory}: no DeepSpeed checkpoint (tag 'zero') to resume from")

    def scaler_state(self) -> dict | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_scaler_state(self, state: dict | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()


def launched_as_main() -> bool:
    """Whether this is process 0 of a launch (``RANK`` set by ``accelerate launch``/``torchrun``),
    known before any process group exists; True without a launcher."""
    return os.environ.get("RANK", "0") == "0"


def split_batch(global_batch_size: int | None, micro_batch_size: int, world_size: int) -> tuple[int, int]:
    """(samples per process per step, samples per forward) from the recipe's contrastive batch."""
    if global_batch_size is None:
        return 0, 0
    if global_batch_size % world_size:
        raise ClipkitError(
            f"data.batch_size {global_batch_size} (the contrastive batch, over all processes) does not "
            f"divide among {world_size} processes; pick a multiple of {world_size}"
        )
    local = global_batch_size // world_size
    micro = micro_batch_size or local
    if local % micro:
        raise ClipkitError(
            f"train.micro_batch_size {micro} does not divide the {local} samples each of the "
            f"{world_size} process(es) encodes per step (data.batch_size {global_batch_size})"
        )
    return local, micro


def check_launcher_agrees(config: DistributedConfig) -> None:
    """The recipe decides DeepSpeed and its ZeRO stage. A launcher's ``--use_deepspeed`` is accepted
    when the recipe agrees (and then left to clipkit), refused when it contradicts the recipe."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    if config.strategy != "deepspeed":
        raise ClipkitError(
            "the launcher asked for DeepSpeed (--use_deepspeed or a DeepSpeed accelerate config) but the "
            "recipe's train.distributed.strategy is 'ddp'; set train.distributed.strategy=deepspeed "
            "(and train.distributed.zero_stage=N): clipkit derives the DeepSpeed config from the recipe"
        )
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and int(stage) != config.zero_stage:
        raise ClipkitError(
            f"the launcher asked for ZeRO stage {stage} but the recipe's train.distributed.zero_stage is "
            f"{config.zero_stage}; drop --zero_stage (the recipe decides) or set the recipe's"
        )
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"  # clipkit builds the engine, not Accelerate


def _float_or_none(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


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
