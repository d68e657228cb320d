"""Step time and peak memory of a recipe under DDP and DeepSpeed ZeRO-2/3, bf16 and fp16.

For each strategy × precision the script launches the documented command
(``accelerate launch --multi_gpu --num_processes G -m clipkit train RECIPE ...``) at growing
per-GPU batches until one fails (out of memory), and reports, for each batch that ran: the median
samples/s over the steps after ``--warmup`` and the largest ``gpu_peak_gib`` any logged step saw on
process 0 (``torch.cuda.max_memory_allocated``). Data: clipkit's synthetic shapes at the
recipe's image size (no download), so the figures are the training step's, not a disk's.

    python benchmarks/scaleout.py --gpus 8 --recipe wpse                      # ViT-B/16 WPSE
    python benchmarks/scaleout.py --gpus 2 --recipe quickstart@smoke --batches 8 16 --steps 6 \\
        --precisions no                                                        # CPU smoke test

Needs a GPU for meaningful numbers (CPU runs use gloo and report no memory).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = {
    "ddp": [],
    "zero2": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2"],
    "zero3": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="wpse")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=["no", "bf16", "fp16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256, 384, 512, 768])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--workers", type=int, default=8, help="data.num_workers per process")
    parser.add_argument("--image-size", type=int, default=224)
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, strategy: str, precision: str, per_gpu: int, root: Path) -> dict:
    """One training run: its metrics, or {"failed": reason} (out of memory or otherwise)."""
    run_dir = root / f"{strategy}-{precision}-{per_gpu}"
    source = f"synthetic://shapes?n={max(4096, per_gpu * args.gpus * 4)}&image_size={args.image_size}"
    overrides = [
        f"data.source={source}",
        f"data.shards={root / f'shards-{args.image_size}'}",
        f"data.batch_size={per_gpu * args.gpus}",
        f"data.num_workers={args.workers}",
        f"train.steps={args.steps}",
        "train.log_every=1",
        f"train.checkpoint_every={10 * args.steps}",
        "train.export=false",
        f"train.precision={precision}",
        *STRATEGIES[strategy],
    ]
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [str(accelerate), "launch", "--multi_gpu", "--num_processes", str(args.gpus)]
    command += ["--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    command += ["-m", "clipkit", "train", args.recipe, *overrides, "--run-dir", str(run_dir)]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    if done.returncode != 0:
        output = done.stdout + done.stderr
        errors = [line for line in output.splitlines() if "Error" in line or "error:" in line] or ["?"]
        reason = "out of memory" if "out of memory" in output.lower() else errors[-1].strip()[:160]
        print(f"  failed: {reason}", flush=True)
        return {"failed": reason}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "samples_per_s" in row]
    timed = [row["samples_per_s"] for row in rows[args.warmup :]] or [rows[-1]["samples_per_s"]]
    peaks = [row["gpu_peak_gib"] for row in rows if "gpu_peak_gib" in row]
    return {"samples_per_s": statistics.median(timed), "peak_gib": max(peaks) if peaks else None}


def main() -> None:
    args = parse_args()
    table = []
    with tempfile.TemporaryDirectory(prefix="clipkit-scaleout-") as temporary:
        root = Path(temporary)
        for strategy in args.strategies:
            for precision in args.precisions:
                for per_gpu in sorted(args.batches):
                    result = launch(args, strategy, precision, per_gpu, root)
                    if "failed" in result:
                        table.append((strategy, precision, per_gpu, f"failed: {result['failed']}", "", ""))
                        break
                    step_ms = 1000 * per_gpu * args.gpus / result["samples_per_s"]
                    peak = "—" if result["peak_gib"] is None else f"{result['peak_gib']:.1f}"
                    table.append(
                        (
                            strategy,
                            precision,
                            per_gpu,
                            f"{result['samples_per_s']:.0f}",
                            f"{step_ms:.0f}",
                            peak,
                        )
                    )
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    print(f"\n{args.recipe}, {args.gpus} process(es) on {device}, torch {torch.__version__}, ")
    print(f"{args.steps} steps (median after {args.warmup})\n")
    print("| strategy | precision | batch / GPU | samples/s | ms/step | peak GiB (process 0) |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main()
