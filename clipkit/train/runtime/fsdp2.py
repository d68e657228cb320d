"""PyTorch's own sharding: FSDP2 (``torch.distributed.fsdp.fully_shard``, parameters as DTensors).

Each process holds 1/W of every sharded parameter, its gradient and its optimiser state; a unit's
full parameters are gathered around its forward and backward and freed after
(:mod:`~clipkit.train.runtime.wrapping` says which modules are units). Gradients are averaged
across processes by a reduce-scatter, as DDP's all-reduce averages them, so the same recipe takes
the same steps (tested to fp32 tolerance against DDP).

Precision (``train.precision``) is FSDP2's mixed-precision policy: the towers' parameters are cast
to bf16 for their forward and backward, gradients are reduced in fp32 and the optimiser steps the
fp32 shards. The similarity's parameters stay fp32 and unsharded, and the gathered features are
upcast, so similarities and losses compute in fp32 as under every strategy. fp16 is refused: it
needs loss scaling, and torch 2.13's GradScaler (and FSDP's ShardedGradScaler) cannot unscale
sharded DTensor gradients together with the replicated similarity's plain ones (measured: both
raise ``'Tensor' object has no attribute 'placements'``).

Accumulation: every micro-batch's backward reduce-scatters its gradient into the sharded
gradients (no ``no_sync``: keeping full unsharded gradients between micro-batches would give back
the memory FSDP2 saves); the sum is the same as DDP's single reduction.

Checkpoints: each process writes its shards with ``torch.distributed.checkpoint``
(:mod:`~clipkit.train.runtime.dcp_files`) into the checkpoint being committed, so they are as
atomic as every other file. A DDP checkpoint (full weights and optimiser in state.pt) resumes
here too: it is loaded into the plain model before sharding and its optimiser state sharded after.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from clipkit.config.recipe import FSDP2_FP16_REFUSAL
from clipkit.errors import ClipkitError
from clipkit.train.runtime import dcp_files, wrapping
from clipkit.train.runtime.strategy import HALF, StepResult

FP16_REFUSAL = FSDP2_FP16_REFUSAL


def ensure_process_group(device: torch.device) -> bool:
    """FSDP2 needs a process group even for one process (``clipkit train`` without a launcher):
    start a one-process group in memory then. Returns whether it started one (its owner destroys
    it; a launcher's group is Accelerate's)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


