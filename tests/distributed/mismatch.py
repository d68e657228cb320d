"""Two processes gather blocks of different shapes: both must raise (not hang, not mix rows).

Run under ``torchrun --nproc_per_node 2``; process 0 writes the error message to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from clipkit.train.runtime import collectives


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    block = torch.zeros(4 + rank, 3, 2)  # process 1 holds one row more
    try:
        collectives.gather_with_grad(block)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    if rank == 0:
        out.write_text(message)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
