"""Compile the fused tiled-loss kernels (clipkit/tiled/fused_kernels.py) for a CUDA target without a
GPU: Triton's own compiler runs every stage down to the cubin (ptxas ships with the triton wheel), so
a kernel that would not compile on the device (types, unsupported constructs, shared memory) fails
here, where the interpreter tests (tests/test_fused_kernels.py) cannot see it.

    python tools/compile_fused_kernels.py [--arch 90] [--warps 8]   # TRITON_INTERPRET must be unset

For each input dtype (bf16, fp32, fp64) at the default tiles of ``clipkit.tiled.fused.default_blocks``
(d = 768) and each named row-sum term, the forward and the backward kernel are compiled with every
optional branch switched on (lse with exclusion and offsets, max, the term, the transposed
direction), and the shared memory each needs is printed. Prints one line per kernel; exits 1 on the
first failure. About 4 minutes the first time (Triton caches the results in ~/.triton).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import torch


def _signature(fn, types: dict, consts: dict) -> tuple[dict, dict]:
    names = list(inspect.signature(fn.fn).parameters)
    signature = {name: "constexpr" if name in consts else types[name] for name in names}
    return signature, {(names.index(name),): value for name, value in consts.items()}


def _direction(prefix: str, kind: int, dtype: str) -> tuple[dict, dict]:
    types = {f"{prefix}{name}": f"*{dtype}" for name in ("LSE_ROW", "LSE_COL", "SUM_ROW", "SUM_COL")}
    types[f"{prefix}TGT"] = "*i64"
    flags = ("HAS_LSE", "LSE_EXCL", "LSE_HAS_ROW", "LSE_HAS_COL", "SUM_EXCL", "SUM_HAS_ROW", "SUM_HAS_COL")
    consts = {f"{prefix}{flag}": True for flag in flags}
    consts[f"{prefix}SUM_KIND"] = kind
    return types, consts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--warps", type=int, default=None, help="default: the tiles' own")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from clipkit.tiled import fused
    from clipkit.tiled import fused_kernels as kernels

    target = GPUTarget("cuda", args.arch, 32)
    for torch_dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"), (torch.float64, "fp64")):
        wide = torch_dtype == torch.float64
        acc, acc_name = (tl.float64, "fp64") if wide else (tl.float32, "fp32")
        blocks = fused.default_blocks(torch_dtype, 768)
        precision = "ieee" if torch_dtype == torch.float32 else "tf32"
        common = {"ACC": acc, "FMA": wide, "WIDEN": False, "PRECISION": precision}
        for kind in (fused.SUM_SIGMOID, fused.SUM_LINEAR, fused.SUM_SOFTMAX_LINEAR):
            types = {"A": f"*{name}", "B": f"*{name}", "SCALE": f"*{acc_name}", "BIAS": f"*{acc_name}",
                     "N": "i32", "M": "i32", "D": "i32", "factor": "fp32"}  # fmt: skip
            forward_types = {**types, "OUT_LSE": f"*{acc_name}", "OUT_MAX": f"*{acc_name}", "OUT_ARG": "*i64",
                             "OUT_SUM": f"*{acc_name}"}  # fmt: skip
            own_types, own = _direction("", kind, acc_name)
            forward_consts = {**own, "HAS_MAX": True, "BM": blocks.forward_rows, "BN": blocks.forward_cols,
                              "BK": blocks.depth, **common}  # fmt: skip
            backward_types = {**types, "OUT_R": f"*{acc_name}", "OUT_G": f"*{acc_name}", "t_factor": "fp32"}
            for prefix in ("", "T_"):
                backward_types.update({f"{prefix}{n}": f"*{acc_name}" for n in ("LSE", "G_LSE", "G_SUM")})
                backward_types.update(_direction(prefix, kind, acc_name)[0])
            _, other = _direction("T_", kind, acc_name)
            backward_consts = {**own, **other, "BM": blocks.backward_rows, "BN": blocks.backward_cols,
                               "BK": blocks.depth, "BDO": blocks.backward_dims, **common}  # fmt: skip
            for label, fn, kind_types, consts in (
                ("forward", kernels._forward_kernel, {**forward_types, **own_types}, forward_consts),
                ("backward", kernels._backward_kernel, backward_types, backward_consts),
            ):
                signature, constexprs = _signature(fn, kind_types, consts)
                began = time.process_time()
                try:
                    compiled = triton.compile(
                        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                        target=target,
                        options={"num_warps": args.warps or blocks.warps},
                    )
                except Exception as error:
                    print(f"{label} {name} term {kind}: FAILED: {error}", flush=True)
                    sys.exit(1)
                seconds = time.process_time() - began
                print(f"{label} {name} term {kind} sm_{args.arch}: compiled in {seconds:.1f} CPU-s (cached: "
                      f"~0), shared memory {compiled.metadata.shared} B", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
