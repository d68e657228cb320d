"""KME-CLIP logits, forward + backward: the fused Triton kernels vs the block-wise path vs the naive einsum.

What: ``kme_logits(a, b, γ, implementation="triton" | "blockwise")`` and ``kme_logits_naive`` on the
same inputs (plugins/similarities/kme.py, kme_triton.py): N anchors of Mx weighted unit points and
N candidates of My unit points, d = 512, γ = 1/0.07, every input a gradient leaf; one call = the
logits, then backward of their sum. Shapes: N = 256, 384, 512 with 197 × 77 points (ViT-B/16
patches × text tokens) and 50 × 50; points in bf16, then fp32 (with TF32 allowed) while the
budget lasts. The block-wise and naive paths upcast bf16 points to fp32 (their GEMMs are fp32
cuBLAS at torch's default precision); the Triton kernels keep bf16 operands (fp32 accumulation).

How:
- Before any timing, Triton and block-wise are compared once per dtype at the smallest
  configuration (relative L2 error of the logits, and of the gradients of u, w, v and γ under a
  random upstream gradient); a non-finite value, a logits error above 1e-2 or a gradient error
  above 5e-2 marks every Triton figure of that dtype as suspect (and its goals as not met).
- Time: CUDA events, median over interleaved rounds (one call of each path per round) after
  warm-up; the first warm-up call of each path is also its peak-memory call (``peak_memory``:
  bytes the allocator held above the inputs).
- TFLOP/s counts the useful FLOPs only: 3 GEMMs' worth, 3·2·N²·Mx·My·d (the forward's u·v
  product and the backward's two). The recomputations a path makes (Triton: 2 more, block-wise:
  1 more) are not counted. % of bf16 peak divides by the bf16 matmul TFLOP/s that
  part_ceilings.py measured on this device.
- Goals (the issue's, Triton bf16 only): ≥ 50 % of the measured bf16 peak, and peak memory
  O(N² + N·M·d), judged as ≤ 32·N² + 24·N·(Mx + My)·d bytes (a few fp32 N×N and N×M×d
  buffers; the naive path's scores alone are 4·N²·Mx·My).

Budget: the whole part must end within ``--budget-s`` seconds of its process start (default 90,
compile included). Configurations run cheapest first; before each path is run its time is
estimated — from its measured speed on a smaller configuration, else from 40 % of the measured
peak (plus 20 s of compilation before Triton's first call) — and a path whose warm-up + rounds
would overrun what is left is skipped (listed in ``skipped``, never estimated into a figure).
Large calls get fewer rounds (1 warm-up + 2). The naive path is skipped where its estimated peak,
5.2 × its fp32 scores (5.2·4·N²·Mx·My bytes, the ratio measured on the CPU), exceeds 60 % of the
free GPU memory. The JSON is rewritten after every configuration (with the ones not reached under
``pending``), so a part cut by its timeout keeps what it measured. Scale: N = 512, 197 × 77 is
3·2·512²·197·77·512 ≈ 12 TFLOP useful per call (≈ 40 ms at 300 TFLOP/s; block-wise, on fp32
GEMMs, ≈ 1 s); the whole default grid is expected to need well under the 90 s.

    python benchmarks/gpu/part_kme.py --out DIR [--sizes 256,384,512] [--shapes 197x77,50x50]
        [--dtypes bf16,fp32] [--impls triton,blockwise,naive] [--budget-s 90] [--dim 512]

``CLIPKIT_KME_SIZES`` and ``CLIPKIT_KME_BUDGET_S`` set the size list and budget too (flags win).
Rehearsal (``CLIPKIT_GPU_REHEARSAL=1``, CPU): N = 8, 5 × 4 points, d = 32; Triton only under
``TRITON_INTERPRET=1`` (its kernels need CUDA otherwise).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
from common import (
    device,
    figure,
    free_memory,
    median,
    peak_memory,
    pick,
    process_seconds,
    read_ceilings,
    rehearsal,
    synchronize,
    time_ms,
    write_part,
)

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities import kme_triton
from clipkit.plugins.similarities.kme import kme_logits, kme_logits_naive

IMPLS = ("triton", "blockwise", "naive")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: GEMMs of 2·N²·Mx·My·d each that a path executes per fwd+bwd (for time estimates only):
#: Triton 1 forward + 4 backward (a recompute in each direction), block-wise 1 + 3, naive 1 + 2.
EXECUTED_GEMMS = {"triton": 5, "blockwise": 4, "naive": 3}
#: Passes over the fp32 scores (read + write) outside the GEMMs, for time estimates only.
SCORE_PASSES = {"triton": 0, "blockwise": 16, "naive": 12}
USEFUL_GEMMS = 3
#: Fraction of the measured peak assumed for a path not yet measured.
ASSUMED_FRACTION = 0.4
#: Seconds assumed for compiling the Triton kernels before their first call on a GPU.
COMPILE_S = 20.0
#: Ceilings assumed when part_ceilings.py did not run (GPU: H100-like; rehearsal: a small CPU).
FALLBACK_CEILINGS = {
    "bf16_tflops": pick(400.0, 0.05),
    "tf32_tflops": pick(200.0, 0.05),
    "fp32_tflops": pick(40.0, 0.05),
    "copy_gb_s": pick(2000.0, 5.0),
}
GOAL_FRACTION = 0.5
#: The check's tolerances (relative L2, Triton vs block-wise): logits; gradients (bf16 Triton rounds
#: Q to bf16 before its backward GEMMs: about 4e-3 relative at toy sizes).
CHECK_TOLERANCE = 1e-2
GRADIENT_TOLERANCE = 5e-2
#: The naive path's peak ≈ 5.2 × its fp32 scores (4·N²·Mx·My bytes), read from torch's allocator
#: events on the CPU (bf16 and fp32 points, fwd+bwd); it is skipped above 60 % of the free memory.
NAIVE_PEAK_FACTOR = 5.2
NAIVE_MEMORY_FRACTION = 0.6
#: A planned path must fit in what is left with this factor of slack (estimates are rough).
SLACK = 1.25


# --- budget -----------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - process_seconds()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s * SLACK <= self.left()


# --- inputs and runners -----------------------------------------------------------------------


class Config:
    def __init__(self, n: int, mx: int, my: int, dim: int, dtype_name: str) -> None:
        self.n, self.mx, self.my, self.dim, self.dtype_name = n, mx, my, dim, dtype_name

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def gemm_flops(self) -> float:
        """One u·v GEMM over all pairs: 2·N²·Mx·My·d."""
        return 2.0 * self.n**2 * self.mx * self.my * self.dim

    @property
    def useful_flops(self) -> float:
        return USEFUL_GEMMS * self.gemm_flops

    @property
    def score_bytes(self) -> int:
        return 4 * self.n**2 * self.mx * self.my

    def label(self) -> str:
        return f"{self.dtype_name}, N={self.n} {self.mx}x{self.my}"

    def memory_bound(self) -> int:
        """The O(N² + N·M·d) memory goal's bytes: 32·N² + 24·N·(Mx + My)·d."""
        return 32 * self.n**2 + 24 * self.n * (self.mx + self.my) * self.dim


