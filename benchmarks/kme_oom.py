"""KME-CLIP under a memory limit: the naive einsum runs out of memory where the block-wise path runs.

Observed, not estimated: each path runs in a fresh process whose address space is capped
(``RLIMIT_AS``) at what the process already maps after building the inputs plus ``--budget-gib``.
The naive path must materialise the [N, N, Mx, My] scores (4·N²·Mx·My bytes, and autograd keeps
more); the block-wise path needs O(N²) plus one tile.

    python benchmarks/kme_oom.py [--n 256] [--m 50] [--dim 512] [--budget-gib 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time


def mapped_bytes() -> int:
    """This process's virtual size (VmSize), what RLIMIT_AS limits."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status (Linux only)")


def run_path(path: str, n: int, m: int, dim: int, backward: bool, budget: int, results) -> None:
    import torch

    from clipkit.contract.types import PointSet
    from clipkit.plugins.similarities.kme import kme_logits, kme_logits_naive

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)

    def point_set(weighted: bool) -> PointSet:
        points = torch.nn.functional.normalize(torch.randn(n, m, dim, generator=generator), dim=-1)
        weights = torch.rand(n, m, generator=generator) + 0.1 if weighted else None
        return PointSet(points.requires_grad_(), weights)

    a, b = point_set(True), point_set(False)
    gamma = torch.tensor(1 / 0.07, requires_grad=True)
    kme_logits(PointSet(a.points[:2, :2].detach(), None), PointSet(b.points[:2, :2].detach(), None), gamma)
    limit = mapped_bytes() + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    function = (
        kme_logits_naive
        if path == "naive"
        else lambda x, y, g: kme_logits(x, y, g, implementation="blockwise")
    )
    started = time.perf_counter()
    try:
        logits = function(a, b, gamma)
        if backward:
            logits.sum().backward()
        results.put(("ran", f"{time.perf_counter() - started:.2f} s"))
    except (RuntimeError, MemoryError) as error:
        results.put(("out of memory", str(error).splitlines()[0][:90]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--m", type=int, default=50)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=1.0)
    args = parser.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    scores = 4 * args.n**2 * args.m**2 / (1 << 30)
    print(
        f"N = {args.n}, Mx = My = {args.m}, d = {args.dim}: one fp32 score tensor is {scores:.2f} GiB; "
        f"limit = mapped after set-up + {args.budget_gib} GiB\n"
    )
    print("| path | pass | result | detail |\n|---|---|---|---|")
    context = multiprocessing.get_context("spawn")
    for backward in (False, True):
        for path in ("naive", "blockwise"):
            results = context.Queue()
            process = context.Process(
                target=run_path, args=(path, args.n, args.m, args.dim, backward, budget, results)
            )
            process.start()
            process.join()
            outcome, detail = (
                results.get() if not results.empty() else ("crashed", f"exit {process.exitcode}")
            )
            print(f"| {path} | {'fwd+bwd' if backward else 'forward'} | {outcome} | {detail} |")


if __name__ == "__main__":
    main()
