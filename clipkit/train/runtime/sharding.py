"""What each strategy shards, for those outside the runtime that must know without seeing a strategy:
the memory estimate (:mod:`clipkit.train.memory_fit`) and ``clipkit validate``'s explanation. Pure:
no process group, no DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clipkit.config.recipe import DistributedConfig
from clipkit.train.runtime import wrapping


@dataclass(frozen=True)
class Shares:
    """The fraction of each per-parameter term one of ``world_size`` processes holds.

    weights, gradients, optimizer: 1 (replicated) or 1/W (sharded).
    buckets:      DDP's gradient buckets (a second copy of the gradients) exist.
    gathers:      full parameters of one unit are gathered around its forward/backward (FSDP2,
                  ZeRO-3), plus the next one prefetched.
    """

    weights: float
    gradients: float
    optimizer: float
    buckets: bool
    gathers: bool


def shares(config: DistributedConfig, world_size: int) -> Shares:
    world = max(1, int(world_size))
    part = 1.0 / world
    if config.strategy == "fsdp2":
        return Shares(part, part, part, buckets=False, gathers=True)
    if config.strategy == "deepspeed":
        stage = int(config.zero_stage)
        return Shares(
            part if stage >= 3 else 1.0,
            part if stage >= 2 else 1.0,
            part if stage >= 1 else 1.0,
            buckets=False,
            gathers=stage >= 3,
        )
    return Shares(1.0, 1.0, 1.0, buckets=world > 1, gathers=False)


def largest_unit_bytes(model: torch.nn.Module, bytes_per_parameter: int) -> int:
    """The parameters one FSDP2 unit gathers at most (a block, or a tower less its blocks), in
    the compute precision's bytes: the largest of :func:`wrapping.units`'s own parameters."""
    units = wrapping.units(model)
    inner: set[int] = set()
    largest = 0
    for unit in units:  # innermost first: a tower's own parameters are those its blocks leave
        own = [p for p in unit.parameters() if id(p) not in inner]
        largest = max(largest, sum(p.numel() for p in own))
        inner.update(id(p) for p in own)
    return largest * bytes_per_parameter


def explain(config: DistributedConfig, precision: str) -> str:
    """One line for ``clipkit validate``: what the recipe's strategy does and what it resumes."""
    if config.strategy == "fsdp2":
        dtype = {"bf16": "bf16 towers (fp32 gradient reduction and optimiser shards)", "no": "fp32"}
        return (
            "# train.distributed.strategy: fsdp2 — torch's fully_shard: each of W processes holds 1/W of "
            "the towers' weights, gradients and optimiser state, gathering one block at a time (an "
            "encoder's sharding_blocks(), else its nn.ModuleList members; the similarity stays "
            f"replicated); precision {dtype.get(precision, precision)}; checkpoints are "
            "torch.distributed.checkpoint shards, resumable under ddp or fsdp2"
        )
    if config.strategy == "deepspeed":
        what = {0: "nothing", 1: "the optimiser state", 2: "optimiser state and gradients"}
        sharded = what.get(int(config.zero_stage), "optimiser state, gradients and weights")
        return (
            f"# train.distributed.strategy: deepspeed — ZeRO-{config.zero_stage} shards {sharded} over "
            f"the processes; checkpoints are ZeRO partitions, resumable under deepspeed only"
        )
    return (
        "# train.distributed.strategy: ddp — every process holds the whole model, gradients and "
        "optimiser state (one process: plain training); checkpoints hold whole weights, resumable "
        "under ddp or fsdp2; strategy=fsdp2 or deepspeed shard them instead"
    )
