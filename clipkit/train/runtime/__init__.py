"""The ONLY package that touches Accelerate, DeepSpeed, torch.distributed, autocast and loss scaling.

Plugins (encoders, similarities, losses) never see ranks, devices or dtypes, and the training loop
never asks which strategy runs: :class:`Runtime` starts the processes (Accelerate), splits the
contrastive batch once (:class:`BatchPlan`), gathers features into the global batch in fp32 with
the recipe's gather semantics (METHODS §11), and delegates everything that differs between plain/DDP
and DeepSpeed ZeRO runs to one :class:`~clipkit.train.runtime.strategy.Strategy`, which no caller
sees (``.strategy`` is read only inside this package; tests/test_architecture.py checks):

- :class:`~clipkit.train.runtime.ddp.DDPStrategy` (one process or DDP): ``torch.autocast`` for the
  towers, a ``GradScaler`` under fp16;
- :class:`~clipkit.train.runtime.zero.DeepSpeedStrategy` (ZeRO 1–3): DeepSpeed's own half precision
  and loss scaling, per-process checkpoint partitions.

Either way gathered features are upcast, so similarities and losses compute in fp32.

A caller asks the runtime for what it needs: :meth:`Runtime.prepare` (wrap model and optimiser,
loading a checkpoint's weights before wrapping or its ZeRO partitions after), :meth:`Runtime.backward`
(with the accumulation scaling contract), :meth:`Runtime.step` (which says whether an unapplied step
was a loss-scaling overflow or a bad gradient), :meth:`Runtime.save` (this process's part of a
checkpoint). DeepSpeed's checkpoint files are :mod:`clipkit.train.runtime.partitions`'.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clipkit.config.settings_schema import DistributedConfig
from clipkit.contract.types import PointSet
from clipkit.errors import ClipkitError
from clipkit.train.runtime import collectives
from clipkit.train.runtime.strategy import HALF, StepResult, Strategy

__all__ = [
    "HALF",
    "BatchPlan",
    "Runtime",
    "StepResult",
    "check_resumable",
    "launched_as_main",
    "rng_state",
    "set_rng_state",
]


@dataclass(frozen=True)
class BatchPlan:
    """The contrastive batch, split once for the whole run.

    global_size: the recipe's ``data.batch_size`` — the N the loss sees, over all processes.
    local_size:  samples each process loads and encodes per step (global_size / world_size).
    micro_size:  samples per forward on one process (``train.micro_batch_size``; local_size if unset).
    """

    global_size: int
    world_size: int
    local_size: int
    micro_size: int

    @property
    def micro_batches(self) -> int:
        """Forwards per optimiser step on one process."""
        return self.local_size // self.micro_size if self.micro_size else 1

    @classmethod
    def split(cls, global_size: int | None, micro_size: int, world_size: int) -> BatchPlan:
        if global_size is None:
            return cls(0, world_size, 0, 0)
        if global_size % world_size:
            raise ClipkitError(
                f"data.batch_size {global_size} (the contrastive batch, over all processes) does not "
                f"divide among {world_size} processes; pick a multiple of {world_size}"
            )
        local = global_size // world_size
        micro = micro_size or local
        if local % micro:
            raise ClipkitError(
                f"train.micro_batch_size {micro} does not divide the {local} samples each of the "
                f"{world_size} process(es) encodes per step (data.batch_size {global_size})"
            )
        return cls(global_size, world_size, local, micro)


class Runtime:
    """Processes, device, batch plan and gathers; the strategy does the rest.

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
        self.precision, self.seed = precision, seed
        check_launcher_agrees(self.config)
        launched_world = int(os.environ.get("WORLD_SIZE", "1"))
        self.plan = BatchPlan.split(global_batch_size, micro_batch_size, launched_world)
        cpu = not torch.cuda.is_available()
        handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu and launched_world > 1 else []
        # Accelerate starts the processes' group and picks the device; it never wraps the loader.
        self.accelerator = Accelerator(cpu=cpu, mixed_precision="no", kwargs_handlers=handlers)
        if self.world_size != launched_world:
            raise ClipkitError(
                f"WORLD_SIZE says {launched_world} processes but Accelerate started {self.world_size}"
            )
        self.grad_clip = grad_clip
        self._strategy: Strategy = self._make_strategy(grad_clip)
        seed_everything(seed)

    def refit_batch(self, global_size: int) -> None:
        """Use ``global_size`` as the contrastive batch from now on (``data.fit_batch``); before
        ``prepare`` only, since DeepSpeed's configuration carries the batch split."""
        split_micro = self.plan.micro_size if self.plan.micro_size != self.plan.local_size else 0
        self.plan = BatchPlan.split(global_size, split_micro, self.world_size)
        self._strategy = self._make_strategy(self.grad_clip)

    def _make_strategy(self, grad_clip: float) -> Strategy:
        if self.config.strategy == "fsdp2":
            from clipkit.train.runtime.fsdp2 import FSDP2Strategy

            return FSDP2Strategy(self.device, precision=self.precision, grad_clip=grad_clip)
        if self.config.strategy != "deepspeed":
            from clipkit.train.runtime.ddp import DDPStrategy

            return DDPStrategy(self.accelerator, precision=self.precision, grad_clip=grad_clip)
        from clipkit.train.runtime.deepspeed_config import deepspeed_config
        from clipkit.train.runtime.zero import DeepSpeedStrategy

        config = deepspeed_config(
            zero_stage=self.config.zero_stage,
            precision=self.precision,
            micro_batch_size=self.plan.micro_size,
            micro_batches=self.plan.micro_batches,
            world_size=self.world_size,
            grad_clip=grad_clip,
            offload_optimizer=self.config.offload_optimizer,
            offload_params=self.config.offload_params,
        )
        return DeepSpeedStrategy(precision=self.precision, zero_stage=self.config.zero_stage, config=config)

    # ------------------------------------------------------------------ who and where

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

    @property
    def local_loss(self) -> bool:
        """Each process scores its own anchors against all candidates (only with several processes)."""
        return self.config.local_loss and self.world_size > 1

    @property
    def tiling_refusal(self) -> str | None:
        """Why this run's strategy cannot compute the loss tile by tile (``train.tiled``), or None."""
        from dataclasses import asdict

        from clipkit.tiled.settings import strategy_refusal

        return strategy_refusal(asdict(self.config))

    @property
    def partitions_weights(self) -> bool:
        """ZeRO-3 or FSDP2: the module's weights are partitioned over the processes and gathered by
        hooks around the wrapped step's forward, so a forward of a tower alone would wait forever
        (ZeRO-3) or break FSDP2's initialisation, which must start at the root module."""
        sharded = self.config.strategy == "fsdp2"
        return sharded or (self.config.strategy == "deepspeed" and self.config.zero_stage == 3)

    @property
    def exact_accumulation_refusal(self) -> str | None:
        """Why exact gradient accumulation cannot run with this strategy (ZeRO-3), or None."""
        return self._strategy.exact_accumulation_refusal

    @property
    def compile_refusal(self) -> str | None:
        """Why ``train.compile`` cannot run with this strategy (ZeRO-3), or None."""
        return self._strategy.compile_refusal

    # ------------------------------------------------------------------ wrapping and resuming

    def prepare(self, model, optimizer, *, checkpoint: Path | None = None, state: dict | None = None):
        """Wrap model and optimiser (DDP, or a DeepSpeed engine); never the data loader.

        With ``checkpoint`` (its directory) and ``state`` (its verified state.pt), what the runtime
        owns of a run is resumed here, each in the only order that works: state.pt's model and
        optimiser before wrapping (DDP then broadcasts what every process loaded alike), the ZeRO
        partitions after (only an engine can read them), and the fp16 loss scale. The rest of a
        resume (schedule, loss state, data position, RNGs) is
        :func:`clipkit.train.checkpoint.restore_trainer`'s.
        """
        if checkpoint is not None:
            check_resumable(self.config.strategy, checkpoint, state)
            self._strategy.load_before_wrapping(model, optimizer, state, checkpoint)
        prepared_model, prepared_optimizer = self._strategy.prepare(model, optimizer)
        if checkpoint is not None:
            self._strategy.load_after_wrapping(prepared_model, checkpoint, state)
        return prepared_model, prepared_optimizer

    def save(self, model, optimizer, checkpoint: Path) -> dict:
        """This process's part of a checkpoint being written in directory ``checkpoint``; every
        process calls. DeepSpeed writes each process's ZeRO partition there; the returned dict is
        what the main process puts into state.pt (``model``, ``optimizer``, ``scaler``: the weights
        and the loss scale without DeepSpeed, None with it)."""
        return {**self._strategy.save(model, optimizer, checkpoint), "strategy": self.config.strategy}

    # ------------------------------------------------------------------ one step

    def autocast(self):
        """Reduced precision for the towers."""
        return self._strategy.autocast()

    def full_precision(self):
        """Leave the towers' autocast: similarities and losses always compute in fp32."""
        return self._strategy.full_precision()

    def no_sync(self, model, last: bool):
        """Skip the gradient all-reduce on every micro-batch but the last."""
        return self._strategy.no_sync(model, last)

    def backward(self, loss: torch.Tensor, model, *, last: bool = True) -> None:
        """Accumulate the gradients of ``loss``; ``last`` marks the step's last micro-batch.

        The accumulation scaling contract, in one place: the caller's ``loss`` already carries the
        full-batch scale (exact accumulation back-propagates each micro-batch's *share* of the
        full-batch gradient, :mod:`clipkit.train.accumulate`), so the gradients the micro-batches
        add up to are the full batch's and must reach the optimiser unscaled. DeepSpeed divides each
        micro-batch's gradient by the accumulation steps whatever its ``scale_wrt_gas`` says, so the
        loss is multiplied back by the micro-batch count before it sees it; DDP adds them as they are.
        """
        if self._strategy.divides_by_accumulation_steps:
            loss = loss * self.plan.micro_batches
        self._strategy.backward(loss, model, last=last)

    def step(self, model, optimizer) -> StepResult:
        """Clip (``grad_clip`` > 0), step, zero the gradients. An unapplied step either overflowed
        under loss scaling (``overflowed``: expected, the scale was lowered) or had a non-finite
        gradient (``bad_gradient``)."""
        return self._strategy.step(model, optimizer)

    def zero_grad(self, model, optimizer) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        self._strategy.zero_grad(model, optimizer)

    def clamp_parameters(self, bounds: tuple) -> None:
        """Clamp the bounded parameters (:mod:`clipkit.train.bounds`) in place after an applied
        step, where their authoritative copy lives; a no-op where :attr:`parameter_clamp_refusal`."""
        if bounds and self.parameter_clamp_refusal is None:
            self._strategy.clamp_parameters(bounds)

    @property
    def parameter_clamp_refusal(self) -> str | None:
        """Why this strategy cannot clamp parameters in place after a step, or None."""
        return self._strategy.parameter_clamp_refusal

    # ------------------------------------------------------------------ full weights

    def gathered(self, module):
        """Full parameters of ``module`` readable inside (ZeRO-3 partitions them); every process enters."""
        return self._strategy.gathered(module)

    def model_for_evaluation(self, model, plain, rebuild):
        """The fp32 model to evaluate on the main process (None elsewhere); every process must call.
        ``model`` is the prepared one, ``plain`` the model inside it, ``rebuild()`` a fresh one (the
        weights of a DeepSpeed engine may be partitioned or in half precision)."""
        return self._strategy.model_for_evaluation(model, plain, rebuild, self.device, self.is_main)

    # ------------------------------------------------------------------ data and gathers

    def to_device(self, batch: Any) -> Any:
        """Move a batch to the device (in the strategy's input dtype)."""
        if isinstance(batch, torch.Tensor):
            return self._strategy.cast_input(batch.to(self.device, non_blocking=True))
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch

    def gather(self, points: PointSet, dtype: torch.dtype = torch.float32) -> PointSet:
        """This process's point sets -> the global batch [W·n, M, d] in ``dtype`` (fp32 unless
        ``train.similarity_precision: half``), per the recipe's ``gather_with_grad`` (one process:
        a dtype cast)."""
        gather = (
            collectives.gather_with_grad if self.config.gather_with_grad else collectives.gather_without_grad
        )
        points = points.cast(dtype)
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

    def rank_generator(self, step: int) -> torch.Generator:
        """A CPU generator seeded by (seed, step, rank): different on every rank (e.g. augmentation
        crops), reproducible on resume."""
        generator = torch.Generator()
        generator.manual_seed((self.seed * 1_000_003 + step) * 1_009 + self.rank)
        return generator

    def all_true(self, flag: bool) -> bool:
        """``flag`` on every process (e.g. "my loss is finite"), so all take the same branch."""
        return collectives.all_true(flag, self.device)

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """End this process's part of a launch once training is over: wait for every process, then
        destroy the process group, so no process exits while its collectives' threads still run (a
        rank was seen aborting at exit with "terminate called without an active exception"). What
        follows training (export, evaluation) is local to the main process."""
        self._strategy.close()  # FSDP2's own one-process group, if it started one
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.accelerator.wait_for_everyone()
            # Let gloo's worker threads finish releasing their last collectives before anything can
            # destroy the group: a group destroyed (with the GIL held) while one of its threads still
            # frees a finished all-reduce's tensors (which needs the GIL) deadlocks the process at
            # exit (seen once at the end of a two-process DDP run: the thread waits for the GIL, the
            # main thread joins it). The sleep releases the GIL; the barrier alone does not cover the
            # group's second worker thread.
            time.sleep(0.2)
            torch.distributed.destroy_process_group()


