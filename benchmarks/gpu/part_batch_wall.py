"""The contrastive batch-size wall: the largest batch N whose full N×N InfoNCE fits one GPU, fwd + bwd.

What: clipkit's own plugins as the loop calls them: ``DotSimilarity`` (plugins/similarities/dot.py,
CLIP's learnable scale 1/0.07) on two PointSets of N random unit vectors (d = 512, M = 1, gradient
leaves), then ``InfoNCE`` (plugins/losses/infonce.py) on the N×N logits with the diagonal as
targets, then backward. Two modes:
- ``bf16``: bf16 features, so the similarity GEMM runs in bf16 and gives bf16 logits, which are
  upcast to fp32 for the loss (the loss computes in fp32, as the loop's ``full_precision``);
- ``fp32``: fp32 features (what the loop hands the similarity today: the gathered batch is fp32),
  GEMM at torch's default fp32 matmul precision. Run after bf16 while the budget lasts.

How: N = 4096, 8192, … (powers of two, up to 2^20) until a fwd+bwd raises
``torch.cuda.OutOfMemoryError`` (the allocator's cache is emptied after each try), then one
bisection between the last success and the first failure (rounded to a multiple of 1024). At each
fitting N: peak memory (``peak_memory``: bytes above the inputs) of the first call, then the time
of one fwd+bwd (CUDA events, median of 3 after that call). At the largest N: the similarity's
logits GEMM alone (its forward, no autograd: 2·N²·d FLOPs) and a bare ``torch.mm`` of the same
shape, interleaved, TFLOP/s and % of the bf16 matmul peak part_ceilings.py measured (goal ≥ 60 %).

The issue's goal, N = 1 048 576 per GPU, needs tiled losses, which are not built yet (issue 29):
that goal is reported as not met, with the full loss's wall as its value.

Budget: ``--budget-s`` (default 40, env ``CLIPKIT_BATCH_WALL_BUDGET_S``) seconds from process start;
a size whose estimate (the last size's cost × 4, as memory and time grow like N²) would overrun
what is left is not tried (listed in ``skipped``). The JSON is rewritten after each mode.

    python benchmarks/gpu/part_batch_wall.py --out DIR [--modes bf16,fp32] [--budget-s 40] [--dim 512]

Rehearsal (``CLIPKIT_GPU_REHEARSAL=1``, CPU): N = 64 … 1024, no OOM search (stops at the cap),
d = 512, same JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from common import (
    device,
    figure,
    free_memory,
    interleaved_ms,
    is_oom,
    median,
    peak_memory,
    pick,
    process_seconds,
    read_ceilings,
    rehearsal,
    time_ms,
    write_part,
)

from clipkit.contract.types import Logits, LossContext, PointSet
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity

MODES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GOAL_N = 1 << 20
GEMM_GOAL_PERCENT = 60.0
TILED_SKIP = "tiled losses not built yet (issue 29)"
#: Ceilings assumed when part_ceilings.py did not run.
FALLBACK_CEILINGS = {"bf16_tflops": pick(400.0, 0.05), "fp32_tflops": pick(40.0, 0.05)}
#: Timed fwd+bwd calls per size (after the peak-memory call), and GEMM rounds (fewer in a rehearsal:
#: it must stay fast on CI's two cores).
TIMED_CALLS = pick(3, 1)
GEMM_ROUNDS = pick(5, 2)
#: A size is tried only if its estimate, times this, fits in what is left.
SLACK = 1.5


def features(n: int, dim: int, dtype: torch.dtype, dev: torch.device, seed: int) -> PointSet:
    """[N, 1, d] random unit vectors in ``dtype``, a gradient leaf."""
    generator = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, 1, dim, device=dev, generator=generator)
    return PointSet(torch.nn.functional.normalize(x, dim=-1).to(dtype).requires_grad_())


class Step:
    """One contrastive fwd+bwd at batch N: DotSimilarity -> fp32 logits -> InfoNCE -> backward."""

    def __init__(self, n: int, dim: int, dtype: torch.dtype, dev: torch.device) -> None:
        self.n = n
        self.similarity = DotSimilarity().to(dev)
        self.loss = InfoNCE()
        self.a = features(n, dim, dtype, dev, seed=0)
        self.b = features(n, dim, dtype, dev, seed=1)
        self.targets = torch.arange(n, device=dev)

    def __call__(self) -> None:
        i2t = self.similarity(self.a, self.b).i2t.float()  # fp32 logits, as the loss computes them
        out = self.loss(Logits.symmetric(i2t), self.targets, LossContext())
        out.loss.backward()
        self.a.points.grad = self.b.points.grad = None
        self.similarity.zero_grad(set_to_none=True)

    def logits_only(self) -> None:
        with torch.no_grad():
            self.similarity(self.a, self.b)

    def bare_mm(self):
        a, b = self.a.points.detach()[:, 0], self.b.points.detach()[:, 0]
        return lambda: torch.mm(a, b.t())


class Part:
    def __init__(self, args: argparse.Namespace, dev: torch.device) -> None:
        self.args, self.dev = args, dev
        measured = read_ceilings(args.out)
        self.ceilings = {key: measured.get(key, fallback) for key, fallback in FALLBACK_CEILINGS.items()}
        self.ceilings_measured = "bf16_tflops" in measured
        self.figures: list[dict] = []
        self.skipped: list[str] = [TILED_SKIP]
        self.searches: dict[str, dict] = {}

    def left(self) -> float:
        return self.args.budget_s - process_seconds()

    def skip(self, reason: str) -> None:
        print(f"  skipped: {reason}", flush=True)
        self.skipped.append(reason)

    def save(self) -> None:
        extra = {
            "searches": self.searches,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(process_seconds(), 1),
            "ceilings": {**self.ceilings, "measured": self.ceilings_measured},
        }
        write_part(self.args.out, "batch_wall", self.figures, skipped=self.skipped, extra=extra)

    def attempt(self, n: int, dtype: torch.dtype) -> dict:
        """Fit test and timing at N; raises on OOM (the caller frees the memory)."""
        began = time.perf_counter()
        step = Step(n, self.args.dim, dtype, self.dev)
        peak = peak_memory(step)
        first_s = time.perf_counter() - began
        times = time_ms(step, warmup=0, repeats=TIMED_CALLS)
        return {
            "n": n,
            "peak": peak,
            "ms": median(times),
            "range": (min(times), max(times)),
            "cost_s": first_s,
        }

    def try_size(self, mode: str, n: int, search: dict) -> bool | None:
        """True: fits; False: OOM; None: not tried (budget) or another error (recorded)."""
        # Memory traffic and time grow like N²; the first try is small (4096² logits).
        estimate = search["last_cost_s"] * (n / search["last_n"]) ** 2 if search["last_n"] else 2.0
        if estimate * SLACK > self.left():
            self.skip(f"{mode} N={n}: not tried, estimated {estimate:.1f} s > {self.left():.1f} s left")
            return None
        result, oom, text = None, False, ""
        try:
            result = self.attempt(n, MODES[mode])
        except Exception as error:  # OOM is the expected end of the search; other errors are recorded
            oom = is_oom(error)
            text = type(error).__name__ + (f": {str(error).splitlines()[0][:200]}" if str(error) else "")
        # Outside the except block: the failed step's frames (and tensors) are gone by now.
        free_memory()
        if result is None:
            search["tries"].append({"n": n, "fits": False, "error": None if oom else text})
            if not oom:
                self.skip(f"{mode} N={n}: {text}")
            print(f"  {mode} N={n}: {'out of memory' if oom else text}", flush=True)
            return False if oom else None
        peak = result["peak"]
        memory = "" if peak is None else f", peak {peak / 2**30:.2f} GiB"
        print(f"  {mode} N={n}: fits, fwd+bwd {result['ms']:.1f} ms{memory}", flush=True)
        search["tries"].append({"n": n, "fits": True, "ms": result["ms"], "peak_bytes": peak})
        # Cost of the whole try (setup, peak-memory call, 3 timed calls) for the next estimate.
        search["last_cost_s"], search["last_n"] = result["cost_s"] + TIMED_CALLS * result["ms"] / 1e3, n
        if search["best"] is None or n > search["best"]["n"]:
            search["best"] = result
        return True

    def search(self, mode: str) -> dict:
        search: dict = {"tries": [], "best": None, "last_cost_s": 0.0, "last_n": 0, "first_failure": None}
        start, cap = pick(4096, 64), pick(GOAL_N, 1024)
        n, stopped = start, "cap"
        while n <= cap:
            fits = self.try_size(mode, n, search)
            if fits is None:
                stopped = "budget or error"
                break
            if not fits:
                search["first_failure"], stopped = n, "out of memory"
                break
            n *= 2
        best, failure = search["best"], search["first_failure"]
        if best is not None and failure is not None and not rehearsal():
            middle = (best["n"] + failure) // 2 // 1024 * 1024
            if best["n"] < middle < failure:
                self.try_size(mode, middle, search)
        search["stopped"] = stopped
        return search

    def gemm(self, mode: str, n: int) -> dict[str, list[float]]:
        """Per-call ms of the similarity's logits GEMM and of a bare torch.mm, interleaved."""
        step = Step(n, self.args.dim, MODES[mode], self.dev)
        try:
            return interleaved_ms(
                {"similarity": step.logits_only, "torch.mm": step.bare_mm()},
                warmup=pick(2, 1),
                rounds=GEMM_ROUNDS,
            )
        finally:
            del step
            free_memory()

    def report(self, mode: str, search: dict) -> None:
        best = search["best"]
        tries = ", ".join(
            f"{t['n']} {'ok' if t['fits'] else 'OOM' if t['error'] is None else 'error'}"
            for t in search["tries"]
        )
        self.searches[mode] = {
            "tries": search["tries"],
            "largest_n": None if best is None else best["n"],
            "first_failure": search["first_failure"],
            "stopped": search["stopped"],
        }
        if best is None:
            self.skip(f"{mode}: no batch size fitted or was tried (tries: {tries or 'none'})")
            return
        n = best["n"]
        how = (
            f"full N×N InfoNCE fwd+bwd, d={self.args.dim}, {mode} features; tries: {tries}; "
            f"search stopped by: {search['stopped']}"
        )
        self.figures.append(figure(f"batch wall {mode}: largest N", n, "samples", note=how))
        if best["peak"] is not None:
            self.figures.append(
                figure(
                    f"batch wall {mode}: peak memory at N={n}",
                    best["peak"] / 2**30,
                    "GiB",
                    note=f"above the inputs; {best['peak'] / n**2:.1f} bytes per logit",
                )
            )
        low, high = best["range"]
        self.figures.append(
            figure(
                f"batch wall {mode}: fwd+bwd time at N={n}",
                best["ms"],
                "ms",
                note=f"median of {TIMED_CALLS} after one call ({low:.1f}–{high:.1f} ms)",
            )
        )
        gemm_flops = 2.0 * n * n * self.args.dim
        # The GEMM runs at most 5 × 2 calls of ~2·N²·d FLOPs; small next to the fwd+bwd tries.
        if self.left() < 3 * SLACK:
            self.skip(f"{mode} similarity GEMM at N={n}: {self.left():.1f} s left")
            return
        try:
            times = self.gemm(mode, n)
        except Exception as error:  # keep the figures above
            self.skip(f"{mode} similarity GEMM at N={n}: {type(error).__name__}: {str(error)[:200]}")
            return
        peak_key = "bf16_tflops" if mode == "bf16" else "fp32_tflops"
        source = "measured" if self.ceilings_measured else "ASSUMED (ceilings.json missing)"
        for name, values in times.items():
            tflops = gemm_flops / (median(values) * 1e-3) / 1e12
            percent = 100 * tflops / self.ceilings["bf16_tflops"]
            own = 100 * tflops / self.ceilings[peak_key]
            print(
                f"  {mode} {name} N×N×d at N={n}: {tflops:.1f} TFLOP/s = {percent:.1f} % of bf16 peak",
                flush=True,
            )
            judged = name == "similarity" and mode == "bf16"
            label = "similarity GEMM" if name == "similarity" else "bare torch.mm reference"
            note = (
                f"2·N²·d = {gemm_flops:.3g} FLOPs, median {median(values):.2f} ms of {GEMM_ROUNDS} "
                "interleaved rounds; "
                f"{own:.0f} % of the {peak_key.split('_')[0]} peak "
                f"({self.ceilings[peak_key]:.4g} TFLOP/s, {source})"
            )
            self.figures.append(figure(f"batch wall {mode}: {label} at N={n}", tflops, "TFLOP/s", note=note))
            self.figures.append(
                figure(
                    f"batch wall {mode}: {label} at N={n}, % of bf16 peak",
                    percent,
                    "% of bf16 peak",
                    goal=f">= {GEMM_GOAL_PERCENT:.0f} % of bf16 peak" if judged else None,
                    met=percent >= GEMM_GOAL_PERCENT if judged else None,
                    note=f"bf16 peak {self.ceilings['bf16_tflops']:.4g} TFLOP/s ({source})",
                )
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="results folder (the part writes batch_wall.json)"
    )
    parser.add_argument("--modes", default="bf16,fp32", help="feature dtypes, in order")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("CLIPKIT_BATCH_WALL_BUDGET_S") or 40),
        help="seconds from process start",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    dev = device()
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; known: {list(MODES)}")
    part = Part(args, dev)
    print(
        f"batch_wall: {dev}, modes {modes}, d={args.dim}, budget {args.budget_s:.0f} s "
        f"({process_seconds():.1f} s spent starting)",
        flush=True,
    )
    if not part.ceilings_measured:
        part.skip("ceilings.json missing: % of bf16 peak uses an ASSUMED peak")
    if dev.type != "cuda":
        part.skip("peak memory and the OOM search: not on the CPU (rehearsal stops at N=1024)")
    for mode in modes:
        if part.left() < 2 * SLACK:
            part.skip(f"{mode}: not run, {part.left():.1f} s left of the {args.budget_s:.0f} s budget")
            continue
        print(f"mode {mode}: {part.left():.1f} s left", flush=True)
        try:
            part.report(mode, part.search(mode))
        except Exception as error:  # keep the other mode's figures
            part.skip(f"{mode}: {type(error).__name__}: {str(error)[:300]}")
            free_memory()
        part.save()
    full = part.searches.get("bf16", {}).get("largest_n")
    if full is not None:
        part.figures.append(
            figure(
                "batch wall: N = 1 048 576 per GPU with tiled losses",
                full,
                "samples",
                goal=f"N >= {GOAL_N} per GPU (tiled losses)",
                met=False,
                note=f"{TILED_SKIP}; the value is the full N×N loss's largest bf16 N, not a tiled-loss run",
            )
        )
    else:
        part.skip(f"N = {GOAL_N} goal: not met, {TILED_SKIP}, and no full-loss N was measured")
    part.save()
    print(f"batch_wall: done in {process_seconds():.1f} s of the {args.budget_s:.0f} s budget", flush=True)


if __name__ == "__main__":
    main()
