"""Loss and gradients of one contrastive step with ``loss.tiled`` on and off, for the exact gather
modes, with and without exact gradient accumulation.

Run as one process or under ``torchrun --nproc_per_node 2`` (each process encodes its half);
``tests/test_tiled_training.py`` compares tiled with full and two processes with one. Writes
``OUT/tiled-<world>.pt``: {case: {"loss", "grads"}} from process 0. Reuses the fixed batch and
recipe of ``equivalence.py`` (this directory).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from equivalence import BATCH, LOSSES, fixed_batch

from clipkit.model import build_model, build_slot
from clipkit.recipe import DistributedConfig, load_recipe
from clipkit.registry import default_registry
from clipkit.tiled.settings import Tiling
from clipkit.train.accumulate import accumulate_exactly
from clipkit.train.runtime import BatchPlan, Runtime, seed_everything
from clipkit.train.step import TrainingStep

TILE = 3  # does not divide the batch of 8 (nor a process's 4 rows)
CASES = [  # (loss, local_loss, micro-batch size: 0 = the process's whole share, tiled)
    (loss, local, micro, tiled)
    for loss, local, micro in [
        ("infonce", False, 0),
        ("infonce", True, 0),
        ("siglip", False, 0),
        ("siglip", True, 0),
        ("infonce", False, 2),
        ("siglip", True, 2),
    ]
    for tiled in (False, True)
]


def run_case(rt, model, training_step, step, registry, batch, case) -> dict:
    """``model``: the plain model; ``training_step``: its TrainingStep; ``step``: that as wrapped."""
    loss_name, local, micro, tiled = case
    rt.config = replace(rt.config, gather_with_grad=True, local_loss=local)
    rt.plan = BatchPlan.split(rt.plan.global_size, micro, rt.world_size)
    loss = build_slot(registry, "loss", LOSSES[loss_name], "loss", num_samples=BATCH, total_steps=10)
    trainer = SimpleNamespace(
        runtime=rt,
        model=model,
        step=step,
        loss=loss,
        stream=SimpleNamespace(epoch=1, batch_in_epoch=0, num_samples=BATCH),
        tiling=Tiling("true" if tiled else "false", TILE),
    )
    share = BATCH // rt.world_size
    rows = slice(rt.rank * share, (rt.rank + 1) * share)  # this process's rows of the global batch
    local_batch = {
        key: (value[rows] if isinstance(value, torch.Tensor) else value) for key, value in batch.items()
    }
    training_step.trainer = trainer
    model.zero_grad(set_to_none=True)
    if rt.plan.micro_batches > 1:
        out, _ = accumulate_exactly(trainer, local_batch, 0)
        value = out.loss.detach().clone()
    else:
        total, out = step(local_batch, 0)
        total.backward()
        value = total.detach().clone()
    if rt.world_size > 1:  # local losses differ per process; their mean is the full-batch loss
        dist.all_reduce(value)
        value /= rt.world_size
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(value), "grads": grads}


def main(out: Path) -> None:
    registry = default_registry()
    recipe = load_recipe("quickstart@smoke", [], registry=registry)
    rt = Runtime(seed=0, distributed=DistributedConfig(), global_batch_size=BATCH)
    seed_everything(0)
    model = build_model(recipe, registry)
    batch = fixed_batch(model.tokenizer, recipe["model"]["image_size"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    training_step = TrainingStep(model)
    step, _ = rt.prepare(training_step, optimizer)
    results = {case: run_case(rt, model, training_step, step, registry, batch, case) for case in CASES}
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(results, out / f"tiled-{rt.world_size}.pt")
    rt.wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