def point_sets(
    cfg: Config, dev: torch.device, n: int | None = None
) -> tuple[PointSet, PointSet, torch.Tensor]:
    """N anchors of Mx weighted unit points, N candidates of My unit points (``cfg.dtype``), γ = 1/0.07;
    all gradient leaves."""
    n = cfg.n if n is None else n
    generator = torch.Generator(device=dev).manual_seed(0)
    u = torch.randn(n, cfg.mx, cfg.dim, device=dev, generator=generator)
    v = torch.randn(n, cfg.my, cfg.dim, device=dev, generator=generator)
    u = torch.nn.functional.normalize(u, dim=-1).to(cfg.dtype)
    v = torch.nn.functional.normalize(v, dim=-1).to(cfg.dtype)
    weights = torch.rand(n, cfg.mx, device=dev, generator=generator) + 0.1
    gamma = torch.tensor(1 / 0.07, device=dev, requires_grad=True)
    return PointSet(u.requires_grad_(), weights.requires_grad_()), PointSet(v.requires_grad_()), gamma


def logits_of(impl: str, a: PointSet, b: PointSet, gamma: torch.Tensor) -> torch.Tensor:
    if impl == "naive":
        return kme_logits_naive(a, b, gamma)
    return kme_logits(a, b, gamma, implementation=impl)


