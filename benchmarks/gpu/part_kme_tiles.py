"""Tile sizes of the Triton KME kernels (plugins/similarities/kme_triton.py): forward and backward apart.

The first GPU run measured the fused kernels at 8-9 % of the device's bf16 matmul peak (fwd+bwd,
N = 256-512, 197x77 points, d = 512). This part times the two kernels separately over a set of
tile shapes and warp counts, so changes to their defaults are chosen from measurements (the
shipped ones came from its first run, on an H200):

- forward ``_forward`` (one GEMM of 2·Na·Nb·Mx·My·d FLOPs, online log-sum-exp): the tile's points
  (rows = columns of a score tile) × warps;
- backward, one side ``_backward_rows`` (a score recompute and the Q @ V GEMM, 4·Na·Nb·Mx·My·d):
  rows × columns × warps, and with d split across programs (``Tiles.backward_dims``, issue 37)

(``kme_triton.TILES`` for 16-bit points, set here one configuration at a time).

Every configuration is first checked against the shipped defaults' output (relative L2 error of
lse, R and Σ Q; bf16 points, so up to ~1e-2 from Q's bf16 rounding in another order), then timed
(CUDA events, median of 5 after one warm-up). A configuration that fails to compile (registers,
shared memory) is listed with its error. TFLOP/s count the FLOPs the kernel executes.

    python benchmarks/gpu/part_kme_tiles.py --out DIR        # writes DIR/kme_tiles.json
    bash benchmarks/gpu/run.sh OUT kme_tiles summary         # as a step of the GPU check

Rehearsal (CLIPKIT_GPU_REHEARSAL=1): on the CPU only under TRITON_INTERPRET=1 (tiny sizes, two
configurations each), else recorded as skipped.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import torch
from common import device, figure, median, parse_out, pick, read_ceilings, rehearsal, time_ms, write_part

BUDGET_S = 60.0
STARTED = time.perf_counter()
FORWARD = pick([(128, 16), (64, 8), (64, 4), (128, 8), (128, 4)], [(64, 8), (128, 4)])
BACKWARD = pick(
    [
        (16, 64, 8),
        (16, 128, 8),
        (32, 64, 8),
        (32, 64, 16),
        (32, 128, 16),
        (64, 64, 16),
        (64, 32, 8),
        (16, 32, 4),
    ],
    [(16, 64, 8), (32, 32, 4)],
)
#: Backward with d split across programs (issue 37): (rows, cols, warps, output dims per program).
#: A [rows, dims] accumulator instead of [rows, d] frees registers for larger tiles, at one score
#: recompute per chunk of d.
BACKWARD_SPLIT = pick(
    [(64, 64, 8, 128), (128, 64, 8, 128), (64, 128, 8, 128), (128, 64, 8, 256), (64, 64, 4, 64)],
    [(16, 32, 4, 16)],
)


def log(message: str) -> None:
    print(f"[kme_tiles {time.perf_counter() - STARTED:5.1f}s] {message}", flush=True)


def inputs(n: int, mx: int, my: int, dim: int, dev: torch.device) -> dict:
    generator = torch.Generator(device=dev).manual_seed(0)

    def unit(count: int, points: int) -> torch.Tensor:
        x = torch.randn(count, points, dim, device=dev, generator=generator)
        return torch.nn.functional.normalize(x, dim=-1).to(torch.bfloat16).contiguous()

    u, v = unit(n, mx), unit(n, my)
    logw_u = torch.log(torch.rand(n, mx, device=dev, generator=generator) + 0.1).contiguous()
    logw_v = torch.full((n, my), -math.log(my), device=dev)
    gamma = torch.tensor(1 / 0.07, device=dev)
    grad = torch.randn(n, n, device=dev, generator=generator)
    return {"u": u, "logw_u": logw_u, "v": v, "logw_v": logw_v, "gamma": gamma, "grad": grad}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return math.inf
    return float((a[finite] - b[finite]).norm() / b[finite].norm().clamp_min(1e-30))


class SixteenBitTiles:
    """Use ``Tiles`` for 16-bit points inside the block (``kme_triton.TILES[2]``), then restore."""

    def __init__(self, module, **changes) -> None:
        self.module, self.changes, self.saved = module, changes, None

    def __enter__(self):
        self.saved = self.module.TILES
        self.module.TILES = {**self.saved, 2: dataclasses.replace(self.saved[2], **self.changes)}

    def __exit__(self, *exc):
        self.module.TILES = self.saved


def main() -> None:
    out = parse_out()
    dev = device()
    figures: list[dict] = []
    skipped: list[str] = []
    from clipkit.plugins.similarities import kme_triton as kt

    if not kt.available() or not (dev.type == "cuda" or kt.interpreting()):
        write_part(
            out, "kme_tiles", [], skipped=["triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"]
        )
        return
    n, mx, my, dim = pick(256, 6), pick(197, 5), pick(77, 3), pick(512, 32)
    peak = read_ceilings(out).get("bf16_tflops")
    x = inputs(n, mx, my, dim, dev)
    lse_ref = kt._forward(x["u"], x["logw_u"], x["v"], x["logw_v"], x["gamma"])
    lse = torch.where(torch.isfinite(lse_ref), lse_ref, torch.zeros_like(lse_ref))
    r_ref, dlw_ref = kt._backward_rows(x["u"], x["logw_u"], x["v"], x["logw_v"], x["gamma"], lse, x["grad"])
    shape = f"N={n} {mx}x{my} d={dim} bf16"
    units = {"forward": 2 * n * n * mx * my * dim, "backward rows": 4 * n * n * mx * my * dim}

    def record(kind: str, label: str, run, check) -> None:
        if time.perf_counter() - STARTED > BUDGET_S:
            skipped.append(f"{kind} {label}: budget of {BUDGET_S:.0f} s spent")
            return
        try:
            error = check(run())
            times = time_ms(run, warmup=1, repeats=pick(5, 1))
        except Exception as exc:  # compile failures (registers, shared memory) are results here
            skipped.append(f"{kind} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            log(f"{kind} {label}: failed: {exc!s:.200}")
            traceback.print_exc(limit=2)
            return
        tflops = units[kind] / (median(times) * 1e-3) / 1e12
        share = f", {100 * tflops / peak:.1f} % of the measured bf16 peak" if peak else ""
        note = f"rel. error vs the defaults {error:.2e}; {min(times):.2f}-{max(times):.2f} ms{share}"
        figures.append(figure(f"KME {kind} {label}, {shape}", median(times), "ms", note=note))
        figures.append(figure(f"KME {kind} {label}, {shape} TFLOP/s", tflops, "TFLOP/s", note=note))
        log(f"{kind} {label}: {median(times):.2f} ms, {tflops:.1f} TFLOP/s, rel. error {error:.1e}")

    for tile, warps in FORWARD:
        with SixteenBitTiles(kt, forward_points=tile, forward_warps=warps):
            record(
                "forward",
                f"tile {tile}, {warps} warps",
                lambda: kt._forward(x["u"], x["logw_u"], x["v"], x["logw_v"], x["gamma"]),
                lambda got: relative(got, lse_ref),
            )
    for rows, cols, warps in BACKWARD:
        with SixteenBitTiles(kt, backward_rows=rows, backward_cols=cols, backward_warps=warps):
            record(
                "backward rows",
                f"rows {rows}, cols {cols}, {warps} warps",
                lambda: kt._backward_rows(
                    x["u"], x["logw_u"], x["v"], x["logw_v"], x["gamma"], lse, x["grad"]
                ),
                lambda got: max(relative(got[0], r_ref), relative(got[1], dlw_ref)),
            )
    for rows, cols, warps, dims in BACKWARD_SPLIT:
        changes = {
            "backward_rows": rows,
            "backward_cols": cols,
            "backward_warps": warps,
            "backward_dims": dims,
        }
        with SixteenBitTiles(kt, **changes):
            record(
                "backward rows",
                f"rows {rows}, cols {cols}, {warps} warps, d split by {dims}",
                lambda: kt._backward_rows(
                    x["u"], x["logw_u"], x["v"], x["logw_v"], x["gamma"], lse, x["grad"]
                ),
                lambda got: max(relative(got[0], r_ref), relative(got[1], dlw_ref)),
            )
    if rehearsal():
        skipped.append("rehearsal: Triton interpreter on the CPU, timings mean nothing")
    write_part(out, "kme_tiles", figures, skipped=skipped)


if __name__ == "__main__":
    main()
