"""Compile the KME triton kernels for a GPU target without a GPU and print their resource use.

Triton compiles to PTX and a cubin ahead of time on any machine (its wheel ships ptxas and
cuobjdump); this checks that the kernels of plugins/similarities/kme_triton.py lower for sm_90
(H100/H200) with
the tile sizes and warp counts ``kme_triton`` launches them with, and reads registers per thread,
spill stack and shared memory from the cubin. It measures nothing about speed.

    python benchmarks/kme_triton_resources.py [--arch 90] [--dim 512]   # needs triton installed
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from clipkit.plugins.similarities import kme_triton

SHAPES = ((197, 77), (77, 197), (50, 50), (10, 10), (1, 1))
COMMON = {"Na": "i32", "Nb": "i32", "Mx": "i32", "My": "i32", "D": "i32"}
CONSTANTS = ("BA", "MXP", "BB", "MYP", "PRECISION", "WIDEN")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability × 10 (90 = H100/H200)")
    parser.add_argument("--dim", type=int, default=512)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}, d = {args.dim}, tiles {kme_triton.TILES}")
    print()
    print(
        "| kernel | points | Mx × My | tile (rows × cols) | registers | spill stack (B) | shared (B) | MMA |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype, precision in (("bf16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee")):
        for mx, my in SHAPES:
            for kernel in ("forward", "backward"):
                compiled, rows, cols = compile_kernel(kernel, dtype, precision, mx, my, args.dim, target)
                registers, stack = resource_usage(compiled.asm["cubin"])
                ptx = compiled.asm["ptx"]
                mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "none (FMA)"
                points = dtype if dtype == "bf16" else f"fp32 ({precision})"
                print(
                    f"| {kernel} | {points} | {mx} × {my} | {rows} × {cols} | {registers} | {stack} | "
                    f"{compiled.metadata.shared} | {mma} |"
                )


def compile_kernel(kernel, dtype, precision, mx, my, dim, target):
    """Compile one kernel as ``kme_triton`` would launch it for these set sizes."""
    tiles = kme_triton.tiles_for(torch.bfloat16 if dtype == "bf16" else torch.float32)
    if kernel == "forward":
        (ba, mxp), (bb, myp) = (
            kme_triton._slots(mx, tiles.forward_points),
            kme_triton._slots(my, tiles.forward_points),
        )
        warps = tiles.forward_warps
        fn, pointers = kme_triton._forward_kernel, ("U", "LWU", "V", "LWV", "GAMMA", "LSE")
        extra = {"BK": min(64, max(16, kme_triton._next_power_of_2(dim)))}
    else:
        (ba, mxp) = kme_triton._slots(mx, tiles.backward_rows)
        (bb, myp) = kme_triton._slots(my, tiles.backward_cols)
        warps = tiles.backward_warps
        fn, pointers = (
            kme_triton._backward_rows_kernel,
            ("U", "LWU", "V", "LWV", "GAMMA", "LSE", "G", "R", "DLW"),
        )
        extra = {"BD": max(16, kme_triton._next_power_of_2(dim))}
    signature = {name: (f"*{dtype}" if name in ("U", "V") else "*fp32") for name in pointers}
    signature.update(COMMON)
    constants = dict(zip(CONSTANTS, (ba, mxp, bb, myp, precision, False), strict=True)) | extra
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=target, options={"num_warps": warps})
    return compiled, ba * mxp, bb * myp


def resource_usage(cubin: bytes) -> tuple[str, str]:
    """(registers per thread, stack bytes) from ``cuobjdump --dump-resource-usage``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", handle.name], capture_output=True, text=True
        ).stdout
    fields = dict(item.split(":", 1) for line in text.splitlines() if "REG:" in line for item in line.split())
    return fields.get("REG", "?"), fields.get("STACK", "?")


if __name__ == "__main__":
    main()
