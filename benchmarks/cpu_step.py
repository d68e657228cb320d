"""clipkit's training step vs open_clip's on the CPU, in process CPU time (issue 38's CPU goal:
the step stays <= 1.0x open_clip's CPU time).

Both sides are those of ``benchmarks/gpu/part_vit_step.py`` in its CPU form: clipkit's trainer on
``clip@tiny`` (``vit_tiny`` + a 2-layer 64-wide text Transformer, 48 px, context 16, fp32, one
torch thread) driven by ``clipkit.train.loop.train_step`` (encode, loss, finite check, backward,
grad norm, AdamW, zero_grad) and the schedule; open_clip 3.3.0's ``CLIP`` with the same
dimensions and the step of its ``train_one_epoch`` (forward, ``ClipLoss``, backward, AdamW,
zero_grad, the logit-scale clamp, the schedule). Same random batches on both sides.

How: one warm-up round each, then ``--rounds`` interleaved rounds (clipkit, open_clip; the order
alternates) of ``--steps`` steps; each round's cost is the process CPU time
(``time.process_time``: user + system of every thread) over its steps. Printed: per-step CPU
milliseconds per side (median, range) and the per-round ratio clipkit / open_clip (median, range).

    python benchmarks/cpu_step.py [--batch 32] [--rounds 9] [--steps 20]

Needs open_clip (``pip install -e ".[interop]"``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["CLIPKIT_GPU_REHEARSAL"] = "1"  # part_vit_step's CPU sizes (clip@tiny, fp32, one thread)
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import part_vit_step as vit  # noqa: E402
import torch  # noqa: E402


def round_cpu_ms(side, batches: list[dict], steps: int) -> float:
    """CPU milliseconds per step over ``steps`` steps of ``side``."""
    run = vit.runner(side, batches, steps)
    began = time.process_time()
    run()
    return (time.process_time() - began) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    vit.BATCH = args.batch  # read by ClipkitSide when it builds the trainer
    torch.manual_seed(0)
    clipkit = vit.ClipkitSide(Path(tempfile.mkdtemp(prefix="clipkit-cpu-step-")) / "run")
    dev = torch.device("cpu")
    batches = [
        vit.make_batch(args.batch, clipkit.image_size, clipkit.context, clipkit.vocab, seed, dev)
        for seed in (1, 2)
    ]
    clipkit.batches.extend(batches)
    open_clip = vit.OpenClipSide(dev, clipkit)
    print(f"clipkit: {clipkit.summary}; {open_clip.summary}; batch {args.batch}, 1 thread", flush=True)
    sides = (clipkit, open_clip)
    for side in sides:
        round_cpu_ms(side, batches, max(2, args.steps // 4))  # warm-up
    costs: dict[str, list[float]] = {side.name: [] for side in sides}
    for index in range(args.rounds):
        for side in sides if index % 2 == 0 else reversed(sides):
            costs[side.name].append(round_cpu_ms(side, batches, args.steps))
        print(f"round {index + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in costs.items()), flush=True)
    ratios = [a / b for a, b in zip(costs["clipkit"], costs["open_clip"], strict=True)]
    for name, values in costs.items():
        print(f"{name}: {statistics.median(values):.2f} ms/step CPU ({min(values):.2f}-{max(values):.2f})")
    print(f"clipkit / open_clip CPU time per step: {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f} over {args.rounds} rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