def runner(impl: str, a: PointSet, b: PointSet, gamma: torch.Tensor):
    """One fwd+bwd call: the logits, backward of their sum, gradients dropped."""
    leaves = (a.points, a.weights, b.points, gamma)

    def run() -> None:
        logits_of(impl, a, b, gamma).sum().backward()
        for leaf in leaves:
            leaf.grad = None

    return run


def free_gpu_bytes() -> int | None:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


class matmul_precision:
    """torch's fp32 matmul precision for a block (fp32 configurations allow TF32: "high")."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def __enter__(self) -> None:
        self.previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.precision)

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision(self.previous)


def precision_for(cfg: Config) -> str:
    return "high" if cfg.dtype == torch.float32 else "highest"


# --- estimates --------------------------------------------------------------------------------


class Estimator:
    """Seconds per fwd+bwd call of a path: a model (executed GEMMs at 40 % of the peak its GEMMs run
    at, plus passes over the scores at the measured copy rate), calibrated by the path's own
    measured time on an earlier configuration of the same dtype."""

    def __init__(self, ceilings: dict[str, float]) -> None:
        self.ceilings = ceilings
        self.calibration: dict[tuple[str, str], float] = {}
        self.compiled: set[str] = set()

    def peak_key(self, impl: str, cfg: Config) -> str:
        if cfg.dtype == torch.float32:
            return "tf32_tflops"  # fp32 configurations run with TF32 allowed, every path
        return "bf16_tflops" if impl == "triton" else "fp32_tflops"  # block-wise/naive upcast to fp32

    def model(self, impl: str, cfg: Config) -> float:
        seconds = (
            EXECUTED_GEMMS[impl]
            * cfg.gemm_flops
            / (ASSUMED_FRACTION * self.ceilings[self.peak_key(impl, cfg)] * 1e12)
        )
        return seconds + SCORE_PASSES[impl] * 2 * cfg.score_bytes / (self.ceilings["copy_gb_s"] * 1e9)

    def call_s(self, impl: str, cfg: Config) -> tuple[float, str]:
        """(seconds per call, where the figure comes from)."""
        factor = self.calibration.get((impl, cfg.dtype_name))
        if factor is None:
            return self.model(impl, cfg), f"{ASSUMED_FRACTION:.0%} of the measured peak"
        return factor * self.model(impl, cfg), "its measured speed on a smaller size"

    def compile_s(self, impl: str, cfg: Config) -> float:
        first = impl == "triton" and cfg.dtype_name not in self.compiled and not kme_triton.interpreting()
        return pick(COMPILE_S, 0.0) if first else 0.0

    def measured(self, impl: str, cfg: Config, seconds: float) -> None:
        self.calibration[(impl, cfg.dtype_name)] = seconds / self.model(impl, cfg)


def plan_rounds(call_s: float) -> tuple[int, int]:
    """(warm-up calls, timed rounds) for a call of about ``call_s`` seconds."""
    if rehearsal():
        return 1, 3
    if call_s < 0.5:
        return 2, 5
    if call_s < 5:
        return 1, 3
    return 1, 2


# --- the check --------------------------------------------------------------------------------


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖; inf where x is not finite (a JSON figure must stay a number, not NaN)."""
    x, reference = x.detach().double(), reference.detach().double()
    error = float((x - reference).norm() / reference.norm().clamp_min(1e-300))
    return error if math.isfinite(error) else math.inf


