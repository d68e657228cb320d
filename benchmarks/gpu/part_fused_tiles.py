"""Tile shapes of the fused contrastive kernels (clipkit/tiled/fused.py): fwd+bwd over a set of
``Blocks``, so their defaults can be chosen from measurements (issue 43 item 2).

The H200 run of 2026-11-27 measured the fused kernels, at their untuned defaults
(``clipkit.tiled.fused.default_blocks``), at 8-10 % of the device's bf16 matmul peak and slower
than the generic tiled engine at d = 768. This part times InfoNCE fwd+bwd (bf16 unit rows, the
``Point`` of part_fused_loss.py) at each (N, d) of POINTS for every configuration of CONFIGS,
one at a time: ``default_blocks`` is replaced for the duration, so the kernels run exactly as in
training. Each configuration is first checked against the defaults' result (max relative
difference of the loss and both gradients; bf16 rows, so up to ~2e-2 from summation order), then
timed (CUDA events, median of 3 after one warm-up). A configuration that does not compile
(registers, shared memory) is listed with its error, not timed.

    python benchmarks/gpu/part_fused_tiles.py --out DIR       # writes DIR/fused_tiles.json
    bash benchmarks/gpu/run.sh OUT ceilings fused_tiles summary

``Blocks(forward_rows, forward_cols, backward_rows, backward_cols, backward_dims, depth, warps)``.
Rehearsal (CLIPKIT_GPU_REHEARSAL=1): on the CPU only under TRITON_INTERPRET=1 (N = 32, d = 16, two
configurations), else recorded as skipped.
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import torch
from common import device, figure, median, parse_out, pick, process_seconds, read_ceilings, rehearsal, time_ms
from common import write_part as write  # noqa: I001 (two lines: the names do not fit one)
from part_fused_loss import Point, relative_difference

from clipkit.tiled import fused

BUDGET_S = 150.0
POINTS = pick([(65536, 128), (65536, 512)], [(32, 16)])
#: Candidate tiles for 16-bit rows; the defaults are (128, 64, 64, 64, dims, 64, 8).
CONFIGS = pick(
    [
        (128, 128, 64, 64, 128, 64, 8),
        (128, 64, 128, 64, 128, 64, 8),
        (128, 128, 128, 64, 128, 64, 8),
        (64, 128, 64, 128, 128, 64, 4),
        (128, 64, 64, 64, 64, 64, 4),
        (128, 128, 64, 64, 256, 32, 8),
        (256, 64, 64, 64, 128, 64, 8),
    ],
    [(16, 16, 16, 16, 16, 16, 4), (32, 16, 16, 32, 16, 16, 4)],
)


def left() -> float:
    return BUDGET_S - process_seconds()


def run_point(point: Point, blocks: fused.Blocks | None) -> tuple[float, tuple]:
    """(median ms of fwd+bwd, the result) with ``blocks`` in place of the defaults (None: defaults)."""
    run = point.tiled(True)
    replaced = mock.patch.object(fused, "default_blocks", lambda dtype, dim: blocks)
    with replaced if blocks else contextlib.nullcontext():
        run()  # compile; its result is the one checked
        result = point.results["fused"]
        times = time_ms(run, warmup=1, repeats=3)
    return median(times), result


def tiles(config: tuple, d: int) -> fused.Blocks:
    """``config`` as Blocks, its output dims per backward program at most d (as the defaults')."""
    rows, cols, back_rows, back_cols, dims, depth, warps = config
    return fused.Blocks(rows, cols, back_rows, back_cols, min(dims, max(16, d)), depth, warps)


def main() -> None:
    out = parse_out()
    dev = device()
    figures: list[dict] = []
    skipped: list[str] = []
    peak = read_ceilings(out).get("bf16_tflops")
    if not fused.available() or (dev.type != "cuda" and not fused.interpreting()):
        skipped.append("fused: triton not installed or (on CPU) TRITON_INTERPRET unset")
        write(out, "fused_tiles", figures, skipped=skipped)
        return
    torch.manual_seed(0)
    for n, d in POINTS:
        point = Point("infonce", n, d, dev)
        default_ms, reference = run_point(point, None)
        label = f"fused_tiles infonce N={n} d={d}"
        work = 8.0 * n * n * d
        for config in [None, *CONFIGS]:
            if left() < 10:
                skipped.append(f"{label} {config}: budget spent")
                continue
            name = "defaults" if config is None else "blocks " + ",".join(map(str, config))
            try:
                blocks = (
                    None
                    if config is None
                    else fused.Blocks(*config[:4], min(config[4], max(16, d)), *config[5:])
                )
                began = time.perf_counter()
                ms, result = (default_ms, reference) if config is None else run_point(point, blocks)
                error = relative_difference(result, reference)
            except Exception as exc:  # noqa: BLE001 (a config that does not compile is a finding)
                skipped.append(f"{label} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            tflops = work / (ms / 1e3) / 1e12
            note = f"max rel. difference to the defaults {error:.2g}"
            print(f"  {label} {name}: {ms:.2f} ms, {tflops:.1f} TFLOP/s, {note} "
                  f"({time.perf_counter() - began:.1f} s)", flush=True)  # fmt: skip
            figures.append(figure(f"{label} {name} fwd+bwd", ms, "ms", note=note))
            if peak:
                figures.append(figure(f"{label} {name} % of bf16 peak", 100 * tflops / peak, "%"))
            write(out, "fused_tiles", figures, skipped=skipped)  # a timeout keeps what was measured
        del point
    if rehearsal():
        skipped.append("rehearsal: interpreter times, not GPU tiles")
    write(out, "fused_tiles", figures, skipped=skipped)


if __name__ == "__main__":
    main()