#: What each strategy resumes from: the form a checkpoint's model and optimiser were saved in.
RESUMES_FROM = {"ddp": ("ddp", "fsdp2"), "fsdp2": ("ddp", "fsdp2"), "deepspeed": ("deepspeed",)}


def checkpoint_form(checkpoint: Path, state: dict) -> str:
    """How a checkpoint holds its model and optimiser: "deepspeed" (ZeRO partitions), "fsdp2"
    (DCP shards) or "ddp" (whole, in state.pt)."""
    from clipkit.train.runtime import dcp_files, partitions

    if partitions.directory(checkpoint).is_dir():
        return "deepspeed"
    if dcp_files.directory(checkpoint).is_dir():
        return "fsdp2"
    return "ddp"


def check_resumable(strategy: str, checkpoint: Path, state: dict) -> None:
    """Refuse, before anything loads, a checkpoint this strategy cannot resume: DDP and FSDP2
    resume each other's (whole weights and optimiser in state.pt, or DCP shards gathered or
    resharded); DeepSpeed's ZeRO partitions hold its optimiser in DeepSpeed's own flat layout, so a
    DeepSpeed run resumes only under DeepSpeed, and DeepSpeed resumes nothing else."""
    form = checkpoint_form(checkpoint, state)
    if form in RESUMES_FROM[strategy]:
        return
    saved_as = {"deepspeed": "DeepSpeed ZeRO partitions", "fsdp2": "FSDP2 shards", "ddp": "whole weights"}[
        form
    ]
    raise ClipkitError(
        f"{checkpoint}: written by a train.distributed.strategy={form} run ({saved_as}), which "
        f"strategy={strategy} cannot resume (DeepSpeed keeps its optimiser state in its own partition "
        f"layout); resume with train.distributed.strategy={form}, or `clipkit export` the run and start a "
        f"new one from the export (model.init)"
    )