def check_triton(cfg: Config, dev: torch.device) -> dict:
    """Triton vs block-wise once: logits and every gradient (random upstream gradient), rel. L2 error."""
    outputs = {}
    a, b, gamma = point_sets(cfg, dev)
    upstream = torch.randn(cfg.n, cfg.n, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    leaves = {"u": a.points, "w": a.weights, "v": b.points, "gamma": gamma}
    for impl in ("triton", "blockwise"):
        logits = logits_of(impl, a, b, gamma)
        (logits * upstream).sum().backward()
        outputs[impl] = {"logits": logits.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}
        for leaf in leaves.values():
            leaf.grad = None
    errors = {
        name: relative_error(outputs["triton"][name], outputs["blockwise"][name])
        for name in outputs["triton"]
    }
    finite = all(bool(torch.isfinite(t).all()) for t in outputs["triton"].values())
    gradients = max(value for name, value in errors.items() if name != "logits")
    return {
        "n": cfg.n,
        "shape": f"{cfg.mx}x{cfg.my}",
        "rel_errors": errors,
        "logits_rel_error": errors["logits"],
        "max_gradient_rel_error": gradients,
        "finite": finite,
        "ok": finite and errors["logits"] <= CHECK_TOLERANCE and gradients <= GRADIENT_TOLERANCE,
    }


# --- one configuration ------------------------------------------------------------------------


class Run:
    """The part's state: figures, skipped reasons, the budget and the estimates."""

    def __init__(self, args: argparse.Namespace, out: Path, dev: torch.device) -> None:
        self.args, self.out, self.dev = args, out, dev
        self.budget = Budget(args.budget_s)
        measured = read_ceilings(out)
        self.ceilings = {key: measured.get(key, fallback) for key, fallback in FALLBACK_CEILINGS.items()}
        self.ceilings_measured = "bf16_tflops" in measured
        self.estimator = Estimator(self.ceilings)
        self.figures: list[dict] = []
        self.skipped: list[str] = []
        self.checks: dict[str, dict] = {}
        self.check_tried: set[str] = set()
        self.pending: list[str] = []
        self.started = process_seconds()

    def skip(self, reason: str) -> None:
        print(f"  skipped: {reason}", flush=True)
        self.skipped.append(reason)

    def save(self) -> None:
        extra = {
            "checks": self.checks,
            "pending": self.pending,
            "budget_s": self.budget.seconds,
            "elapsed_s": round(process_seconds(), 1),
            "ceilings": {**self.ceilings, "measured": self.ceilings_measured},
            "flop_count": "useful FLOPs = 3 GEMMs' worth = 3·2·N²·Mx·My·d per fwd+bwd",
        }
        write_part(self.out, "kme", self.figures, skipped=self.skipped, extra=extra)

    def suspect_note(self, cfg: Config) -> str:
        check = self.checks.get(cfg.dtype_name)
        if check is None:
            return " SUSPECT: Triton was not checked against block-wise for this dtype."
        if not check["ok"]:
            return (
                f" SUSPECT: Triton vs block-wise rel. error logits {check['logits_rel_error']:.2e}, "
                f"gradients {check['max_gradient_rel_error']:.2e}"
                f"{'' if check['finite'] else ', non-finite values'} at N={check['n']} {check['shape']}."
            )
        return ""

    def run_check(self, cfg: Config) -> None:
        """Triton vs block-wise at ``cfg`` (its N cut until block-wise fwd+bwd is estimated ≤ 2 s)."""
        n = cfg.n
        while (
            n > 8
            and self.estimator.call_s("blockwise", Config(n, cfg.mx, cfg.my, cfg.dim, cfg.dtype_name))[0] > 2
        ):
            n //= 2
        small = Config(n, cfg.mx, cfg.my, cfg.dim, cfg.dtype_name)
        cost = self.estimator.compile_s("triton", small) + 2 * sum(
            self.estimator.call_s(impl, small)[0] for impl in ("triton", "blockwise")
        )
        if not self.budget.fits(cost):
            self.skip(
                f"triton check {small.label()}: estimated {cost:.0f} s > {self.budget.left():.0f} s left"
            )
            return
        began = time.perf_counter()
        try:
            with matmul_precision(precision_for(small)):
                check = check_triton(small, self.dev)
        except Exception as error:  # one failure must not lose the other figures
            self.skip(f"triton check {small.label()}: {type(error).__name__}: {error}")
            return
        finally:
            free_memory()
        self.estimator.compiled.add(cfg.dtype_name)
        self.checks[cfg.dtype_name] = check
        errors = ", ".join(f"{name} {value:.1e}" for name, value in check["rel_errors"].items())
        print(
            f"check triton vs blockwise {small.label()}: rel. errors {errors}; finite {check['finite']}; "
            f"{'ok' if check['ok'] else 'SUSPECT'} ({time.perf_counter() - began:.1f} s incl. compile)",
            flush=True,
        )
        finite = "" if check["finite"] else " NON-FINITE values in Triton's output or gradients."
        self.figures.append(
            figure(
                f"KME triton vs blockwise logits rel. error, {small.label()}",
                check["logits_rel_error"],
                "relative L2",
                goal=f"<= {CHECK_TOLERANCE:g} and finite",
                met=check["logits_rel_error"] <= CHECK_TOLERANCE and check["finite"],
                note="the first configuration, before timing" + finite,
            )
        )
        self.figures.append(
            figure(
                f"KME triton vs blockwise max gradient rel. error, {small.label()}",
                check["max_gradient_rel_error"],
                "relative L2",
                goal=f"<= {GRADIENT_TOLERANCE:g} and finite",
                met=check["max_gradient_rel_error"] <= GRADIENT_TOLERANCE and check["finite"],
                note="gradients of u, w, v, γ under a random upstream gradient: " + errors + finite,
            )
        )

    def plan(self, cfg: Config, impls: list[str]) -> dict[str, tuple[int, int, float]]:
        """{impl: (warm-up, rounds, seconds per call)} of the paths that fit; the others skipped."""
        candidates = {}
        for impl in impls:
            if impl == "naive":
                free = free_gpu_bytes()
                need = NAIVE_PEAK_FACTOR * cfg.score_bytes
                if free is not None and need > NAIVE_MEMORY_FRACTION * free:
                    self.skip(
                        f"naive {cfg.label()}: estimated peak {NAIVE_PEAK_FACTOR} × its fp32 scores = "
                        f"{need / 2**30:.1f} GiB > "
                        f"{NAIVE_MEMORY_FRACTION:.0%} of the {free / 2**30:.1f} GiB free"
                    )
                    continue
            call_s, source = self.estimator.call_s(impl, cfg)
            candidates[impl] = (call_s, source)
        planned: dict[str, tuple[int, int, float]] = {}
        spent = 0.0
        for impl, (call_s, source) in sorted(candidates.items(), key=lambda item: item[1][0]):
            warmup, rounds = plan_rounds(call_s)
            compile_s = self.estimator.compile_s(impl, cfg)
            while rounds > 1 and not self.budget.fits(spent + compile_s + (warmup + rounds) * call_s):
                rounds -= 1
            cost = compile_s + (warmup + rounds) * call_s
            if not self.budget.fits(spent + cost):
                self.skip(
                    f"{impl} {cfg.label()}: estimated {cost:.1f} s ({warmup + rounds} calls of "
                    f"≈ {call_s:.2f} s, from {source}) > {self.budget.left() - spent:.1f} s left "
                    f"of the {self.budget.seconds:.0f} s budget"
                )
                continue
            spent += cost
            planned[impl] = (warmup, rounds, call_s)
        return planned

    def measure(self, cfg: Config, impls: list[str]) -> None:
        print(
            f"config {cfg.label()}: useful {cfg.useful_flops / 1e12:.2f} TFLOP per call, "
            f"{self.budget.left():.1f} s left",
            flush=True,
        )
        planned = self.plan(cfg, impls)
        if not planned:
            return
        a, b, gamma = point_sets(cfg, self.dev)
        runs = {impl: runner(impl, a, b, gamma) for impl in planned}
        peaks: dict[str, int | None] = {}
        call_times: dict[str, float] = {}
        for impl, (warmup, _, call_s) in planned.items():
            if not self.budget.fits(self.estimator.compile_s(impl, cfg) + warmup * call_s):
                self.skip(f"{impl} {cfg.label()}: warm-up not started, {self.budget.left():.1f} s left")
                continue
            failure = None
            try:
                began = time.perf_counter()
                peaks[impl] = peak_memory(runs[impl])
                first_s = last_s = time.perf_counter() - began
                for _ in range(warmup - 1):
                    began = time.perf_counter()
                    runs[impl]()
                    synchronize()
                    last_s = time.perf_counter() - began
            except Exception as error:  # OOM or a kernel failure: keep the other paths
                failure = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            if failure is not None:  # outside the except block, so the failed call's frames are gone
                self.skip(f"{impl} {cfg.label()}: {failure}")
                for leaf in (a.points, a.weights, b.points, gamma):
                    leaf.grad = None
                free_memory()
                continue
            if impl == "triton":
                self.estimator.compiled.add(cfg.dtype_name)
            call_times[impl] = last_s
            peak = peaks[impl]
            memory = "" if peak is None else f", peak {peak / 2**20:.0f} MiB"
            print(f"  {impl}: warm-up {first_s:.2f} s (last call {last_s:.2f} s){memory}", flush=True)
        # Re-plan the rounds from the measured warm-up calls, cheapest path first.
        warm: dict[str, tuple[int, float]] = {}
        spent = 0.0
        for impl, call_s in sorted(call_times.items(), key=lambda item: item[1]):
            rounds = planned[impl][1]
            while rounds > 1 and not self.budget.fits(spent + rounds * call_s):
                rounds -= 1
            if not self.budget.fits(spent + rounds * call_s):
                self.skip(
                    f"{impl} {cfg.label()} timing: a warm-up call took {call_s:.1f} s, "
                    f"{self.budget.left() - spent:.1f} s left (peak memory kept)"
                )
                continue
            spent += rounds * call_s
            warm[impl] = (rounds, call_s)
        times = self.interleaved(cfg, {impl: runs[impl] for impl in warm}, warm)
        for impl, values in times.items():
            if values:
                self.estimator.measured(impl, cfg, median(values) / 1e3)
                self.time_figures(impl, cfg, values, planned[impl][0])
        for impl, peak in peaks.items():
            self.memory_figure(impl, cfg, peak)
        del a, b, gamma, runs
        free_memory()

    def interleaved(
        self, cfg: Config, runs: dict, warm: dict[str, tuple[int, float]]
    ) -> dict[str, list[float]]:
        """Rounds of one call per path (a path with fewer planned rounds drops out early); a call
        that would overrun the budget is not started."""
        times: dict[str, list[float]] = {impl: [] for impl in runs}
        for index in range(max((rounds for rounds, _ in warm.values()), default=0)):
            for impl, run in runs.items():
                rounds, call_s = warm[impl]
                if index >= rounds:
                    continue
                if not self.budget.fits(call_s):
                    self.skip(f"{impl} {cfg.label()}: round {index + 1} of {rounds} not started (budget)")
                    warm[impl] = (index, call_s)
                    continue
                failure = None
                try:
                    times[impl].extend(time_ms(run, warmup=0, repeats=1))
                except Exception as error:
                    failure = (
                        f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
                    )
                if failure is not None:
                    self.skip(f"{impl} {cfg.label()} round {index + 1}: {failure}")
                    warm[impl] = (index, call_s)
                    free_memory()
        return times

    def time_figures(self, impl: str, cfg: Config, values: list[float], warmup: int) -> None:
        ms = median(values)
        tflops = cfg.useful_flops / (ms * 1e-3) / 1e12
        bf16_peak = self.ceilings["bf16_tflops"]
        percent = 100 * tflops / bf16_peak
        own_key = self.estimator.peak_key(impl, cfg)
        own_name = own_key.split("_")[0]
        own = f"{100 * tflops / self.ceilings[own_key]:.0f} % of the {own_name} peak its GEMMs run at"
        peak_source = "measured" if self.ceilings_measured else "ASSUMED (ceilings.json missing)"
        rounds = (
            f"median of {len(values)} interleaved rounds ({min(values):.1f}–{max(values):.1f} ms) "
            f"after {warmup} warm-up"
        )
        suspect = self.suspect_note(cfg) if impl == "triton" else ""
        judged = impl == "triton" and cfg.dtype == torch.bfloat16
        label = f"KME fwd+bwd {impl} {cfg.label()}"
        print(
            f"  {impl}: {ms:.2f} ms, {tflops:.1f} TFLOP/s useful = {percent:.1f} % of bf16 peak ({own})",
            flush=True,
        )
        self.figures.append(figure(f"{label} time", ms, "ms", note=rounds + suspect))
        self.figures.append(
            figure(
                f"{label} TFLOP/s",
                tflops,
                "TFLOP/s",
                note=f"useful FLOPs 3·2·N²·Mx·My·d = {cfg.useful_flops:.3g}; {own}" + suspect,
            )
        )
        self.figures.append(
            figure(
                f"{label} % of bf16 peak",
                percent,
                "% of bf16 peak",
                goal=f">= {GOAL_FRACTION:.0%} of bf16 peak" if judged else None,
                met=(percent >= 100 * GOAL_FRACTION and not suspect) if judged else None,
                note=f"bf16 peak {bf16_peak:.4g} TFLOP/s ({peak_source})" + suspect,
            )
        )

    def memory_figure(self, impl: str, cfg: Config, peak: int | None) -> None:
        if peak is None:
            return  # CPU: not measured (said once in skipped)
        bound = cfg.memory_bound()
        judged = impl == "triton" and cfg.dtype == torch.bfloat16
        print(
            f"  {impl}: peak memory {peak / 2**20:.1f} MiB (O(N² + N·M·d) bound {bound / 2**20:.1f} MiB)",
            flush=True,
        )
        self.figures.append(
            figure(
                f"KME fwd+bwd {impl} {cfg.label()} peak memory",
                peak / 2**20,
                "MiB",
                goal=f"<= {bound / 2**20:.0f} MiB = 32·N² + 24·N·(Mx+My)·d bytes" if judged else None,
                met=peak <= bound if judged else None,
                note=f"above the inputs; the naive fp32 scores alone: {cfg.score_bytes / 2**20:.0f} MiB",
            )
        )


# --- main -------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        mx, my = item.lower().split("x")
        shapes.append((int(mx), int(my)))
    return shapes


def name_list(text: str, known) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = set(names) - set(known)
    if unknown:
        raise SystemExit(f"unknown {sorted(unknown)}; known: {list(known)}")
    return names


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (the part writes kme.json)")
    parser.add_argument("--sizes", default=os.environ.get("CLIPKIT_KME_SIZES") or pick("256,384,512", "8"))
    parser.add_argument("--shapes", default=pick("197x77,50x50", "5x4"), help="Mx x My point counts")
    parser.add_argument("--dtypes", default="bf16,fp32", help="point dtypes, bf16 first (fp32 with TF32)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--dim", type=int, default=pick(512, 32))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("CLIPKIT_KME_BUDGET_S") or 90),
        help="seconds from process start, compile included",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    dev = device()
    run = Run(args, args.out, dev)
    sizes, shapes = int_list(args.sizes), shape_list(args.shapes)
    dtypes, impls = name_list(args.dtypes, DTYPES), name_list(args.impls, IMPLS)
    print(
        f"kme: {dev}, sizes {sizes}, shapes {shapes}, dtypes {dtypes}, d={args.dim}, "
        f"budget {args.budget_s:.0f} s "
        f"({process_seconds():.1f} s spent starting); ceilings "
        + ", ".join(f"{key} {value:g}" for key, value in run.ceilings.items())
        + ("" if run.ceilings_measured else " (ASSUMED: ceilings.json missing)"),
        flush=True,
    )
    if not run.ceilings_measured:
        run.skip("ceilings.json missing: % of bf16 peak uses an ASSUMED peak and estimates are rough")
    if dev.type != "cuda":
        run.skip("peak memory: not measured on the CPU (rehearsal)")
    if "triton" in impls and not (
        kme_triton.available() and (dev.type == "cuda" or kme_triton.interpreting())
    ):
        why = (
            "triton does not import"
            if not kme_triton.available()
            else "its kernels need CUDA (or TRITON_INTERPRET=1)"
        )
        run.skip(f"triton: not run on {dev.type}: {why}")
        impls.remove("triton")

    # Cheapest first within a dtype; bf16 (the goal) before fp32.
    configs = sorted(
        (Config(n, mx, my, args.dim, name) for name in dtypes for n in sizes for mx, my in shapes),
        key=lambda cfg: (dtypes.index(cfg.dtype_name), cfg.gemm_flops),
    )
    run.pending = [cfg.label() for cfg in configs]
    run.save()
    for cfg in configs:
        with matmul_precision(precision_for(cfg)):
            if "triton" in impls and cfg.dtype_name not in run.check_tried:
                run.check_tried.add(cfg.dtype_name)
                run.run_check(cfg)
            try:
                run.measure(cfg, impls)
            except Exception as error:  # keep the other configurations' figures
                run.skip(f"{cfg.label()}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
                free_memory()
        run.pending.remove(cfg.label())
        run.save()
    if not run.figures:
        run.skip("no configuration fitted the budget")
        run.save()
    print(f"kme: done in {process_seconds():.1f} s of the {args.budget_s:.0f} s budget", flush=True)


if __name__ == "__main__":
    main()