class FSDP2Strategy:
    """The strategy for FSDP2 (see :class:`clipkit.train.runtime.strategy.Strategy`)."""

    name = "fsdp2"
    exact_accumulation_refusal = None  # the similarity is replicated: the loss pass may use it anywhere
    parameter_clamp_refusal = None  # bounded parameters are clamped in place after each step
    # Compiled towers around fully_shard'ed blocks: TorchDynamo skips FSDP2's hooks (they run
    # eagerly between the compiled pieces), the scoring's similarity parameters are replicated.
    compile_refusal = None
    divides_by_accumulation_steps = False  # each backward adds its (averaged) gradient as it is
    scaler = None  # bf16 needs no loss scaling; fp16 is refused

    def __init__(self, device: torch.device, *, precision: str, grad_clip: float) -> None:
        if precision == "fp16":
            raise ClipkitError(FP16_REFUSAL)
        self.device, self.precision, self.grad_clip = device, precision, grad_clip
        self.optimizer = None  # set by prepare
        self.replicated: list[torch.nn.Parameter] = []
        self._full_optimizer_state: dict | None = None  # a DDP checkpoint's, until sharded
        self._own_group = False  # started the one-process group itself (ensure_process_group)

    # ------------------------------------------------------------------ wrapping

    def mixed_precision(self, *, cast_inputs: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision not in HALF:
            return MixedPrecisionPolicy()
        # The root does not cast its inputs: they are the batch and, under exact accumulation, the
        # fp32 feature gradient, which must stay fp32; the towers cast their own inputs (images).
        return MixedPrecisionPolicy(
            param_dtype=HALF[self.precision], reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs
        )

    def prepare(self, model, optimizer):
        """Shard the step module in place (blocks, towers, then the root), and point the optimiser
        at the sharded parameters (FSDP2 replaces every sharded parameter with a DTensor)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self._own_group = ensure_process_group(self.device) or self._own_group
        model.to(self.device)
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.replicated = wrapping.replicated_parameters(model)
        for unit in wrapping.units(model):
            fully_shard(unit, mesh=mesh, mp_policy=self.mixed_precision(cast_inputs=True))
        fully_shard(
            model,
            mesh=mesh,
            mp_policy=self.mixed_precision(cast_inputs=False),
            ignored_params=set(self.replicated),
        )
        sharded = dict(model.named_parameters())
        swap_parameters(optimizer, {old: sharded[name] for old, name in names.items()})
        self.optimizer = optimizer
        if self._full_optimizer_state is not None:
            load_full_optimizer_state(optimizer, self._full_optimizer_state)
            self._full_optimizer_state = None
        return model, optimizer

    def unwrap(self, model):
        return model  # fully_shard changes the module in place

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the mixed-precision policy casts the towers' parameters

    def full_precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # each tower casts its float inputs (cast_forward_inputs)

    def no_sync(self, model, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # reduce-scatter every micro-batch: gradients stay sharded

    def backward(self, loss: torch.Tensor, model, *, last: bool) -> None:
        """FSDP2 reduce-scatters the sharded gradients in the backward; the replicated ones are
        averaged after the step's last backward (DDP's all-reduce, for the similarity)."""
        loss.backward()
        if last:
            average_gradients(self.replicated)

    # ------------------------------------------------------------------ the step

    def step(self, model, optimizer) -> StepResult:
        """Measure (and clip) the global norm, step unless it is non-finite, zero the gradients."""
        norm = self._grad_norm(model)
        applied = math.isfinite(norm)
        if applied:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(applied, norm)

    def _grad_norm(self, model) -> float:
        """The norm of the whole gradient (every shard and the replicated part), the same on every
        process; clipped to ``grad_clip`` when set (as ``clip_grad_norm_`` does under DDP)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        sharded = [g for g in grads if is_dtensor(g)]
        plain = [g for g in grads if not is_dtensor(g)]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in sharded:
            squares += grad.to_local().double().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(squares)
        for grad in plain:  # identical on every process (averaged): counted once
            squares += grad.double().pow(2).sum()
        norm = float(squares.sqrt())
        if self.grad_clip > 0 and math.isfinite(norm):
            coefficient = self.grad_clip / (norm + 1e-6)
            if coefficient < 1:
                for grad in grads:
                    grad.mul_(coefficient)
        return norm

    def zero_grad(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ state

    def save(self, model, optimizer, checkpoint: Path) -> dict:
        """Every process writes its shards of model and optimiser (DCP) under the checkpoint;
        state.pt gets their plain part (param groups), no weights."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors, plain = dcp_files.split(model_state, optimizer_state)
        dcp_files.save(tensors, checkpoint)
        return {"model": None, "optimizer": None, "scaler": None, "sharded": plain}

    def load_before_wrapping(self, model, optimizer, state: dict, checkpoint: Path) -> None:
        """A DDP checkpoint's full weights into the plain model (sharded as they are by
        ``fully_shard``); its optimiser state waits to be sharded after wrapping. An FSDP2
        checkpoint loads after wrapping."""
        if state.get("model") is None:
            return
        from clipkit.train.runtime.ddp import load_full_state

        load_full_state(model, optimizer, state, checkpoint)
        self._full_optimizer_state = {
            id(p): dict(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]
        }
        optimizer.state.clear()

    def load_after_wrapping(self, model, checkpoint: Path, state: dict) -> None:
        """This process's shards of an FSDP2 checkpoint into the sharded model and optimiser."""
        if state.get("model") is not None:
            return  # a DDP checkpoint: loaded in load_before_wrapping and prepare
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, self.optimizer)  # the shapes to fill
        tensors, _ = dcp_files.split(model_state, optimizer_state)
        dcp_files.load_into(tensors, checkpoint)
        model_state, optimizer_state = dcp_files.join(tensors, state["sharded"])
        set_state_dict(model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    def full_state_dict(self, model, is_main: bool) -> dict[str, torch.Tensor] | None:
        """The whole model in fp32 on the main process (None elsewhere); every process must call."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if not is_main:
            return None
        return {key: value.detach().float().clone() for key, value in state.items()}

    def gathered(self, module) -> contextlib.AbstractContextManager:
        """Full parameters of ``module`` inside: the similarity's are never sharded; a sharded unit
        is gathered (every process enters)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            return contextlib.nullcontext()
        return _unsharded(module)

    def model_for_evaluation(self, model, plain, rebuild, device, is_main: bool):
        """A fresh fp32 model from ``rebuild()`` with the gathered weights; every process must call."""
        state = self.full_state_dict(model, is_main)
        if not is_main:
            return None
        fresh = rebuild()
        fresh.load_state_dict(state)
        return fresh.to(device)

    def clamp_parameters(self, bounds: tuple) -> None:
        """The optimiser steps the module's own parameters — the similarity's replicated ones alike
        on every process, a tower's shard by shard — so clamping them in place after the step keeps
        every copy in bounds (an element-wise clamp of a shard is the shard of the clamp)."""
        from clipkit.train.bounds import clamp_in_place

        clamp_in_place(bounds)

    def close(self) -> None:
        """Destroy the one-process group this strategy started (none under a launcher)."""
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False


@contextlib.contextmanager
def _unsharded(module):
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def swap_parameters(optimizer, replacement: dict[int, torch.nn.Parameter]) -> None:
    """Point ``optimizer``'s groups at the sharded parameters (``replacement``: id of the old
    parameter -> its DTensor successor); an optimiser built before sharding otherwise steps
    parameters the model no longer uses."""
    for group in optimizer.param_groups:
        group["params"] = [replacement.get(id(p), p) for p in group["params"]]
    if optimizer.state:
        raise ClipkitError("the optimiser has state before sharding; FSDP2 shards a fresh one")


def load_full_optimizer_state(optimizer, full: dict[int, dict]) -> None:
    """A DDP checkpoint's optimiser state (``full``: id of the old parameter -> its slots), whose
    tensors of a parameter's full shape are sharded like that parameter; ``full`` is in the
    optimiser's parameter order, which :func:`swap_parameters` kept."""
    from torch.distributed.tensor import distribute_tensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = defaultdict(dict)
    for parameter, slots in zip(parameters, full.values(), strict=True):
        converted = {}
        for slot, value in slots.items():
            if is_dtensor(parameter) and isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                value = distribute_tensor(
                    value.to(parameter.device), parameter.device_mesh, parameter.placements
                )
            converted[slot] = value
        if converted:
            state[parameter] = converted
    optimizer.state = state


def average_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Average the replicated parameters' gradients over processes (DDP's all-reduce), in one
    flat all-reduce."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or dist.get_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
