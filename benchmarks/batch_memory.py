"""Contrastive batch vs memory: the full N×N path against the tiled path (``train.tiled``).

For each similarity + loss pair and growing N, similarity + loss forward + backward runs in a fresh
process (so one point's allocations never flatter the next); rounds are interleaved (every N and
path once per round) and reported as ranges. Per point: the peak memory above what the inputs
already take (CPU: peak RSS − RSS before the step, from ``getrusage``/``/proc``; CUDA:
``torch.cuda.max_memory_allocated`` − allocated before) and the time (CPU: process CPU time;
CUDA: wall time after synchronising). The fitted exponent k of memory ≈ c·N^k comes from a
least-squares line through log(median memory) vs log N; "largest N in --budget-gib" extrapolates
that fit (it is not measured there).

    python benchmarks/batch_memory.py [--sizes 1024,2048,4096,8192] [--dim 128] [--rounds 3]
        [--pairs dot+infonce,dot+siglip,hopfield+cloob,kme+infonce,wpse+infonce] [--tile 1024]
        [--device cpu|cuda] [--threads 1] [--budget-gib 16] [--out batch_memory.jsonl]
    python benchmarks/batch_memory.py --summarize batch_memory.jsonl   # tables of the recorded points
    python benchmarks/batch_memory.py --demo 262144 --dim 128 --tile 4096   # one tiled InfoNCE step
    python benchmarks/batch_memory.py --demo 262144 --local-rows 4096 ...   # one process's share of it

A pair whose plugins have no tiled form shows the refusal instead of a tiled row. The full path is
skipped where its estimated peak (24 bytes per logit) would exceed --max-gib (this machine's safety).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

PAIRS = "dot+infonce,dot+siglip,hopfield+cloob,kme+infonce,wpse+infonce"
#: Bytes per logit the full path holds at its peak (i2t, t2i, softmax, gradients: the memory
#: estimate's figure, clipkit.train.memory_fit); a point above --max-gib is not run.
FULL_BYTES_PER_LOGIT = 24


def build(pair: str, dim: int):
    """(similarity, loss, points per set) for ``pair``."""
    from clipkit.plugins.losses.baseline_losses import SigLIPLoss
    from clipkit.plugins.losses.cloob import CLOOBLoss
    from clipkit.plugins.losses.infonce import InfoNCE
    from clipkit.plugins.similarities.dot import DotSimilarity
    from clipkit.plugins.similarities.hopfield import HopfieldSimilarity
    from clipkit.plugins.similarities.kme import KMESimilarity
    from clipkit.plugins.similarities.wpse import WPSESimilarity

    similarity_name, loss_name = pair.split("+")
    similarities = {
        "dot": lambda: DotSimilarity(init_scale=10.0, bias=-10.0 if loss_name == "siglip" else None),
        "hopfield": lambda: HopfieldSimilarity(),
        "kme": lambda: KMESimilarity(),
        "wpse": lambda: WPSESimilarity(embed_dim=dim, num_features=256),
    }
    losses = {"infonce": InfoNCE, "siglip": SigLIPLoss, "cloob": CLOOBLoss}
    points = 4 if similarity_name in ("kme", "wpse") else 1
    return similarities[similarity_name](), losses[loss_name](), points


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_point(pair: str, path: str, n: int, dim: int, tile: int, device: str, threads: int) -> dict:
    """One forward + backward of similarity + loss at batch n; runs in its own process."""
    import torch

    from clipkit.contract.types import PointSet
    from clipkit.tiled import refusal

    torch.set_num_threads(threads)
    similarity, loss, points = build(pair, dim)
    similarity = similarity.to(device)
    if path == "tiled" and refusal(loss, similarity):
        return {"refused": refusal(loss, similarity)}
    generator = torch.Generator().manual_seed(0)

    def point_set() -> PointSet:
        values = torch.nn.functional.normalize(torch.randn(n, points, dim, generator=generator), dim=-1)
        return PointSet(values.to(device).requires_grad_())

    a, b = point_set(), point_set()
    targets = torch.arange(n, device=device)
    cuda = device.startswith("cuda")
    # One untimed pass of the same path on 64 rows first: lazy imports, autograd set-up and (CUDA)
    # kernel loading are paid once per process, not per step, and must not count against N.
    warm = min(n, 64)
    step(path, loss, similarity, a.rows(0, warm), b.rows(0, warm), targets[:warm], min(tile, warm))
    a.points.grad = b.points.grad = None
    similarity.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    before_rss = rss_bytes()
    started_cpu, started_wall = time.process_time(), time.perf_counter()
    out = step(path, loss, similarity, a, b, targets, tile)
    if cuda:
        torch.cuda.synchronize()
    result = {
        "cpu_s": time.process_time() - started_cpu,
        "wall_s": time.perf_counter() - started_wall,
        "loss": float(out.loss.detach()),
    }
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - before
    else:
        result["peak_bytes"] = max(0, peak_rss_bytes() - before_rss)
    return result


def step(path: str, loss, similarity, a, b, targets, tile: int):
    """Similarity + loss forward and backward on the full or the tiled path -> the LossOutput."""
    from clipkit.contract.types import LossContext
    from clipkit.tiled import tiled_global_loss

    if path == "full":
        out = loss(similarity(a, b), targets, LossContext())
    else:
        out = tiled_global_loss(loss, similarity, a, b, LossContext(), tile_size=tile)
    out.loss.backward()
    return out


def run_point(args, pair: str, path: str, n: int) -> dict:
    """``measure_point`` in a fresh interpreter (its peak RSS is its own)."""
    command = [sys.executable, __file__, "--point", pair, path, str(n), "--dim", str(args.dim)]
    command += ["--tile", str(args.tile), "--device", args.device, "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"failed": f"exit {done.returncode}: {tail[:100]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def fitted_exponent(sizes: list[int], values: list[float]) -> tuple[float, float] | None:
    """(k, log c) of the least-squares line log v = k·log N + log c; None with < 2 positive points."""
    pairs = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v > 0]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / sum((x - mean_x) ** 2 for x, _ in pairs)
    return slope, mean_y - slope * mean_x


def fmt_range(values: list[float], unit: float, digits: int = 2) -> str:
    low, high = min(values) / unit, max(values) / unit
    return (
        f"{low:.{digits}f}"
        if math.isclose(low, high, rel_tol=0.005)
        else f"{low:.{digits}f}–{high:.{digits}f}"
    )


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def sweep(args) -> None:
    """Run every (pair, N, path) once per round, appending each point to --out as it finishes."""
    sizes = [int(s) for s in args.sizes.split(",")]
    with open(args.out, "a") as out:
        for round_index in range(args.rounds):
            for pair in args.pairs.split(","):
                for n in sizes:
                    for path in ("full", "tiled") if round_index % 2 == 0 else ("tiled", "full"):
                        if path == "full" and FULL_BYTES_PER_LOGIT * n * n > args.max_gib * 2**30:
                            result = {"skipped": f"full path would exceed --max-gib {args.max_gib:g}"}
                        else:
                            result = run_point(args, pair, path, n)
                        record = {"pair": pair, "path": path, "n": n, "round": round_index, **result}
                        out.write(json.dumps(record) + "\n")
                        out.flush()
    summarize(args.out, args.device, args.budget_gib)


def summarize(path: str, device: str, budget_gib: float) -> None:
    """The tables of docs/benchmarks.md from the points recorded in ``path`` (JSON lines)."""
    with open(path) as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    budget, key = budget_gib * 2**30, "wall_s" if device.startswith("cuda") else "cpu_s"
    results: dict[tuple[str, str, int], list[dict]] = {}
    for record in records:
        results.setdefault((record["pair"], record["path"], record["n"]), []).append(record)
    rounds = max((r["round"] for r in records), default=0) + 1
    print(f"{len(records)} points, {rounds} round(s), device {device}")
    print("| pair | path | N | peak memory above inputs (MiB) | time (s) |")
    print("|---|---|---|---|---|")
    for (pair, path, n), points in sorted(
        results.items(), key=lambda item: (item[0][0], item[0][2], item[0][1])
    ):
        measured = [p for p in points if "peak_bytes" in p]
        if measured:
            memory = fmt_range([p["peak_bytes"] for p in measured], 2**20, 1)
            print(f"| {pair} | {path} | {n} | {memory} | {fmt_range([p[key] for p in measured], 1.0)} |")
        else:
            reason = next(iter(p.get("refused") or p.get("failed") or p.get("skipped") for p in points))
            print(f"| {pair} | {path} | {n} | {reason} | |")
    print()
    print(
        "| pair | path | memory exponent k | largest N in budget (extrapolated) | tiled / full time per N |"
    )
    print("|---|---|---|---|---|")
    for pair in sorted({p for p, _, _ in results}):
        for path in ("full", "tiled"):
            sizes = sorted(n for p, q, n in results if p == pair and q == path)
            fit_sizes, fit_values, ratios = [], [], []
            for n in sizes:
                measured = [p for p in results[(pair, path, n)] if "peak_bytes" in p]
                if measured:
                    fit_sizes.append(n)
                    fit_values.append(median([p["peak_bytes"] for p in measured]))
                other = [p for p in results.get((pair, "full", n), []) if key in p]
                if path == "tiled" and measured and other:
                    ratios.append(median([p[key] for p in measured]) / median([p[key] for p in other]))
            fit = fitted_exponent(fit_sizes, fit_values)
            if fit is None:
                print(f"| {pair} | {path} | – | – | – |")
                continue
            k, log_c = fit
            # A flat fit (k < 0.5) is the allocator's fixed overhead, not growth: no extrapolation.
            largest = f"{math.exp((math.log(budget) - log_c) / k):,.0f}" if k >= 0.5 else "not N-bound here"
            ratio = ", ".join(f"{r:.2f}" for r in ratios) if ratios else "–"
            print(f"| {pair} | {path} | {k:.2f} | {largest} | {ratio} |")


def demo(args) -> None:
    """One tiled InfoNCE forward + backward at batch ``args.demo`` in this process, with progress."""
    import torch

    from clipkit.contract.types import LossContext, PointSet
    from clipkit.plugins.losses.infonce import InfoNCE
    from clipkit.plugins.similarities.dot import DotSimilarity
    from clipkit.tiled import tiled_global_loss, tiled_local_loss

    torch.set_num_threads(args.threads)
    n, dim, rows = args.demo, args.dim, args.local_rows or args.demo
    generator = torch.Generator().manual_seed(0)
    points = [
        torch.nn.functional.normalize(torch.randn(n, 1, dim, generator=generator), dim=-1) for _ in "ab"
    ]
    a, b = (PointSet(p.to(args.device).requires_grad_()) for p in points)
    similarity = DotSimilarity().to(args.device)
    before = rss_bytes()
    print(f"N = {n}, d = {dim}, tile {args.tile}: inputs {2 * n * dim * 4 / 2**20:.0f} MiB; "
          f"the full fp32 logits would take {2 * n * n * 4 / 2**30:.0f} GiB", flush=True)  # fmt: skip
    started_cpu, started_wall = time.process_time(), time.perf_counter()
    if rows < n:  # train.distributed.local_loss: this process's `rows` anchors against all n candidates
        print(f"local form: anchors 0..{rows - 1} (both directions) against all {n} candidates", flush=True)
        local_a, local_b = a.rows(0, rows), b.rows(0, rows)
        out = tiled_local_loss(
            InfoNCE(), similarity, local_a, b, a, local_b, 0, LossContext(), tile_size=args.tile
        )
    else:
        out = tiled_global_loss(InfoNCE(), similarity, a, b, LossContext(), tile_size=args.tile)
    forward_cpu = time.process_time() - started_cpu
    print(f"forward: loss {float(out.loss.detach()):.6f}, {forward_cpu:.0f} s CPU", flush=True)
    out.loss.backward()
    total_cpu, total_wall = time.process_time() - started_cpu, time.perf_counter() - started_wall
    peak = peak_rss_bytes()
    finite = bool(torch.isfinite(a.points.grad).all() and torch.isfinite(b.points.grad).all())
    print(
        f"forward + backward: {total_cpu:.0f} s CPU, {total_wall:.0f} s wall; "
        f"peak RSS {peak / 2**30:.2f} GiB "
        f"({(peak - before) / 2**30:.2f} GiB above the inputs); gradients finite: {finite}; "
        f"d loss / d log_scale = {float(similarity.log_scale.grad):.6f}; "
        f"{2 * rows * n / total_cpu:.3g} logits (fwd + bwd) per CPU second",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1024,2048,4096,8192")
    parser.add_argument("--pairs", default=PAIRS)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-gib", type=float, default=16.0, help="for the extrapolated largest N")
    parser.add_argument(
        "--max-gib", type=float, default=4.0, help="skip full-path points estimated above this"
    )
    parser.add_argument("--demo", type=int, default=0, help="run one tiled InfoNCE step at this N")
    parser.add_argument("--local-rows", type=int, default=0, help="--demo: only this process's anchors")
    parser.add_argument("--out", default="batch_memory.jsonl", help="points are appended here (JSON lines)")
    parser.add_argument("--summarize", metavar="JSONL", help="only print the tables of recorded points")
    parser.add_argument("--point", nargs=3, metavar=("PAIR", "PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        pair, path, n = args.point
        print(json.dumps(measure_point(pair, path, int(n), args.dim, args.tile, args.device, args.threads)))
    elif args.summarize:
        summarize(args.summarize, args.device, args.budget_gib)
    elif args.demo:
        demo(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