def launched_as_main() -> bool:
    """Whether this is process 0 of a launch (``RANK`` set by ``accelerate launch``/``torchrun``),
    known before any process group exists; True without a launcher."""
    return os.environ.get("RANK", "0") == "0"


def split_batch(global_batch_size: int | None, micro_batch_size: int, world_size: int) -> tuple[int, int]:
    """(samples per process per step, samples per forward): :meth:`BatchPlan.split`'s two numbers."""
    plan = BatchPlan.split(global_batch_size, micro_batch_size, world_size)
    return plan.local_size, plan.micro_size


def check_launcher_agrees(config: DistributedConfig) -> None:
    """The recipe decides DeepSpeed and its ZeRO stage, and FSDP2. A launcher's ``--use_deepspeed``
    or ``--use_fsdp`` is accepted when the recipe agrees (and then left to clipkit), refused when it
    contradicts the recipe."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        if config.strategy != "fsdp2":
            raise ClipkitError(
                "the launcher asked for FSDP (--use_fsdp or an FSDP accelerate config) but the recipe's "
                f"train.distributed.strategy is '{config.strategy}'; set train.distributed.strategy=fsdp2: "
                "clipkit shards the model itself, per block, from the recipe"
            )
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # clipkit shards, not Accelerate's FSDP plugin
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    if config.strategy != "deepspeed":
        raise ClipkitError(
            "the launcher asked for DeepSpeed (--use_deepspeed or a DeepSpeed accelerate config) but the "
            f"recipe's train.distributed.strategy is '{config.strategy}'; set "
            "train.distributed.strategy=deepspeed (and train.distributed.zero_stage=N): clipkit derives "
            "the DeepSpeed config from the recipe"
        )
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and int(stage) != config.zero_stage:
        raise ClipkitError(
            f"the launcher asked for ZeRO stage {stage} but the recipe's train.distributed.zero_stage is "
            f"{config.zero_stage}; drop --zero_stage (the recipe decides) or set the recipe's"
        )
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"  # clipkit builds the engine, not Accelerate


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
