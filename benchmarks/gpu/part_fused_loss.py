"""Exact contrastive losses at large N, fwd + bwd (issue 37): clipkit's fused kernels against the
generic tiled engine, the full N×N path where it fits, and Inf-CL's ``cal_inf_loss`` (InfoNCE only).

What: for N ∈ {65 536, 262 144, 1 048 576} × d ∈ {128, 512, 768} and the losses InfoNCE (``dot``,
scale 1/0.07) and SigLIP (``dot``, scale 10, bias −10), on the same bf16 unit rows [N, d]:
- ``fused``: ``tiled_global_loss(..., fused=True)`` (clipkit/tiled/fused.py);
- ``tiled``: ``tiled_global_loss(..., fused=False)``, the generic engine (tile 8192, fp32 tiles);
- ``full``: the similarity's N×N logits (bf16 GEMM, upcast to fp32) and the loss's ``__call__``;
- ``infcl``: symmetric InfoNCE from Inf-CL, ½·(cal_inf_loss(a, b, scale) + cal_inf_loss(b, a, scale))
  (the package computes in fp32; ``head_dim`` = the largest of 256/128/64 dividing d). Imported only
  if installed (its wheel is carried with the others: benchmarks/gpu/wheels.txt).

How: per point, each implementation's first call (compile, and ``peak_memory`` above the inputs),
then ``ROUNDS`` interleaved rounds timed with CUDA events; the median is reported. TFLOP/s count a
fixed work of 8·N²·d (the four N×N×d GEMMs of an exact fwd + bwd: forward, recompute, dA, dB) for
every implementation, so the figures compare times; % of peak uses the bf16 peak part_ceilings.py
measured (left out when it did not run). The max relative difference to ``fused`` is taken over
the loss and both gradients (max |x − fused| / max |fused|; to ``tiled`` where fused did not run).
An implementation whose estimated time (the last point's × (N/N_last)² × the calls needed) would
overrun the budget is not run (listed in ``skipped``), as is ``full`` when its logits would not fit
(N²·18 bytes > free memory).

Goals (issue 37): InfoNCE at N = 1 048 576, d = 128 in ≤ 3 s; ≥ 50 % of bf16 peak for d ≥ 512 at
N ≥ 65 536 (InfoNCE and SigLIP); ≥ 1.2× Inf-CL's speed on every InfoNCE point.

    python benchmarks/gpu/part_fused_loss.py --out DIR [--budget-s 240]
    bash benchmarks/gpu/run.sh OUT fused_loss summary

Rehearsal (CLIPKIT_GPU_REHEARSAL=1, CPU): N ∈ {32, 48}, d = 16; ``fused`` only under
TRITON_INTERPRET=1 with triton installed, ``infcl`` never (it needs CUDA): both recorded as skipped.
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
    write_part,
)

from clipkit.contract.types import Logits, LossContext, PointSet
from clipkit.plugins.losses.baseline_losses import SigLIPLoss
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.tiled import fused
from clipkit.tiled.contract import tiled_global_loss

SIZES = pick([65536, 262144, 1048576], [32, 48])
DIMS = pick([128, 512, 768], [16])
ROUNDS = int(os.environ.get("CLIPKIT_GPU_FUSED_ROUNDS", 0)) or pick(3, 1)  # interleaved timed rounds a point
TILE = pick(8192, 32)
SLACK = 1.5
GOAL_SECONDS, GOAL_PEAK_PERCENT, GOAL_INFCL_RATIO = 3.0, 50.0, 1.2


def _loss_and_similarity(name: str, dev):
    if name == "infonce":
        return InfoNCE(), DotSimilarity(init_scale=1 / 0.07).to(dev)
    return SigLIPLoss(), DotSimilarity(init_scale=10.0, bias=-10.0).to(dev)


def _rows(n: int, d: int, dev, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, d, device=dev, generator=generator)
    return torch.nn.functional.normalize(x, dim=-1).to(torch.bfloat16).requires_grad_()


def _infcl():
    try:
        from inf_cl import cal_inf_loss
    except Exception as error:  # not installed, or no CUDA triton in this environment
        return None, f"inf-cl not importable ({type(error).__name__})"
    return cal_inf_loss, None


class Point:
    """One (loss, N, d): the implementations as fwd+bwd callables that keep their last result."""

    def __init__(self, loss_name: str, n: int, d: int, dev) -> None:
        self.loss_name, self.n, self.d, self.dev = loss_name, n, d, dev
        self.loss, self.similarity = _loss_and_similarity(loss_name, dev)
        self.a, self.b = _rows(n, d, dev, 0), _rows(n, d, dev, 1)
        self.results: dict[str, tuple[float, torch.Tensor, torch.Tensor]] = {}

    def _finish(self, name: str, loss: torch.Tensor) -> None:
        grad_a, grad_b = torch.autograd.grad(loss, [self.a, self.b])
        self.results[name] = (float(loss.detach()), grad_a.float(), grad_b.float())

    def tiled(self, fused_path: bool):
        def run() -> None:
            a, b = PointSet(self.a.unsqueeze(1)), PointSet(self.b.unsqueeze(1))
            out = tiled_global_loss(self.loss, self.similarity, a, b, LossContext(), tile_size=TILE,
                                    fused=fused_path)  # fmt: skip
            self._finish("fused" if fused_path else "tiled", out.loss)

        return run

    def full(self) -> None:
        logits = self.similarity(PointSet(self.a.unsqueeze(1)), PointSet(self.b.unsqueeze(1))).i2t.float()
        targets = torch.arange(self.n, device=self.dev)
        self._finish("full", self.loss(Logits.symmetric(logits), targets, LossContext()).loss)

    def infcl(self, cal_inf_loss):
        head_dim = next(h for h in (256, 128, 64, 32, 16) if self.d % h == 0)

        def run() -> None:
            scale = self.similarity.scale()
            loss = (cal_inf_loss(self.a, self.b, scale=scale, head_dim=head_dim)
                    + cal_inf_loss(self.b, self.a, scale=scale, head_dim=head_dim)) / 2  # fmt: skip
            self._finish("infcl", loss)

        return run

    def max_relative_difference(self, name: str) -> tuple[str, float] | None:
        """(reference, max relative difference): against ``fused``, or ``tiled`` where fused did not run."""
        reference = "fused" if "fused" in self.results else "tiled"
        if reference not in self.results or name not in self.results or name == reference:
            return None
        return reference, relative_difference(self.results[name], self.results[reference])


def relative_difference(got: tuple, reference: tuple) -> float:
    """Max relative difference of (loss, grad_a, grad_b) to ``reference``'s: |Δloss| / |loss|, and
    per gradient max |Δ| / max |reference|."""
    worst = abs(got[0] - reference[0]) / max(abs(reference[0]), 1e-30)
    for want, have in zip(reference[1:], got[1:], strict=True):
        worst = max(worst, float((have - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst


class Part:
    def __init__(self, args: argparse.Namespace, dev) -> None:
        self.args, self.dev = args, dev
        self.peak = read_ceilings(args.out).get("bf16_tflops")
        self.figures: list[dict] = []
        self.skipped: list[str] = []
        # implementation -> (N, d, ms) of its last run
        self.last_ms: dict[str, tuple[int, int, float]] = {}
        self.cal_inf_loss, reason = _infcl() if dev.type == "cuda" else (None, "inf-cl needs CUDA")
        if reason:
            self.skipped.append(reason)
        if self.peak is None:
            self.skipped.append("% of bf16 peak: part_ceilings.py did not run")
        if not fused.available() or (dev.type != "cuda" and not fused.interpreting()):
            self.skipped.append("fused: triton not installed or (on CPU) TRITON_INTERPRET unset")

    def left(self) -> float:
        return self.args.budget_s - process_seconds()

    def skip(self, reason: str) -> None:
        print(f"  skipped: {reason}", flush=True)
        self.skipped.append(reason)

    def affordable(self, name: str, n: int, d: int, label: str) -> bool:
        """Whether ``name``'s estimated time at (n, d) fits what is left: its last run's time
        scaled by the work, N²·d (the H200 run of 2026-11-27 skipped N = 1M, d = 128 on an
        estimate scaled from d = 512 by N² alone)."""
        if name not in self.last_ms:
            return self.left() > 5
        last_n, last_d, last_ms = self.last_ms[name]
        estimate = last_ms / 1e3 * (n / last_n) ** 2 * (d / last_d) * (ROUNDS + 2)
        if estimate * SLACK > self.left():
            self.skip(f"{label} {name}: not run, estimated {estimate:.1f} s > {self.left():.1f} s left")
            return False
        return True

    def runners(self, point: Point, label: str) -> dict:
        """The implementations to time at ``point``: each affordable one, of those
        CLIPKIT_GPU_FUSED_IMPLS names (comma-separated; default all)."""
        chosen = os.environ.get("CLIPKIT_GPU_FUSED_IMPLS", "fused,tiled,full,infcl").split(",")
        runs = {}
        if (
            "fused" in chosen
            and "fused:" not in " ".join(self.skipped)
            and self.affordable("fused", point.n, point.d, label)
        ):
            runs["fused"] = point.tiled(True)
        if "tiled" in chosen and self.affordable("tiled", point.n, point.d, label):
            runs["tiled"] = point.tiled(False)
        free = torch.cuda.mem_get_info()[0] if self.dev.type == "cuda" else 2**31
        if "full" in chosen and point.n**2 * 18 >= free:
            self.skip(f"{label} full: N×N logits do not fit")
        elif "full" in chosen and self.affordable("full", point.n, point.d, label):
            runs["full"] = point.full
        if (
            "infcl" in chosen
            and point.loss_name == "infonce"
            and self.cal_inf_loss is not None
            and self.affordable("infcl", point.n, point.d, label)
        ):
            runs["infcl"] = point.infcl(self.cal_inf_loss)
        return runs

    def measure(self, loss_name: str, n: int, d: int) -> None:
        label = f"{loss_name} N={n} d={d}"
        point = Point(loss_name, n, d, self.dev)
        runs, memory = {}, {}
        for name, run in self.runners(point, label).items():
            try:
                began = time.perf_counter()
                memory[name] = peak_memory(run)
                self.last_ms[name] = (n, d, (time.perf_counter() - began) * 1e3)
                runs[name] = run
            except Exception as error:
                text = "out of memory" if is_oom(error) else f"{type(error).__name__}: {str(error)[:160]}"
                self.skip(f"{label} {name}: {text}")
            free_memory()
        if not runs:
            return
        times = interleaved_ms(runs, warmup=0, rounds=ROUNDS)
        work = 8.0 * n * n * d
        for name, values in times.items():
            ms = median(values)
            self.last_ms[name] = (n, d, ms)
            tflops = work / (ms / 1e3) / 1e12
            print(f"  {label} {name}: {ms:.2f} ms, {tflops:.2f} TFLOP/s", flush=True)
            self.figures.append(self._time_figure(loss_name, n, d, name, ms, runs, times))
            self.figures.append(figure(f"fused_loss {label} {name} TFLOP/s", tflops, "TFLOP/s"))
            if self.peak:
                percent = 100 * tflops / self.peak
                goal = name == "fused" and d >= 512
                self.figures.append(figure(f"fused_loss {label} {name} % of bf16 peak", percent, "%",
                                           goal=f">= {GOAL_PEAK_PERCENT:g} %" if goal else None,
                                           met=percent >= GOAL_PEAK_PERCENT if goal else None))  # fmt: skip
            if memory.get(name) is not None:
                self.figures.append(figure(f"fused_loss {label} {name} peak memory above inputs",
                                           memory[name] / 2**30, "GiB"))  # fmt: skip
            difference = point.max_relative_difference(name)
            if difference is not None:
                reference, value = difference
                what = f"fused_loss {label} {name} max rel. difference to {reference}"
                self.figures.append(figure(what, value, "ratio"))
        del point
        free_memory()

    def _time_figure(self, loss_name, n, d, name, ms, runs, times) -> dict:
        label = f"{loss_name} N={n} d={d}"
        goal, met = None, None
        if name == "fused" and loss_name == "infonce" and n == 1 << 20 and d == 128:
            goal, met = f"<= {GOAL_SECONDS:g} s", ms / 1e3 <= GOAL_SECONDS
        note = ""
        if name == "fused" and "infcl" in times:
            ratio = median(times["infcl"]) / ms
            note = f"{ratio:.2f}x Inf-CL's speed"
            goal_text, goal_met = f">= {GOAL_INFCL_RATIO:g}x", ratio >= GOAL_INFCL_RATIO
            self.figures.append(figure(f"fused_loss {label} fused speed / Inf-CL", ratio, "x",
                                       goal=goal_text, met=goal_met))  # fmt: skip
        return figure(f"fused_loss {label} {name} fwd+bwd", ms, "ms", goal=goal, met=met, note=note)

    def save(self) -> None:
        extra = {
            "budget_s": self.args.budget_s,
            "elapsed_s": round(process_seconds(), 1),
            "bf16_peak": self.peak,
        }
        write_part(self.args.out, "fused_loss", self.figures, skipped=self.skipped, extra=extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    # run.sh's limit for the part, less a margin to write the results, caps the default budget.
    limit = float(os.environ.get("CLIPKIT_GPU_PART_LIMIT_S", "inf")) - 20.0
    parser.add_argument("--budget-s", type=float, default=min(pick(240.0, 40.0), limit))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = device()
    part = Part(args, dev)
    if rehearsal():
        torch.manual_seed(0)
    for loss_name, n, d in chosen_points():
        if part.left() < 5:
            part.skip(f"{loss_name} N={n} d={d}: budget spent")
            continue
        part.measure(loss_name, n, d)
        part.save()  # after every point: a timeout keeps what was measured
    part.save()


def chosen_points() -> list[tuple[str, int, int]]:
    """(loss, N, d) in the order measured: every SIZES × DIMS × loss, or the points named in
    CLIPKIT_GPU_FUSED_POINTS ("infonce:1048576:128,siglip:65536:512"), for a second, shorter try."""
    named = os.environ.get("CLIPKIT_GPU_FUSED_POINTS", "").strip()
    if not named:
        return [(loss, n, d) for n in SIZES for d in DIMS for loss in ("infonce", "siglip")]
    points = []
    for item in named.split(","):
        loss, n, d = item.strip().split(":")
        if loss not in ("infonce", "siglip"):
            raise SystemExit(f"CLIPKIT_GPU_FUSED_POINTS: unknown loss {loss!r} in {item!r} (infonce, siglip)")
        points.append((loss, int(n), int(d)))
    return points


if __name__ == "__main__":
    main()
