"""Fused Triton kernels for KME-CLIP's logits (METHODS.md §3), forward and backward.

s_ab = lse_{i,j}(log w_ai + log w'_bj + γ u_ai·v_bj) − γ for anchors a (points u_ai, i < Mx) and
candidates b (points v_bj, j < My). This is attention-shaped (a GEMM, then a log-sum-exp over
segments of the score matrix), so the kernels follow FlashAttention: the Na·Nb·Mx·My scores live
only in registers, the forward saves lse [Na, Nb], the backward recomputes the scores.

Tiling. A program owns BA anchors × BB candidates. Their points are taken MXP (MYP) at a time per
set, so a score tile is [BA·MXP, BB·MYP] and reshapes to [BA, MXP, BB, MYP]: every (anchor,
candidate) pair is an aligned sub-block, and its running max / sum of exponentials are reductions
over axes 1 and 3 (exact online log-sum-exp per pair, as FlashAttention's per-row statistics).
MXP = next power of two ≥ Mx, at most 16 (for Mx = 197: 13 chunks of 16 = 208 rows, 95 % used;
Mx = 77: 80 rows, 96 %); BA = 64 / MXP, so the forward's GEMM tiles are 64 × 64 whatever the set
sizes (Mx = My = 1 is plain CLIP: 64 anchors × 64 candidates per tile).

Backward. With Q_{ab,ij} = g_ab·exp(S_{ab,ij} − lse_ab):
    ∂u_ai = γ Σ_bj Q v_bj,  ∂log w_ai = Σ_bj Q,  (and symmetrically for v, w')
    ∂γ    = Σ_ai u_ai·(Σ_bj Q v_bj) − Σ_ab g_ab.
One kernel computes the anchor side (a program owns 16 rows: BA anchors × MXP point slots, loops
over all candidates, accumulates R = Q @ V in fp32 registers); the candidate side is the same kernel on the
transposed problem (swap u and v, transpose lse and g), as S is symmetric in the two roles.
That is 4 GEMMs per backward (a score recompute in each direction), as FlashAttention-2's
separate dK/dV and dQ passes; it needs no atomics. ``Tiles.backward_dims`` splits d across backward programs
(each holds a [rows, dims] accumulator and recomputes the scores walking d in steps), which frees
registers for larger tiles; it is off in the shipped tiles until a GPU sweep (part_kme_tiles.py)
times it.

Precision: points are read in their dtype (bf16/fp16 go to the tensor cores), dot products and all
log-sum-exp arithmetic are fp32; for fp32 points tl.dot uses IEEE fp32 unless
torch.get_float32_matmul_precision() allows TF32. In backward, Q is rounded to the points' dtype
before the Q @ V GEMM (as FlashAttention rounds P), so bf16 gradients carry bf16 rounding of Q.

Status: tested for exactness against the einsum reference under the Triton interpreter
(TRITON_INTERPRET=1, CPU tensors; tests/test_kme_kernels.py) and on an H200 (tests/gpu/, fp32,
TF32 and bf16 against float64 at d = 512); the 16-bit tiles are chosen from timings there
(``TILES``). fwd+bwd reached 8-9 % of the measured bf16 matmul peak with the first tiles; the
backward (two row passes, each a score recompute and a Q @ V GEMM) is most of the time.
``kme_logits(implementation="auto")`` uses the kernels for CUDA points in bf16/fp16, or fp32 when
TF32 is allowed; ``KMESimilarity(implementation="blockwise")`` opts out, ``"triton"`` opts in for
fp32 at full precision too (an FMA kernel: 13-19 TFLOP/s on the H200, slower than block-wise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from clipkit.contract.types import PointSet

try:  # triton is optional: CPU installs never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


@dataclass(frozen=True)
class Tiles:
    """Tile shape and warps of the two kernels for one width of points.

    forward_points: rows = columns of a forward score tile (anchor × candidate points);
    backward_rows / backward_cols: anchor-point rows and candidate-point columns of a backward
    tile (a backward program also holds a [rows, d] fp32 accumulator and whole [cols, d] point
    rows, so its tiles are smaller; ``backward_dims`` splits d across backward programs)."""

    forward_points: int
    forward_warps: int
    backward_rows: int
    backward_cols: int
    backward_warps: int
    #: Output dims per backward program (a power of two ≥ 16), or None for the whole d in one
    #: program (the measured default). A split frees registers for larger row × column tiles at the
    #: price of one score recompute per chunk of d; untimed on a GPU (issue 37).
    backward_dims: int | None = None


#: By the points' bytes per element. 16-bit points: measured on an H200 (triton 3.6, N = 256,
#: 197 × 77 points, d = 512; benchmarks/gpu/part_kme_tiles.py, docs/benchmarks.md "GPU"): forward
#: 128-point tiles with 16 warps 3.15 ms (323 TFLOP/s) against 4.13 ms for the first choice of 64
#: with 8; backward 64 rows × 32 columns with 8 warps 13.3 ms a side against 21.4 ms for 16 × 64;
#: 64 × 64, 16 × 128 and 32 × 128 exceed the 227 KiB of shared memory, 256-point forward tiles the
#: registers. fp32 points (IEEE or TF32 dots; tiles of twice the bytes) keep the shapes that ran
#: correctly there, untimed against others.
TILES = {2: Tiles(128, 16, 64, 32, 8), 4: Tiles(64, 8, 16, 32, 8)}
#: Most point slots per set in one tile (a set with more points is walked in chunks of this many).
MAX_SLOTS = 16


def available() -> bool:
    """True when triton imports (the kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def interpreting() -> bool:
    """True when triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1): CPU tensors work."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tiles_for(dtype: torch.dtype) -> Tiles:
    """The kernels' tiles for points of ``dtype`` (16-bit or fp32)."""
    return TILES[2] if dtype.itemsize <= 2 else TILES[4]


def _slots(points: int, tile: int) -> tuple[int, int]:
    """(sets per tile, point slots per set): slots = next power of two ≥ points, at most MAX_SLOTS;
    sets·slots = tile."""
    slots = min(_next_power_of_2(max(points, 1)), MAX_SLOTS, tile)
    return tile // slots, slots


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
        """acc + a @ b in fp32. WIDEN (interpreter only): widen 16-bit operands to fp32 first, which is
        exact (their products are exact in fp32) and works around the triton interpreter's tl.dot,
        which multiplies bf16 bit patterns as uint16 integers."""
        if WIDEN:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _points_dot(
        U,
        V,
        row_off,
        row_ok,
        col_off,
        col_ok,
        D,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDEN: tl.constexpr,
    ):
        """[BM, BN] fp32 dot products of the rows of U at row_off (points, flat index) with those of V."""
        ks = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            k = k0 + ks
            k_ok = k < D
            a = tl.load(
                U + row_off[:, None] * D + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                V + col_off[None, :] * D + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            acc = _dot(a, b, acc, PRECISION, WIDEN)
        return acc

    @triton.jit
    def _forward_kernel(
        U,
        LWU,
        V,
        LWV,
        GAMMA,
        LSE,
        Na,
        Nb,
        Mx,
        My,
        D,
        BA: tl.constexpr,
        MXP: tl.constexpr,
        BB: tl.constexpr,
        MYP: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDEN: tl.constexpr,
    ):
        """LSE[a, b] = lse_ij(LWU[a, i] + LWV[b, j] + γ U[a, i]·V[b, j]) for BA anchors × BB candidates."""
        BM: tl.constexpr = BA * MXP
        BN: tl.constexpr = BB * MYP
        gamma = tl.load(GAMMA)
        anchors = tl.program_id(0) * BA + tl.arange(0, BA)
        candidates = tl.program_id(1) * BB + tl.arange(0, BB)
        row_set = (tl.program_id(0) * BA + tl.arange(0, BM) // MXP).to(tl.int64)
        row_slot = tl.arange(0, BM) % MXP
        col_set = (tl.program_id(1) * BB + tl.arange(0, BN) // MYP).to(tl.int64)
        col_slot = tl.arange(0, BN) % MYP
        peak = tl.full([BA, BB], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BA, BB], dtype=tl.float32)
        for row0 in range(0, Mx, MXP):
            rows = row0 + row_slot
            row_ok = (row_set < Na) & (rows < Mx)
            row_off = row_set * Mx + rows
            lwu = tl.load(LWU + row_off, mask=row_ok, other=float("-inf"))
            for col0 in range(0, My, MYP):
                cols = col0 + col_slot
                col_ok = (col_set < Nb) & (cols < My)
                col_off = col_set * My + cols
                lwv = tl.load(LWV + col_off, mask=col_ok, other=float("-inf"))
                dots = _points_dot(U, V, row_off, row_ok, col_off, col_ok, D, BM, BN, BK, PRECISION, WIDEN)
                scores = tl.reshape(gamma * dots + lwu[:, None] + lwv[None, :], [BA, MXP, BB, MYP])
                new_peak = tl.maximum(peak, tl.max(tl.max(scores, axis=3), axis=1))
                # −inf (no real point yet) would give −inf − (−inf) = NaN: shift by 0 instead.
                shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
                tile_total = tl.sum(tl.sum(tl.exp(scores - shift[:, None, :, None]), axis=3), axis=1)
                total = total * tl.exp(peak - shift) + tile_total
                peak = new_peak
        # A pair with no real point (total 0) gets −inf; log(1) keeps log(0) out of the arithmetic.
        lse = tl.where(total == 0.0, float("-inf"), tl.log(total + (total == 0.0)) + peak)
        pair_ok = (anchors[:, None] < Na) & (candidates[None, :] < Nb)
        tl.store(LSE + anchors[:, None] * Nb + candidates[None, :], lse, mask=pair_ok)

    @triton.jit
    def _backward_rows_kernel(
        U,
        LWU,
        V,
        LWV,
        GAMMA,
        LSE,
        G,
        R,
        DLW,
        Na,
        Nb,
        Mx,
        My,
        D,
        BA: tl.constexpr,
        MXP: tl.constexpr,
        BB: tl.constexpr,
        MYP: tl.constexpr,
        BD: tl.constexpr,
        BK: tl.constexpr,
        SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDEN: tl.constexpr,
    ):
        """For BA anchors × one chunk of MXP point slots: R[a, i] = Σ_bj Q v_bj, DLW[a, i] = Σ_bj Q,
        Q = G[a, b]·exp(S_{ab,ij} − LSE[a, b]) (LSE already 0 where it was −inf).

        SPLIT (d split across programs): this program owns the BD output dims of program_id(2); the
        scores are recomputed walking the whole d BK at a time, so its registers hold a [rows, BD]
        accumulator however wide d is (DLW is stored by the programs of chunk 0). Otherwise BD ≥ d:
        u is held whole and each score tile is one GEMM."""
        BM: tl.constexpr = BA * MXP
        BN: tl.constexpr = BB * MYP
        gamma = tl.load(GAMMA)
        anchors = tl.program_id(0) * BA + tl.arange(0, BA)
        row_set = (tl.program_id(0) * BA + tl.arange(0, BM) // MXP).to(tl.int64)
        rows = tl.program_id(1) * MXP + tl.arange(0, BM) % MXP
        row_ok = (row_set < Na) & (rows < Mx)
        row_off = row_set * Mx + rows
        dims = tl.program_id(2) * BD + tl.arange(0, BD)
        dim_ok = dims < D
        if not SPLIT:
            u = tl.load(
                U + row_off[:, None] * D + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0
            )
        lwu = tl.load(LWU + row_off, mask=row_ok, other=float("-inf"))
        col_group = tl.arange(0, BN) // MYP
        col_slot = tl.arange(0, BN) % MYP
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        acc_lw = tl.zeros([BM], dtype=tl.float32)
        for cand0 in range(0, Nb, BB):
            candidates = cand0 + tl.arange(0, BB)
            pair_ok = (anchors[:, None] < Na) & (candidates[None, :] < Nb)
            pair_off = anchors[:, None] * Nb + candidates[None, :]
            lse = tl.load(LSE + pair_off, mask=pair_ok, other=0.0)
            g = tl.load(G + pair_off, mask=pair_ok, other=0.0)
            col_set = (cand0 + col_group).to(tl.int64)
            for col0 in range(0, My, MYP):
                cols = col0 + col_slot
                col_ok = (col_set < Nb) & (cols < My)
                col_off = col_set * My + cols
                lwv = tl.load(LWV + col_off, mask=col_ok, other=float("-inf"))
                v = tl.load(
                    V + col_off[:, None] * D + dims[None, :],
                    mask=col_ok[:, None] & dim_ok[None, :],
                    other=0.0,
                )
                if SPLIT:
                    dots = _points_dot(
                        U, V, row_off, row_ok, col_off, col_ok, D, BM, BN, BK, PRECISION, WIDEN
                    )
                else:
                    dots = _dot(u, tl.trans(v), tl.zeros([BM, BN], dtype=tl.float32), PRECISION, WIDEN)
                scores = tl.reshape(gamma * dots + lwu[:, None] + lwv[None, :], [BA, MXP, BB, MYP])
                q = tl.exp(scores - lse[:, None, :, None]) * g[:, None, :, None]
                q = tl.reshape(q, [BM, BN])
                acc_lw += tl.sum(q, axis=1)
                acc = _dot(q.to(v.dtype), v, acc, PRECISION, WIDEN)
        tl.store(R + row_off[:, None] * D + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        if tl.program_id(2) == 0:
            tl.store(DLW + row_off, acc_lw, mask=row_ok)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE fp32 for fp32 points unless torch's fp32 matmul precision allows
    TF32 ("high"/"medium"); bf16/fp16 operands ignore it (they always use the tensor cores)."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def _forward(u: Tensor, logw_u: Tensor, v: Tensor, logw_v: Tensor, gamma: Tensor) -> Tensor:
    """lse [Na, Nb] fp32 of the contiguous inputs."""
    (num_a, mx, d), (num_b, my, _) = u.shape, v.shape
    lse = torch.empty(num_a, num_b, device=u.device, dtype=torch.float32)
    tiles = tiles_for(u.dtype)
    ba, mxp = _slots(mx, tiles.forward_points)
    bb, myp = _slots(my, tiles.forward_points)
    block_k = min(64, max(16, _next_power_of_2(d)))
    grid = (triton.cdiv(num_a, ba), triton.cdiv(num_b, bb))
    _forward_kernel[grid](
        u,
        logw_u,
        v,
        logw_v,
        gamma,
        lse,
        num_a,
        num_b,
        mx,
        my,
        d,
        BA=ba,
        MXP=mxp,
        BB=bb,
        MYP=myp,
        BK=block_k,
        PRECISION=_precision(u.dtype),
        WIDEN=interpreting(),
        num_warps=tiles.forward_warps,
    )
    return lse


def _backward_rows(
    u: Tensor, logw_u: Tensor, v: Tensor, logw_v: Tensor, gamma: Tensor, lse: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor]:
    """(R [Na, Mx, d] = Σ_bj Q v_bj, Σ_bj Q [Na, Mx]), both fp32, for the row side u."""
    (num_a, mx, d), (num_b, my, _) = u.shape, v.shape
    r = torch.empty(num_a, mx, d, device=u.device, dtype=torch.float32)
    dlw = torch.empty(num_a, mx, device=u.device, dtype=torch.float32)
    tiles = tiles_for(u.dtype)
    ba, mxp = _slots(mx, tiles.backward_rows)
    bb, myp = _slots(my, tiles.backward_cols)
    whole = max(16, _next_power_of_2(d))
    split = tiles.backward_dims is not None and tiles.backward_dims < whole
    block_d = tiles.backward_dims if split else whole
    grid = (triton.cdiv(num_a, ba), triton.cdiv(mx, mxp), triton.cdiv(d, block_d))
    _backward_rows_kernel[grid](
        u,
        logw_u,
        v,
        logw_v,
        gamma,
        lse,
        grad,
        r,
        dlw,
        num_a,
        num_b,
        mx,
        my,
        d,
        BA=ba,
        MXP=mxp,
        BB=bb,
        MYP=myp,
        BD=block_d,
        BK=min(64, max(16, _next_power_of_2(d))),
        SPLIT=split,
        PRECISION=_precision(u.dtype),
        WIDEN=interpreting(),
        num_warps=tiles.backward_warps,
    )
    return r, dlw


class _TritonKME(torch.autograd.Function):
    """(u [Na, Mx, d], log w [Na, Mx], v [Nb, My, d], log w' [Nb, My], γ 0-d) -> s [Na, Nb] fp32."""

    @staticmethod
    def forward(ctx, u, logw_u, v, logw_v, gamma):
        lse = _forward(u, logw_u, v, logw_v, gamma)
        ctx.save_for_backward(u, logw_u, v, logw_v, gamma, lse)
        return lse - gamma

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, logw_u, v, logw_v, gamma, lse = ctx.saved_tensors
        need_u, need_wu, need_v, need_wv, need_gamma = ctx.needs_input_grad
        grad = grad_out.float().contiguous()
        # A pair with no real point has lse = −inf: use 0 so its Q is exp(−inf)·g = 0, not NaN.
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        grad_u = grad_wu = grad_v = grad_wv = grad_gamma = None
        if need_u or need_wu or need_gamma:
            r_u, grad_wu = _backward_rows(u, logw_u, v, logw_v, gamma, lse, grad)
            grad_u = (gamma * r_u).to(u.dtype) if need_u else None
            if need_gamma:
                grad_gamma = (u.float() * r_u).sum() - grad.sum()
        if need_v or need_wv:
            r_v, grad_wv = _backward_rows(
                v, logw_v, u, logw_u, gamma, lse.t().contiguous(), grad.t().contiguous()
            )
            grad_v = (gamma * r_v).to(v.dtype) if need_v else None
        return grad_u, grad_wu if need_wu else None, grad_v, grad_wv if need_wv else None, grad_gamma


def kme_logits_triton(a: PointSet, b: PointSet, gamma: Tensor, logw_a: Tensor, logw_b: Tensor) -> Tensor:
    """[Na, Nb] fp32 KME-CLIP logits by the fused kernels.

    a: [Na, Mx, d], b: [Nb, My, d] points on one CUDA device (or CPU under TRITON_INTERPRET=1);
    logw_a [Na, Mx], logw_b [Nb, My]: fp32 log-weights (−inf on masked points, see
    ``kme.log_weights``); gamma: 0-d. Points of different dtypes are promoted to a common one;
    fp64 is computed in fp32 (tl.dot has no fp64 tensor-core path).
    """
    if triton is None:
        raise RuntimeError("implementation='triton' needs the triton package (pip install triton)")
    if not (a.points.is_cuda or interpreting()):
        raise RuntimeError("the triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    dtype = torch.promote_types(a.points.dtype, b.points.dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    u, v = (x.points.to(dtype).contiguous() for x in (a, b))
    if a.num_points == 0 or b.num_points == 0 or a.batch_size == 0 or b.batch_size == 0:
        # No point pair (log 0) or no pair of sets: nothing to launch; keep the graph connected.
        empty = torch.full((a.batch_size, b.batch_size), float("-inf"), device=u.device)
        return empty + 0 * (u.sum() + v.sum() + gamma).float()
    return _TritonKME.apply(
        u, logw_a.float().contiguous(), v, logw_b.float().contiguous(), gamma.float().reshape(())
    )
