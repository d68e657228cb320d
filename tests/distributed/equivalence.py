"""Loss, gradients and per-sample state of one contrastive step, for every gather mode.

Run as one process (the reference: the whole batch) or under ``torchrun --nproc_per_node 2``
(each process encodes its half), with DDP or, given a second argument ``fsdp2``, FSDP2;
``tests/test_distributed.py`` compares them. Writes ``OUT/result-<world>[-fsdp2].pt``:
{case: {"loss", "grads", "state"}} from process 0, where "state" holds every process's per-sample
loss buffers and "grads" the whole gradients (FSDP2's shards gathered).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from clipkit.config.recipe import DistributedConfig, load_recipe
from clipkit.contract.registry import default_registry
from clipkit.model import build_model, build_slot
from clipkit.tiled.settings import Tiling
from clipkit.train.accumulate import accumulate_exactly
from clipkit.train.objective import Objective, tiling_decision
from clipkit.train.runtime import BatchPlan, Runtime, seed_everything
from clipkit.train.step import TrainingStep

BATCH = 8
CASES = [  # (loss, gather_with_grad, local_loss, micro-batch size: 0 = the process's whole share)
    ("infonce", True, False, 0),
    ("infonce", True, True, 0),
    ("infonce", False, False, 0),
    ("infonce", False, True, 0),
    ("siglip", True, False, 0),
    ("siglip", True, True, 0),
    ("nuclr", True, False, 0),
    ("infonce", True, False, 2),  # exact gradient accumulation
    ("siglip", True, True, 2),
]
LOSSES = {
    "infonce": {"name": "infonce"},
    "siglip": {"name": "siglip"},
    "nuclr": {
        "name": "nuclr",
        "tau": 0.07,
        "freeze_epochs": 0.0,
        "zeta_lr": 0.01,
        "zeta_lr_schedule": "constant",
    },
}


def fixed_batch(tokenizer, image_size: int) -> dict:
    """The same global batch on every process (seeded), so each can take its rows."""
    generator = torch.Generator().manual_seed(1234)
    words = ["red", "green", "blue", "circle", "square", "big", "small", "star"]
    captions = [" ".join(words[(i * 3 + j) % len(words)] for j in range(3)) for i in range(BATCH)]
    return {
        "image": torch.randn(BATCH, 3, image_size, image_size, generator=generator),
        "text": tokenizer(captions),
        "index": torch.arange(BATCH),
        "meta": {},
    }


def run_case(rt, model, training_step, step, registry, batch, case, tiling=None) -> dict:
    """``model``: the plain model; ``training_step``: its TrainingStep; ``step``: that as wrapped;
    ``tiling``: a clipkit.tiled.settings.Tiling (None: the full N×N path)."""
    loss_name, with_grad, local, micro = case
    rt.config = replace(rt.config, gather_with_grad=with_grad, local_loss=local)
    rt.plan = BatchPlan.split(rt.plan.global_size, micro, rt.world_size)
    loss = build_slot(registry, "loss", LOSSES[loss_name], "loss", num_samples=BATCH, total_steps=10)
    if isinstance(loss, torch.nn.Module):
        loss.to(rt.device)
    decided = tiling_decision(loss, model.similarity, rt, tiling or Tiling("false"))
    objective = Objective(loss, model.similarity, rt, decided.tile_size)
    epoch = 1.0  # the stream's position: epoch 1, its first batch
    share = BATCH // rt.world_size
    rows = slice(rt.rank * share, (rt.rank + 1) * share)  # this process's rows of the global batch
    local = {key: (value[rows] if isinstance(value, torch.Tensor) else value) for key, value in batch.items()}
    training_step.__dict__["objective"] = objective  # the case's loss (the step keeps it unregistered)
    model.zero_grad(set_to_none=True)
    if rt.plan.micro_batches > 1:
        out, _ = accumulate_exactly(step, objective, local, 0, epoch, lambda out: True)
        value = out.loss.detach().clone()
    else:
        total, out = step(local, 0, epoch)
        rt.backward(total, step)
        value = total.detach().clone()
    if rt.world_size > 1:  # local losses differ per process; their mean is the full-batch loss
        dist.all_reduce(value)
        value /= rt.world_size
    named = model.named_parameters()
    grads = {name: whole(p.grad).detach().clone() for name, p in named if p.grad is not None}
    stateful = isinstance(loss, torch.nn.Module)
    states = [{k: v.clone() for k, v in loss.state_dict().items()} if stateful else {}]
    if rt.world_size > 1:
        gathered = [None] * rt.world_size
        dist.all_gather_object(gathered, states[0])
        states = gathered
    return {"loss": float(value), "grads": grads, "state": states}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient in full: FSDP2's are sharded DTensors (gathering is a collective: every process)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def setup(strategy: str = "ddp"):
    """(runtime, plain model, its TrainingStep, that as prepared, registry, the fixed global batch)."""
    registry = default_registry()
    recipe = load_recipe("quickstart@smoke", [], registry=registry)
    rt = Runtime(seed=0, distributed=DistributedConfig(strategy=strategy), global_batch_size=BATCH)
    seed_everything(0)
    model = build_model(recipe, registry)
    batch = fixed_batch(model.tokenizer, recipe["model"]["image_size"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    placeholder = build_slot(registry, "loss", LOSSES["infonce"], "loss", num_samples=BATCH, total_steps=10)
    training_step = TrainingStep(model, Objective(placeholder, model.similarity, rt))  # run_case sets its own
    step, _ = rt.prepare(training_step, optimizer)
    return rt, model, training_step, step, registry, batch


def main(out: Path, strategy: str = "ddp") -> None:
    rt, *rest = setup(strategy)
    results = {case: run_case(rt, *rest, case) for case in CASES}
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if strategy == "ddp" else f"-{strategy}"
        torch.save(results, out / f"result-{rt.world_size}{suffix}.pt")
    rt.wait()
    rt.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
