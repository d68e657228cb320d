"""Loss and gradients of one contrastive step with ``train.tiled`` on and off, for the exact gather
modes, with and without exact gradient accumulation.

Run as one process or under ``torchrun --nproc_per_node 2`` (each process encodes its half);
``tests/test_tiled_training.py`` compares tiled with full and two processes with one. Writes
``OUT/tiled-<world>.pt``: {case: {"loss", "grads"}} from process 0. Reuses the fixed batch and
recipe of ``equivalence.py`` (this directory).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from equivalence import run_case, setup

from clipkit.tiled.settings import Tiling

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


def main(out: Path, strategy: str = "ddp") -> None:
    rt, *rest = setup(strategy)
    results = {}
    for loss_name, local, micro, tiled in CASES:
        tiling = Tiling("true" if tiled else "false", TILE)
        case = (loss_name, True, local, micro)  # equivalence.run_case's (loss, with grad, local, micro)
        result = run_case(rt, *rest, case, tiling=tiling)
        results[(loss_name, local, micro, tiled)] = {"loss": result["loss"], "grads": result["grads"]}
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if strategy == "ddp" else f"-{strategy}"
        torch.save(results, out / f"tiled-{rt.world_size}{suffix}.pt")
    rt.wait()
    rt.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])  # an optional strategy: fsdp2
