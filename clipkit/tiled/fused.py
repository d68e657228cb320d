"""The fused path of the tiled engine: when the similarity's logits are an affine dot product
L = s·A·Bᵀ + c of its tile features and the loss's reductions are ones the kernels know, a whole
sweep (every reduction of one matrix, forward and backward) runs in two Triton kernels
(:mod:`clipkit.tiled.fused_kernels`) instead of a Python loop over tiles. The generic engine
(:mod:`clipkit.tiled.engine`) stays the reference and the fallback: any reduction the kernels do not
know runs there.

The contract (docs/plugins.md "Fused kernels"):

* a similarity declares ``fused_form() -> AffineDot | None``: its ``score_tile`` equals
  ``scale·a[0] @ b[0].T + bias`` for one-tensor tile features ([B, D] each); None: not now;
* a loss declares ``fused_reductions = True``: its ``tiled_loss`` was written for (and tested with)
  the fused path. Its reductions are routed one sweep at a time: a sweep is fused when, per
  direction, it holds at most one ``LogSumExp`` (offset None or :class:`~clipkit.tiled.terms.Separable`),
  at most one ``RowSum`` of a named term (:mod:`clipkit.tiled.terms`) and any ``ArgMax`` / ``Max``.

Selection (:func:`fused_sweeps`): ``fused=None`` (auto) uses the kernels for CUDA tensors when triton
imports and both plugins declare support (``CLIPKIT_FUSED_KERNELS=0`` switches this off);
``fused=True`` demands them (an error says why not; CPU
tensors need ``TRITON_INTERPRET=1``, for tests); ``fused=False`` never uses them. CPU runs never use
them unless asked.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from clipkit.contract.types import optional_member
from clipkit.errors import ClipkitError
from clipkit.tiled.engine import ArgMax, LogSumExp, Max, RowSum, Sweep
from clipkit.tiled.terms import ScaledLogits, Separable, SigmoidPairTerms, SoftmaxWeightedLogits

DIRECTIONS = ("i2t", "t2i")
#: Kernel codes of the named row-sum terms (clipkit.tiled.fused_kernels._pair_term).
SUM_NONE, SUM_SIGMOID, SUM_LINEAR, SUM_SOFTMAX_LINEAR = 0, 1, 2, 3


def _kernels():
    """The kernel module, imported on first use: importing triton decorates the kernels, and
    TRITON_INTERPRET must be set before that (tests set it late); CPU runs never pay for it."""
    from clipkit.tiled import fused_kernels

    return fused_kernels


def available() -> bool:
    """True when triton is installed (the kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class AffineDot:
    """A similarity's fused form: tile logits = scale·a[0] @ b[0].T + bias.

    scale: 0-d tensor (a graph node: the kernels return its gradient to autograd).
    bias: a one-element tensor, or None.
    """

    scale: Tensor
    bias: Tensor | None = None


@dataclass(frozen=True)
class Blocks:
    """Kernel tile shape: forward BM × BN, backward BM × BN with BDO output dims per program, BK the
    d step of every tile GEMM."""

    forward_rows: int
    forward_cols: int
    backward_rows: int
    backward_cols: int
    backward_dims: int
    depth: int
    warps: int = 4


def default_blocks(dtype: torch.dtype, dim: int) -> Blocks:
    """Tiles for rows of ``dtype`` and width ``dim`` (not tuned on a GPU yet: chosen by the registers
    and shared memory they need, as KME's first tiles were)."""
    dims = min(256 if dtype.itemsize <= 2 else 128, max(16, _next_power_of_2(dim)))
    if dtype == torch.float64:
        return Blocks(16, 16, 16, 16, min(dims, 32), 8, 4)
    if dtype.itemsize <= 2:
        return Blocks(128, 64, 64, 64, dims, 64, 8)
    return Blocks(64, 64, 64, 32, dims, 32, 8)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreting() -> bool:
    """True when triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1): CPU tensors work."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def auto_enabled() -> bool:
    """False when ``CLIPKIT_FUSED_KERNELS=0``: ``fused=None`` then keeps the generic engine on CUDA too
    (a switch for users, should the kernels misbehave on some GPU or Triton version)."""
    return os.environ.get("CLIPKIT_FUSED_KERNELS", "1") not in ("0", "false", "no")


def _name(plugin) -> str:
    return plugin.__name__ if isinstance(plugin, type) else type(plugin).__name__


def fused_refusal(loss, similarity, features_a: tuple, features_b: tuple) -> str | None:
    """Why this pair cannot use the fused kernels on these tile features, or None when it can."""
    if not optional_member(loss, "fused_reductions"):
        return f"the loss {_name(loss)} does not declare fused_reductions"
    if optional_member(similarity, "fused_form") is None:
        return f"the similarity {_name(similarity)} does not declare fused_form"
    for features in (features_a, features_b):
        if len(features) != 1 or features[0].dim() != 2 or not features[0].is_floating_point():
            return "its tile features are not one [B, D] floating tensor per side"
    if features_a[0].shape[1] != features_b[0].shape[1]:
        return "its two sides' tile features differ in width"
    if not available():
        return "the triton package is not installed"
    device = features_a[0].device
    if device.type != "cuda" and not interpreting():
        return (
            f"the kernels need CUDA tensors (these are on {device.type}; TRITON_INTERPRET=1 runs them on CPU)"
        )
    return None


def fused_sweeps(loss, similarity, features_a: tuple, features_b: tuple, fused: bool | None,
                 blocks: Blocks | None = None) -> FusedSweeps | None:  # fmt: skip
    """The fused runner for this pair, or None for the generic engine (see the module docstring)."""
    if fused is False:
        return None
    reason = fused_refusal(loss, similarity, features_a, features_b)
    if reason is None:
        form = similarity.fused_form()
        if form is None:
            reason = f"the similarity {_name(similarity)} has no fused form in its current configuration"
    if reason is not None:
        if fused:
            raise ClipkitError(f"fused tiled kernels requested, but {reason}")
        return None
    if fused is None and (features_a[0].device.type != "cuda" or not auto_enabled()):
        return None  # auto never runs the interpreter for a user, nor runs when switched off
    return FusedSweeps(form, blocks)


@dataclass(frozen=True)
class _Direction:
    """What the kernels compute for one direction of a sweep."""

    targets: Tensor  # [rows] long, each row's positive column (−1: none)
    lse: LogSumExp | None
    row_sum: RowSum | None
    wants_max: bool


_TERMS = (SigmoidPairTerms, ScaledLogits, SoftmaxWeightedLogits)


def _plan(sweep: Sweep) -> dict[str, _Direction] | None:
    """Per direction, the kernels' work for ``sweep``, or None when a reduction is not theirs."""
    if len(sweep.features_a) != 1 or len(sweep.features_b) != 1:
        return None
    plan = {}
    for direction in DIRECTIONS:
        chosen = [r for r in sweep.reductions if r.direction == direction]
        lses = [r for r in chosen if isinstance(r, LogSumExp)]
        sums = [r for r in chosen if isinstance(r, RowSum)]
        if len(lses) > 1 or len(sums) > 1:
            return None
        if lses and not (lses[0].offset is None or isinstance(lses[0].offset, Separable)):
            return None
        if sums and not isinstance(sums[0].fn, _TERMS):
            return None
        rows = sweep.rows_a if direction == "i2t" else sweep.rows_b
        targets = sweep.targets.get(direction)
        if targets is None:
            targets = torch.full((rows,), -1, dtype=torch.long, device=sweep.features_a[0].device)
        maxima = any(isinstance(r, ArgMax | Max) for r in chosen)
        plan[direction] = _Direction(targets.long().contiguous(), lses[0] if lses else None,
                                     sums[0] if sums else None, maxima)  # fmt: skip
    return plan


class FusedSweeps:
    """Runs the sweeps of one :class:`~clipkit.tiled.logits.TiledLogits` in the fused kernels."""

    def __init__(self, form: AffineDot, blocks: Blocks | None = None) -> None:
        self.form, self.blocks = form, blocks

    def accepts(self, sweep: Sweep) -> bool:
        return _plan(sweep) is not None

    def score_pairs(self, a: tuple[Tensor], b: tuple[Tensor]) -> Tensor:
        """([n, D],), ([n, D],) -> [n] logits of row-aligned pairs (the positives), accumulated in the
        kernels' precision (fp32 for 16-bit rows) so that they match the kernels' log-sum-exps."""
        dtype = torch.promote_types(a[0].dtype, b[0].dtype)
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        logits = self.form.scale.to(accumulate) * (a[0].to(accumulate) * b[0].to(accumulate)).sum(dim=1)
        return logits if self.form.bias is None else logits + self.form.bias.reshape(()).to(accumulate)

    def run(self, sweep: Sweep) -> list[Tensor]:
        """The reductions' values in order, as :func:`clipkit.tiled.engine.run_sweep` returns them."""
        plan = _plan(sweep)
        a, b = sweep.features_a[0], sweep.features_b[0]
        dtype = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self.form.scale.reshape(()).to(accumulate)
        bias = self.form.bias
        bias = (
            torch.zeros((), device=a.device, dtype=accumulate)
            if bias is None
            else bias.reshape(()).to(accumulate)
        )
        blocks = self.blocks or default_blocks(dtype, a.shape[1])
        outputs = _FusedSweep.apply(plan, blocks, a, b, scale, bias)
        by_direction = dict(zip(DIRECTIONS, (outputs[:4], outputs[4:]), strict=True))
        values = []
        for reduction in sweep.reductions:
            lse, best, best_at, row_sum = by_direction[reduction.direction]
            values.append({LogSumExp: lse, RowSum: row_sum, Max: best, ArgMax: best_at}[type(reduction)])
        return values


def _separable_args(offset: Separable | None, prefix: str, dummy: Tensor) -> tuple[dict, dict]:
    row = None if offset is None else offset.row
    col = None if offset is None else offset.col
    pointers = {f"{prefix}_ROW": dummy if row is None else row.to(dummy.dtype).contiguous(),
                f"{prefix}_COL": dummy if col is None else col.to(dummy.dtype).contiguous()}  # fmt: skip
    flags = {f"{prefix}_HAS_ROW": row is not None, f"{prefix}_HAS_COL": col is not None}
    return pointers, flags


def _sum_kind(row_sum: RowSum | None) -> tuple[int, float, Separable | None, bool]:
    """(kernel term kind, factor, weight, exclude positive) of a row sum."""
    fn = None if row_sum is None else row_sum.fn
    if isinstance(fn, SigmoidPairTerms):
        return SUM_SIGMOID, 0.0, None, False
    if isinstance(fn, ScaledLogits):
        return SUM_LINEAR, float(fn.factor), None, False
    if isinstance(fn, SoftmaxWeightedLogits):
        return SUM_SOFTMAX_LINEAR, float(fn.factor), fn.weight, bool(fn.exclude_positive)
    return SUM_NONE, 0.0, None, False


def _direction_args(plan: _Direction, dummy: Tensor, lse_value: Tensor | None, grad_lse: Tensor | None,
                    grad_sum: Tensor | None, prefix: str = "") -> dict:  # fmt: skip
    """The kernels' arguments of one direction (backward when lse_value is given, else forward)."""
    kind, factor, weight, exclude = _sum_kind(plan.row_sum)
    lse = plan.lse
    lse_pointers, lse_flags = _separable_args(None if lse is None else lse.offset, "LSE", dummy)
    sum_pointers, sum_flags = _separable_args(weight, "SUM", dummy)
    args = {"TGT": plan.targets, "factor": factor, **lse_pointers, **lse_flags, **sum_pointers, **sum_flags,
            "LSE_EXCL": bool(lse is not None and lse.exclude_positive), "SUM_EXCL": exclude}  # fmt: skip
    if lse_value is None:  # forward
        args.update(HAS_LSE=lse is not None, SUM_KIND=kind)
    else:
        args.update(HAS_LSE=grad_lse is not None, SUM_KIND=kind if grad_sum is not None else SUM_NONE,
                    LSE=lse_value, G_LSE=dummy if grad_lse is None else grad_lse.to(dummy.dtype).contiguous(),
                    G_SUM=dummy if grad_sum is None else grad_sum.to(dummy.dtype).contiguous())  # fmt: skip
    return {f"{prefix}{k}": v for k, v in args.items()}


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE fp32 for fp32 rows unless torch allows TF32."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def _common(rows: Tensor, accumulate: torch.dtype) -> dict:
    tl = _kernels().tl
    wide = accumulate == torch.float64
    return {"ACC": tl.float64 if wide else tl.float32, "FMA": rows.dtype == torch.float64,
            "WIDEN": interpreting(), "PRECISION": _precision(rows.dtype)}  # fmt: skip


def _forward(plan: _Direction, rows: Tensor, cols: Tensor, scale: Tensor, bias: Tensor, blocks: Blocks):
    """(lse, max, argmax, row sum) [rows] of the direction whose anchors are ``rows``."""
    n, m, d = rows.shape[0], cols.shape[0], rows.shape[1]
    accumulate = scale.dtype
    out = [torch.empty(n, device=rows.device, dtype=accumulate) for _ in range(2)]
    best_at = torch.zeros(n, device=rows.device, dtype=torch.long)
    row_sum = torch.zeros(n, device=rows.device, dtype=accumulate)
    if n == 0:
        return out[0], out[1], best_at, row_sum
    dummy = torch.zeros(1, device=rows.device, dtype=accumulate)
    args = _direction_args(plan, dummy, None, None, None)
    kernels = _kernels()
    kernels._forward_kernel[(kernels.triton.cdiv(n, blocks.forward_rows),)](
        A=rows, B=cols, SCALE=scale, BIAS=bias, OUT_LSE=out[0], OUT_MAX=out[1], OUT_ARG=best_at,
        OUT_SUM=row_sum, N=n, M=m, D=d, HAS_MAX=plan.wants_max, BM=blocks.forward_rows,
        BN=blocks.forward_cols, BK=blocks.depth, num_warps=blocks.warps, **args, **_common(rows, accumulate),
    )  # fmt: skip
    return out[0], out[1], best_at, row_sum


def _backward(rows: Tensor, cols: Tensor, scale: Tensor, bias: Tensor, own: dict, other: dict,
              blocks: Blocks) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(R [rows, d] = G·cols, Σ_c G [rows]) in the accumulator dtype, G the logit gradient."""
    n, m, d = rows.shape[0], cols.shape[0], rows.shape[1]
    accumulate = scale.dtype
    r = torch.zeros(n, d, device=rows.device, dtype=accumulate)
    g_sum = torch.zeros(n, device=rows.device, dtype=accumulate)
    if n == 0 or m == 0 or d == 0:
        return r, g_sum
    kernels = _kernels()
    grid = (kernels.triton.cdiv(n, blocks.backward_rows), kernels.triton.cdiv(d, blocks.backward_dims))
    kernels._backward_kernel[grid](
        A=rows, B=cols, SCALE=scale, BIAS=bias, OUT_R=r, OUT_G=g_sum, N=n, M=m, D=d, **own, **other,
        BM=blocks.backward_rows, BN=blocks.backward_cols, BK=blocks.depth, BDO=blocks.backward_dims,
        num_warps=blocks.warps, **_common(rows, accumulate),
    )  # fmt: skip
    return r, g_sum


class _FusedSweep(torch.autograd.Function):
    """(plan, blocks, a [Na, D], b [Nb, D], scale 0-d, bias 0-d) -> per direction (i2t, t2i):
    lse, max, argmax, row sum [rows] (8 outputs; a direction the plan does not use gets placeholders)."""

    @staticmethod
    def forward(ctx, plan, blocks, a, b, scale, bias):
        i2t = _forward(plan["i2t"], a, b, scale, bias, blocks) if _used(plan["i2t"]) else _empty(a, scale)
        t2i = _forward(plan["t2i"], b, a, scale, bias, blocks) if _used(plan["t2i"]) else _empty(b, scale)
        ctx.plan, ctx.blocks = plan, blocks
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, b, scale, bias, i2t[0], t2i[0])
        ctx.mark_non_differentiable(i2t[1], i2t[2], t2i[1], t2i[2])
        return (*i2t, *t2i)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        a, b, scale, bias, lse_i2t, lse_t2i = ctx.saved_tensors
        plan, blocks = ctx.plan, ctx.blocks
        need_a, need_b, need_scale, need_bias = ctx.needs_input_grad[2:]
        live = {"i2t": (grads[0], grads[3]), "t2i": (grads[4], grads[7])}
        if all(g is None for pair in live.values() for g in pair):
            return None, None, None, None, None, None
        dummy = torch.zeros(1, device=a.device, dtype=scale.dtype)
        args_i2t = {**_direction_args(plan["i2t"], dummy, lse_i2t, *live["i2t"])}
        args_t2i = {**_direction_args(plan["t2i"], dummy, lse_t2i, *live["t2i"])}
        grad_a = grad_b = grad_scale = grad_bias = None
        if need_a or need_scale or need_bias:
            r_a, g_sum = _backward(a, b, scale, bias, args_i2t, _transposed(args_t2i), blocks)
            grad_a = (scale * r_a).to(a.dtype) if need_a else None
            grad_scale = (a.to(r_a.dtype) * r_a).sum() if need_scale else None
            grad_bias = g_sum.sum() if need_bias else None
        if need_b:
            r_b, _ = _backward(b, a, scale, bias, args_t2i, _transposed(args_i2t), blocks)
            grad_b = (scale * r_b).to(b.dtype)
        return None, None, grad_a, grad_b, grad_scale, grad_bias


def _transposed(args: dict) -> dict:
    """A direction's backward arguments as the kernel's column direction (T_ prefix)."""
    return {f"T_{k}" if k != "factor" else "t_factor": v for k, v in args.items()}


def _used(plan: _Direction) -> bool:
    return plan.lse is not None or plan.row_sum is not None or plan.wants_max


def _empty(rows: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = rows.shape[0]
    values = torch.zeros(n, device=rows.device, dtype=scale.dtype)
    return values, values.clone(), torch.zeros(n, device=rows.device, dtype=torch.long), values.clone()
