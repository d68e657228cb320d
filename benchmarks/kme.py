"""KME-CLIP logits: block-wise path vs the naive einsum, time and peak memory; WPSE fused vs unfused pooling.

(a) ``kme_logits_naive``: materialises the [N, N, M, M] scores (plain autograd).
(b) ``kme_logits(implementation="blockwise")``: tiles of ~2^20 scores, custom
    backward (plugins/similarities/kme.py).
Both on the same inputs: N anchors and N candidates of M unit points each (d = 512, the anchors
weighted), γ = 1/0.07, inputs requiring grad. "forward" = logits; "fwd+bwd" = logits, then
backward of their sum. Peak memory = the largest number of bytes torch's allocator held at once
above the inputs (``clipkit.train.memory.peak_allocated_bytes``, from profiler allocation events).

The naive path is not run where its estimated peak exceeds ``--naive-cap-gib``: the estimate is
(bytes of one fp32 score tensor, 4·N²·Mx·My) × the ratio peak / score-tensor bytes of the largest
naive run of the same pass so far (the grid runs small sizes first). Configurations whose
block-wise forward exceeds ``--flop-budget`` TFLOP are listed, not run.
Configurations expected to take over 5 s run once, timed inside the profiled run; cheaper ones are
timed best-of-``--repeats`` after a warm-up, then profiled once more for memory.

Times are process CPU seconds, median (min–max) over ``--repeats`` interleaved rounds; "× speed"
is the median (min–max) over rounds of naive / block-wise within the same round.

    python benchmarks/kme.py [--threads 1] [--dim 512] [--naive-cap-gib 6] [--flop-budget 0.2]
        [--paper] [--repeats 3] [--skip-tiles] [--skip-wpse] [--only-wpse] [--quick]
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
from measure import cpu_seconds, interleaved, machine_line, markdown_row, ratio_spread, spread

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities import kme
from clipkit.plugins.similarities.kme import kme_logits, kme_logits_naive
from clipkit.plugins.similarities.wpse import pooled_random_features, pooled_random_features_unfused
from clipkit.train.memory import peak_allocated_bytes

GRID_N = (64, 256, 1024, 4096)
GRID_M = (1, 10, 50, 197)
#: Beyond the grid: the paper's shapes (197 image × 77 text points) and one size where the naive
#: path cannot run on this box but the block-wise one can.
EXTRA = ((64, 197, 77), (512, 50, 50))
GIB = 1 << 30
DEFAULT_TILE_SCORES = kme.TILE_SCORES
DEFAULT_TILE_EXPONENT = DEFAULT_TILE_SCORES.bit_length() - 1
#: The paper's shapes (``--paper``): N = 64 … 256 sets of 197 image × 77 text points, and 50 × 50.
#: (128 × 197 × 77 is left out: its naive run needs ≈ 6 GiB and 4 min of one core per round.)
PAPER = ((64, 197, 77), (64, 50, 50), (128, 50, 50), (256, 50, 50))
TILE_SHAPES = ((64, 197, 77), (64, 50, 50), (128, 50, 50))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 = per core)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument(
        "--naive-cap-gib", type=float, default=6.0, help="skip naive above this estimated peak"
    )
    parser.add_argument("--flop-budget", type=float, default=0.2, help="TFLOP of one forward, grid cells")
    parser.add_argument("--extra-flop-budget", type=float, default=0.7, help="TFLOP of one forward, EXTRA")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: N <= 256, M <= 10, no EXTRA")
    parser.add_argument(
        "--paper", action="store_true", help="only the paper's shapes (PAPER), then tiles and WPSE"
    )
    parser.add_argument("--skip-tiles", action="store_true", help="no tile-size sweep")
    parser.add_argument("--skip-wpse", action="store_true", help="no WPSE pooling rows")
    parser.add_argument("--only-wpse", action="store_true", help="only the WPSE pooling rows")
    return parser.parse_args()


def point_sets(n: int, mx: int, my: int, dim: int) -> tuple[PointSet, PointSet, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(n, mx, dim, generator=generator), dim=-1)
    v = torch.nn.functional.normalize(torch.randn(n, my, dim, generator=generator), dim=-1)
    weights = torch.rand(n, mx, generator=generator) + 0.1
    gamma = torch.tensor(1 / 0.07, requires_grad=True)
    return PointSet(u.requires_grad_(), weights.requires_grad_()), PointSet(v.requires_grad_()), gamma


def measure(runs: list, expected_seconds: float, repeats: int) -> list[tuple[list[float], int]]:
    """[(CPU seconds per round, peak bytes)] of each of ``runs``: a warm-up, then ``repeats`` rounds,
    each running every run once (a, b, a, b, ...: load from other jobs hits both alike), timed in
    process CPU time (``time.process_time``: waiting for a shared core does not count). Runs
    expected to take over 5 s skip the warm-up. Memory from one more, profiled run."""
    if expected_seconds <= 5:
        for run in runs:
            run()  # warm-up
    calls = {str(index): (lambda run=run: cpu_seconds(run)) for index, run in enumerate(runs)}
    seconds = interleaved(calls, repeats, shuffle=False)
    return [(seconds[str(index)], peak_allocated_bytes(run)[1]) for index, run in enumerate(runs)]


def ratio(slow: list[float], fast: list[float]) -> str:
    """Median (min–max) over rounds of slow/fast within the same round."""
    return ratio_spread(slow, fast, 2)


def kme_case(logits_fn, a, b, gamma, backward: bool):
    def run():
        logits = logits_fn(a, b, gamma)
        if backward:
            logits.sum().backward()
        for leaf in (a.points, a.weights, b.points, gamma):
            leaf.grad = None

    return run


def blockwise(a, b, gamma):
    return kme_logits(a, b, gamma, implementation="blockwise")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    gemm_rate = measure_gemm_rate(args.dim)
    configs = [(n, m, m) for n in GRID_N for m in GRID_M]
    budgets = {config: args.flop_budget for config in configs}
    if args.only_wpse:
        print_header(args, gemm_rate)
        wpse_rows(args)
        return
    if args.paper:
        configs = list(PAPER)
        budgets = {config: args.extra_flop_budget for config in configs}
    elif args.quick:
        configs = [(n, mx, my) for n, mx, my in configs if n <= 256 and mx <= 10]
    else:
        configs += list(EXTRA)
        budgets.update({config: args.extra_flop_budget for config in EXTRA})
    print_header(args, gemm_rate)
    print(
        "| N | Mx × My | pass | naive CPU s | blockwise CPU s | × speed (same round) | naive peak "
        "| blockwise peak | memory ÷ |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    # Per pass: (score-tensor bytes, naive peak / those bytes) of the largest naive run so far.
    largest = {False: (0, 0.0), True: (0, 0.0)}
    for n, mx, my in configs:
        flops = 2 * n * n * mx * my * args.dim
        score_bytes = 4 * n * n * mx * my
        if flops > budgets[(n, mx, my)] * 1e12:
            minutes = 5 * flops / gemm_rate / 60  # forward, then fwd+bwd (4 GEMM-equivalents)
            reason = f"not run: {flops / 1e12:.1f} TFLOP per forward (≈ {minutes:.0f} min for both passes)"
            row(n, f"{mx} × {my}", "both", reason, "", "", "", "", "")
            continue
        a, b, gamma = point_sets(n, mx, my, args.dim)
        for backward in (False, True):
            # GEMM-equivalents: forward 1; fwd+bwd 4 (forward, the recompute, Q @ V and Qᵀ @ U).
            expected = (4 if backward else 1) * flops / gemm_rate
            name = "fwd+bwd" if backward else "forward"
            fast_run = kme_case(blockwise, a, b, gamma, backward)
            estimate = largest[backward][1] * score_bytes
            if estimate > args.naive_cap_gib * GIB:
                [(fast_s, fast_peak)] = measure([fast_run], expected, args.repeats)
                skipped = f"OOM/skipped (would need ≈ {estimate / GIB:.0f} GiB)"
                row(n, f"{mx} × {my}", name, skipped, spread(fast_s), "—", "—", format_bytes(fast_peak), "—")
                continue
            slow_run = kme_case(kme_logits_naive, a, b, gamma, backward)
            (slow_s, slow_peak), (fast_s, fast_peak) = measure([slow_run, fast_run], expected, args.repeats)
            if score_bytes > largest[backward][0]:
                largest[backward] = (score_bytes, slow_peak / score_bytes)
            row(
                n,
                f"{mx} × {my}",
                name,
                spread(slow_s),
                spread(fast_s),
                ratio(slow_s, fast_s),
                format_bytes(slow_peak),
                format_bytes(fast_peak),
                f"{slow_peak / max(fast_peak, 1):.1f}",
            )
    if not (args.quick or args.skip_tiles):
        tile_sweep(args)
    if not args.skip_wpse:
        wpse_rows(args)


def tile_sweep(args: argparse.Namespace) -> None:
    """fwd+bwd seconds of the block-wise path for several ``TILE_SCORES`` (timed interleaved)."""
    exponents = (16, 18, 20, 22)
    print()
    print(
        "Block-wise fwd+bwd CPU seconds by tile size (automatic tiles of TILE_SCORES scores); "
        f"[this time / default 2^{DEFAULT_TILE_EXPONENT} time, same round]"
    )
    print()
    print("| N | Mx × My | " + " | ".join(f"2^{e}" for e in exponents) + " |")
    print("|---|---|" + "---|" * len(exponents))
    for n, mx, my in TILE_SHAPES:
        a, b, gamma = point_sets(n, mx, my, args.dim)

        def run(exponent, a=a, b=b, gamma=gamma):
            kme.TILE_SCORES = 1 << exponent
            kme_case(blockwise, a, b, gamma, backward=True)()

        results = measure([partial(run, e) for e in exponents], 0.0, args.repeats)
        kme.TILE_SCORES = DEFAULT_TILE_SCORES
        default = results[exponents.index(DEFAULT_TILE_EXPONENT)][0]
        row(n, f"{mx} × {my}", *(f"{spread(seconds)} [{ratio(seconds, default)}]" for seconds, _ in results))


def wpse_rows(args: argparse.Namespace) -> None:
    """WPSE random-feature pooling of B = 256 sets of 197 points, d = 512, D = 512 features."""
    batch, points, features = (32, 50, 256) if args.quick else (256, 197, 512)
    generator = torch.Generator().manual_seed(1)
    x = torch.nn.functional.normalize(torch.randn(batch, points, args.dim, generator=generator), dim=-1)
    x.requires_grad_()
    weights = torch.full((batch, points), 1 / points, requires_grad=True)
    omega = torch.randn(args.dim, features, generator=generator) / 0.3
    beta = torch.rand(features, generator=generator) * 2 * math.pi
    print()
    shape = f"B = {batch}, M = {points}, d = {args.dim}, D = {features}"
    print(f"WPSE pooling z̄ = Σ w·sqrt(2/D)·cos(xω + β): {shape}")
    print()
    print(
        "| pass | unfused CPU s | fused CPU s | × speed (same round) | unfused peak | fused peak | memory ÷ |"
    )
    print("|---|---|---|---|---|---|---|")
    for backward in (False, True):
        runs = []
        for pool in (pooled_random_features_unfused, partial(pooled_random_features, fused=True)):

            def run(pool=pool, backward=backward):
                pooled = pool(x, weights, omega, beta)
                if backward:
                    pooled.sum().backward()
                x.grad = weights.grad = None

            runs.append(run)
        results = measure(runs, 0.0, args.repeats)
        (slow, slow_peak), (fast, fast_peak) = results
        print(
            f"| {'fwd+bwd' if backward else 'forward'} | {spread(slow)} | {spread(fast)} | "
            f"{ratio(slow, fast)} | {format_bytes(slow_peak)} | {format_bytes(fast_peak)} | "
            f"{slow_peak / max(fast_peak, 1):.0f} |"
        )


def measure_gemm_rate(dim: int) -> float:
    """FLOP/s of one [1024, d] × [d, 1024] fp32 GEMM (the block-wise path's tile), best of 5."""
    a, b = torch.randn(1024, dim), torch.randn(dim, 1024)
    a @ b
    best = min(cpu_seconds(lambda: a @ b) for _ in range(5))
    return 2 * 1024 * 1024 * dim / best


def row(*cells) -> None:
    print(markdown_row(*cells), flush=True)


def format_bytes(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / (1 << 20):.1f} MiB"


def print_header(args: argparse.Namespace, gemm_rate: float) -> None:
    print(f"{machine_line(load=False)}, d = {args.dim}, fp32")
    print(f"fp32 GEMM [1024, {args.dim}] × [{args.dim}, 1024]: {gemm_rate / 1e9:.0f} GFLOP/s")
    print()


if __name__ == "__main__":
    main()
