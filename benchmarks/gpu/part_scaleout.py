"""DDP vs DeepSpeed ZeRO-2 / ZeRO-3 vs FSDP2 on the GPUs there are: step time and peak memory of
the same recipe under each ``train.distributed.strategy`` (issue 40).

- What runs: ``torchrun --standalone --nproc_per_node G -m clipkit train clip`` (ViT-B/16 image
  tower, CLIP text tower; G = every visible GPU, 1 on the lent machine) on synthetic 224 px shapes
  (made once, in this process, as ``clipkit shard`` would), ``data.batch_size`` 64·G,
  ``train.precision=bf16``, SGD, 12 steps logged one by one, no checkpoint, export or evaluation:
  one launch per strategy — ``ddp``, ``deepspeed`` with ``zero_stage`` 2 and 3, ``fsdp2``.
- Figures, per strategy: the median step time over steps 3-12 (the first two warm up), from the
  run's own ``metrics.jsonl`` (``samples_per_s`` with ``log_every=1``: the global batch over the
  wall time of that step, loader included), its ratio to DDP's, and process 0's peak GPU memory
  (``gpu_peak_gib``: ``torch.cuda.max_memory_allocated``). With one GPU nothing is sharded across
  devices: the figures then say what each strategy costs over DDP, not what it saves; with G > 1
  the peak memory shows the sharding.
- A strategy that cannot run (DeepSpeed absent, out of memory) is listed in ``skipped`` with its
  last error line; the others still run.

Rehearsal (``CLIPKIT_GPU_REHEARSAL=1``): ``quickstart@smoke`` on the CPU, one process, batch 8,
fp32, 4 steps (the first two warm up), DDP only: the other strategies' launches are the same
plumbing with other overrides, and tests/test_distributed.py launches each of them. Usage (from
the repository root):

    python benchmarks/gpu/part_scaleout.py --out DIR      # writes DIR/scaleout.json
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import device, figure, parse_out, pick, write_part

BUDGET_S = pick(115.0, 230.0)
STARTED = time.perf_counter()
GPUS = max(1, torch.cuda.device_count())
PER_GPU = pick(64, 8)
STEPS = pick(12, 4)
WARMUP = 2
RECIPE = pick("clip", "quickstart@smoke")
IMAGE_SIZE = pick(224, 48)
ALL_STRATEGIES = {
    "ddp": ["train.distributed.strategy=ddp"],
    "zero2": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2"],
    "zero3": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"],
    "fsdp2": ["train.distributed.strategy=fsdp2"],
}
STRATEGIES = pick(ALL_STRATEGIES, {"ddp": ALL_STRATEGIES["ddp"]})


def left() -> float:
    return BUDGET_S - (time.perf_counter() - STARTED)


def log(message: str) -> None:
    print(f"[scaleout {time.perf_counter() - STARTED:5.1f}s] {message}", flush=True)


def make_shards(folder: Path) -> Path:
    """Enough synthetic samples for every step of one launch, sharded once."""
    from clipkit.app import api

    samples = PER_GPU * GPUS * (STEPS + 2)
    target = folder / "shards"
    api.shard(f"synthetic://shapes?n={samples}&split=train&image_size={IMAGE_SIZE}", target)
    return target


def overrides(shards: Path) -> list[str]:
    return [
        f"data.shards={shards}",
        "data.holdout=0",
        f"data.batch_size={PER_GPU * GPUS}",
        f"model.image_size={IMAGE_SIZE}",
        f"train.precision={pick('bf16', 'no')}",
        f"train.steps={STEPS}",
        "train.log_every=1",
        f"train.checkpoint_every={STEPS * 10}",
        "train.export=false",
        "train.eval_every=0",
        "optimizer.name=sgd",
        "schedule.name=constant",
        "eval=[]",
    ]


def launch(name: str, shards: Path, folder: Path, limit: float) -> dict:
    """One training launch under ``name``'s strategy; its step times and peak memory."""
    run_dir = folder / f"run-{name}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(GPUS)]
    command += ["-m", "clipkit", "train", RECIPE, *overrides(shards), *STRATEGIES[name]]
    command += ["--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("_TORCHINDUCTOR")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(5.0, limit))
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        raise RuntimeError((errors or lines or ["no output"])[-1][:300])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "samples_per_s" in row][WARMUP:]
    if not steps:
        raise RuntimeError("no logged step after the warm-up")
    step_ms = [PER_GPU * GPUS / row["samples_per_s"] * 1e3 for row in steps]
    peaks = [row["gpu_peak_gib"] for row in rows if "gpu_peak_gib" in row]
    return {"step_ms": step_ms, "peak_gib": max(peaks) if peaks else None}


def main() -> None:
    out = parse_out()
    device()  # the contract: a real run is on the GPU machine (only a rehearsal runs elsewhere)
    figures: list[dict] = []
    skipped: list[str] = []
    extra: dict = {"budget_s": BUDGET_S, "gpus": GPUS, "recipe": RECIPE, "batch": PER_GPU * GPUS}

    def save() -> None:
        write_part(out, "scaleout", figures, skipped=skipped, extra=extra)

    folder = Path(tempfile.mkdtemp(prefix="clipkit-gpu-scaleout-"))
    try:
        shards = make_shards(folder)
        log(f"{GPUS} process(es), {RECIPE}, batch {PER_GPU * GPUS}, {STEPS} steps; shards ready")
        results: dict[str, dict] = {}
        for position, name in enumerate(STRATEGIES):
            if name.startswith("zero"):
                try:
                    import deepspeed  # noqa: F401
                except ImportError:
                    skipped.append(f"{name}: DeepSpeed is not installed")
                    continue
            remaining = len(STRATEGIES) - position
            if left() < 10:
                skipped.append(f"{name}: budget ({left():.0f} s left)")
                continue
            try:
                results[name] = launch(name, shards, folder, left() / remaining * 1.5)
            except Exception as error:  # noqa: BLE001 - keep the other strategies' figures
                skipped.append(f"{name}: {type(error).__name__}: {error}"[:400])
                log(skipped[-1])
                continue
            add_figures(figures, name, results[name], results.get("ddp"))
            save()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    extra["wall_s"] = round(time.perf_counter() - STARTED, 1)
    save()
    log(f"done in {extra['wall_s']} s")


def add_figures(figures: list, name: str, result: dict, ddp: dict | None) -> None:
    median = statistics.median(result["step_ms"])
    what = f"{RECIPE}, {GPUS} process(es), batch {PER_GPU * GPUS}"
    low, high = min(result["step_ms"]), max(result["step_ms"])
    log(f"{name}: step {median:.1f} ms (range {low:.1f}-{high:.1f}), peak {result['peak_gib']} GiB")
    figures.append(
        figure(
            f"{name} step time, {what}",
            median,
            "ms",
            note=f"median of {len(result['step_ms'])} steps after {WARMUP} warm-up; "
            f"range {low:.1f}-{high:.1f}",
        )
    )
    if ddp is not None and name != "ddp":
        ratio = median / statistics.median(ddp["step_ms"])
        figures.append(figure(f"{name} step time / ddp's, {what}", ratio, "x", note="same launch settings"))
    if result["peak_gib"] is not None:
        figures.append(figure(f"{name} peak GPU memory (process 0), {what}", result["peak_gib"], "GiB"))


if __name__ == "__main__":
    main()
