"""Triton kernels of the fused sweep (:mod:`clipkit.tiled.fused`): row reductions of the affine dot
matrix L = s·A·Bᵀ + c that never write an N×N tile, and the recomputing backward.

Two kernels serve every direction, because a column reduction of L is a row reduction of
Lᵀ = s·B·Aᵀ + c: the host launches each with (A, B) for the i2t rows and with (B, A) for the t2i
columns.

``_forward_kernel``: a program owns BM rows of its matrix, walks all columns BN at a time (each
tile's GEMM walks d BK at a time, so any d fits) and keeps per row, in registers: an online
log-sum-exp (optionally with separable offsets w_row[r] + w_col[c] and the positive left out), the
running max and its first index, and a row sum of one named pair term (SigLIP's −log σ(z·L), k·L,
or k·exp(L + w)·L). Outputs are [rows] vectors.

``_backward_kernel``: a program owns BM rows × BDO of the d output dims (d is split across programs,
so the fp32 accumulator stays [BM, BDO] whatever d is). For each column block it recomputes the
logit tile, forms the logit gradient G from both directions' reductions (its own rows' and, by
transposition, the columns'), and accumulates R = G·B[:, dims] and Σ_c G. The host gets
dA = s·R, dB = s·Rᵀ-side from the transposed launch, ds = Σ A∘R and dc = Σ G.

Interpreter cost: Triton's interpreter re-patches its language module on every call of a nested
``@triton.jit`` helper, so the kernels call one helper per tile (the tile GEMM) and one per
direction of the backward, and inline the rest under ``tl.constexpr`` branches.

Precision: 16-bit rows go to tl.dot with fp32 accumulation (G is rounded to the inputs' dtype before
G·B, as FlashAttention rounds P); fp32 rows use IEEE fp32 dots (TF32 when torch allows it); fp64 rows
use an fp64 multiply-add loop (exact, slow: the reference path). Every reduction is in the
accumulator dtype (fp32, fp64 for fp64 rows).
"""

from __future__ import annotations

try:  # triton is optional: CPU installs never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _tile_logits(A, B, rows, row_ok, cols, col_ok, D, scale, bias,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
                     FMA: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """[BM, BN] s·A[rows]·B[cols]ᵀ + c in ACC, walking d BK at a time (0 outside the matrix).

        FMA: a multiply-add loop in ACC (fp64, exact). WIDEN (interpreter only): widen 16-bit operands
        to fp32 first (exact), as the interpreter's tl.dot multiplies bf16 bit patterns as integers."""
        ks = tl.arange(0, BK)
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        acc = tl.full([BM, BN], 0.0, dtype=ACC)
        for k0 in range(0, D, BK):
            k = k0 + ks
            k_ok = k < D
            a = tl.load(A + rows64[:, None] * D + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(B + cols64[None, :] * D + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FMA:
                acc += tl.sum(a.to(ACC)[:, :, None] * b.to(ACC)[None, :, :], axis=1)
            else:
                if WIDEN:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
        return acc * scale + bias

    @triton.jit
    def _direction_grad(L, zero, valid, d_rows, d_rows_ok, d_cols, d_cols_ok,
                        TGT, LSE, G_LSE, LSE_ROW, LSE_COL, G_SUM, SUM_ROW, SUM_COL, factor,
                        HAS_LSE: tl.constexpr, LSE_EXCL: tl.constexpr, LSE_HAS_ROW: tl.constexpr,
                        LSE_HAS_COL: tl.constexpr, SUM_KIND: tl.constexpr, SUM_EXCL: tl.constexpr,
                        SUM_HAS_ROW: tl.constexpr, SUM_HAS_COL: tl.constexpr,
                        ROWS_FIRST: tl.constexpr):  # fmt: skip
        """[BM, BN] one direction's Σ_r g_r·∂reduction_r/∂L on the tile; the direction's rows (d_rows)
        are the tile's rows (ROWS_FIRST) or its columns (the transposed direction), so every vector of
        the direction's rows is broadcast as [:, None] or [None, :] accordingly."""
        grad = zero
        tgt = tl.load(TGT + d_rows, mask=d_rows_ok, other=-1)
        if ROWS_FIRST:  # noqa: SIM108 (a static branch of the kernel, not a runtime choice)
            positive = tgt[:, None] == d_cols[None, :]
        else:
            positive = tgt[None, :] == d_cols[:, None]
        if HAS_LSE:
            v = L
            if LSE_HAS_ROW:
                w_row = tl.load(LSE_ROW + d_rows, mask=d_rows_ok, other=0.0).to(L.dtype)
                if ROWS_FIRST:
                    v += w_row[:, None]
                else:
                    v += w_row[None, :]
            if LSE_HAS_COL:
                w_col = tl.load(LSE_COL + d_cols, mask=d_cols_ok, other=0.0).to(L.dtype)
                if ROWS_FIRST:
                    v += w_col[None, :]
                else:
                    v += w_col[:, None]
            keep = valid
            if LSE_EXCL:
                keep = keep & (positive == 0)
            lse = tl.load(LSE + d_rows, mask=d_rows_ok, other=0.0).to(L.dtype)
            g = tl.load(G_LSE + d_rows, mask=d_rows_ok, other=0.0).to(L.dtype)
            # A row with no candidate (lse = −inf) has no softmax: 0, not exp(v + inf).
            g = tl.where(lse > float("-inf"), g, 0.0)
            lse = tl.where(lse > float("-inf"), lse, 0.0)
            if ROWS_FIRST:
                grad += tl.where(keep, tl.exp(v - lse[:, None]), 0.0) * g[:, None]
            else:
                grad += tl.where(keep, tl.exp(v - lse[None, :]), 0.0) * g[None, :]
        if SUM_KIND != 0:
            if SUM_KIND == 1:  # ∂ softplus(−z·L)/∂L = −z·σ(−z·L)
                x = tl.where(positive, -L, L)
                e = tl.exp(-tl.abs(x))
                sig = tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
                term = tl.where(positive, -sig, sig)
            elif SUM_KIND == 2:
                term = zero + factor
            else:  # factor·exp(L + w), the softmax weight a constant
                w = zero
                if SUM_HAS_ROW:
                    s_row = tl.load(SUM_ROW + d_rows, mask=d_rows_ok, other=0.0).to(L.dtype)
                    if ROWS_FIRST:
                        w += s_row[:, None]
                    else:
                        w += s_row[None, :]
                if SUM_HAS_COL:
                    s_col = tl.load(SUM_COL + d_cols, mask=d_cols_ok, other=0.0).to(L.dtype)
                    if ROWS_FIRST:
                        w += s_col[None, :]
                    else:
                        w += s_col[:, None]
                term = tl.exp(L + w) * factor
                if SUM_EXCL:
                    term = tl.where(positive, 0.0, term)
            g = tl.load(G_SUM + d_rows, mask=d_rows_ok, other=0.0).to(L.dtype)
            if ROWS_FIRST:
                grad += tl.where(valid, term, 0.0) * g[:, None]
            else:
                grad += tl.where(valid, term, 0.0) * g[None, :]
        return grad

    @triton.jit
    def _forward_kernel(A, B, SCALE, BIAS, TGT, LSE_ROW, LSE_COL, SUM_ROW, SUM_COL,
                        OUT_LSE, OUT_MAX, OUT_ARG, OUT_SUM, N, M, D, factor,
                        HAS_LSE: tl.constexpr, LSE_EXCL: tl.constexpr,
                        LSE_HAS_ROW: tl.constexpr, LSE_HAS_COL: tl.constexpr, HAS_MAX: tl.constexpr,
                        SUM_KIND: tl.constexpr, SUM_EXCL: tl.constexpr, SUM_HAS_ROW: tl.constexpr,
                        SUM_HAS_COL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, ACC: tl.constexpr, FMA: tl.constexpr, WIDEN: tl.constexpr,
                        PRECISION: tl.constexpr):  # fmt: skip
        """Row reductions of L = s·A·Bᵀ + c (A [N, D], B [M, D]) for BM rows: OUT_LSE, OUT_MAX /
        OUT_ARG, OUT_SUM [N] (those whose flag is set). SUM_KIND (clipkit.tiled.fused.SUM_*): 1 SigLIP's
        softplus(−z·L), 2 factor·L, 3 factor·exp(L + w)·L."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < N
        scale = tl.load(SCALE).to(ACC)
        bias = tl.load(BIAS).to(ACC)  # 0 when the similarity has no bias
        tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
        lse_row = tl.full([BM], 0, dtype=ACC)
        if LSE_HAS_ROW:
            lse_row = tl.load(LSE_ROW + rows, mask=row_ok, other=0.0).to(ACC)
        sum_row = tl.full([BM], 0, dtype=ACC)
        if SUM_HAS_ROW:
            sum_row = tl.load(SUM_ROW + rows, mask=row_ok, other=0.0).to(ACC)
        peak = tl.full([BM], float("-inf"), dtype=ACC)
        total = tl.full([BM], 0, dtype=ACC)
        best = tl.full([BM], float("-inf"), dtype=ACC)
        best_at = tl.full([BM], 0, dtype=tl.int64)
        row_sum = tl.full([BM], 0, dtype=ACC)
        zero = tl.full([BM, BN], 0.0, dtype=ACC)
        for c0 in range(0, M, BN):
            cols = c0 + tl.arange(0, BN)
            col_ok = cols < M
            L = _tile_logits(A, B, rows, row_ok, cols, col_ok, D, scale, bias, BM, BN, BK, ACC, FMA, WIDEN,
                             PRECISION)  # fmt: skip
            valid = row_ok[:, None] & col_ok[None, :]
            positive = cols[None, :] == tgt[:, None]
            if HAS_LSE:
                v = L + lse_row[:, None]
                if LSE_HAS_COL:
                    v += tl.load(LSE_COL + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
                keep = valid
                if LSE_EXCL:
                    keep = keep & (positive == 0)
                v = tl.where(keep, v, float("-inf"))
                new_peak = tl.maximum(peak, tl.max(v, axis=1))
                # −inf (no candidate yet) would give −inf − (−inf) = NaN: shift by 0 instead.
                shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
                total = total * tl.exp(peak - shift) + tl.sum(tl.exp(v - shift[:, None]), axis=1)
                peak = new_peak
            if HAS_MAX:
                masked = tl.where(valid, L, float("-inf"))
                tile_best = tl.max(masked, axis=1)
                tile_at = tl.argmax(masked, axis=1, tie_break_left=True).to(tl.int64) + c0
                better = tile_best > best  # strict: the earliest column wins ties, as torch.argmax
                best = tl.where(better, tile_best, best)
                best_at = tl.where(better, tile_at, best_at)
            if SUM_KIND != 0:
                if SUM_KIND == 1:  # −log σ(z·L) = softplus(x), x = −z·L
                    x = tl.where(positive, -L, L)
                    y = tl.exp(-tl.abs(x))
                    u = 1.0 + y  # log1p(y) by Goldberg's trick (no libdevice: also runs interpreted)
                    terms = tl.maximum(x, 0.0) + tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
                elif SUM_KIND == 2:
                    terms = L * factor
                else:
                    w = zero + sum_row[:, None]
                    if SUM_HAS_COL:
                        w += tl.load(SUM_COL + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
                    terms = tl.exp(L + w) * factor * L
                    if SUM_EXCL:
                        terms = tl.where(positive, 0.0, terms)
                row_sum += tl.sum(tl.where(valid, terms, 0.0), axis=1)
        if HAS_LSE:
            # A row with no candidate gets −inf; log(1) keeps log(0) out of the arithmetic.
            lse = tl.where(total == 0.0, float("-inf"), tl.log(total + (total == 0.0)) + peak)
            tl.store(OUT_LSE + rows, lse, mask=row_ok)
        if HAS_MAX:
            tl.store(OUT_MAX + rows, best, mask=row_ok)
            tl.store(OUT_ARG + rows, best_at, mask=row_ok)
        if SUM_KIND != 0:
            tl.store(OUT_SUM + rows, row_sum, mask=row_ok)

    @triton.jit
    def _backward_kernel(A, B, SCALE, BIAS, OUT_R, OUT_G, N, M, D,
                         TGT, LSE, G_LSE, LSE_ROW, LSE_COL, G_SUM, SUM_ROW, SUM_COL, factor,
                         T_TGT, T_LSE, T_G_LSE, T_LSE_ROW, T_LSE_COL, T_G_SUM, T_SUM_ROW, T_SUM_COL, t_factor,
                         HAS_LSE: tl.constexpr, LSE_EXCL: tl.constexpr, LSE_HAS_ROW: tl.constexpr,
                         LSE_HAS_COL: tl.constexpr, SUM_KIND: tl.constexpr, SUM_EXCL: tl.constexpr,
                         SUM_HAS_ROW: tl.constexpr, SUM_HAS_COL: tl.constexpr,
                         T_HAS_LSE: tl.constexpr, T_LSE_EXCL: tl.constexpr, T_LSE_HAS_ROW: tl.constexpr,
                         T_LSE_HAS_COL: tl.constexpr, T_SUM_KIND: tl.constexpr, T_SUM_EXCL: tl.constexpr,
                         T_SUM_HAS_ROW: tl.constexpr, T_SUM_HAS_COL: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BDO: tl.constexpr,
                         ACC: tl.constexpr, FMA: tl.constexpr, WIDEN: tl.constexpr,
                         PRECISION: tl.constexpr):  # fmt: skip
        """OUT_R[rows, dims] = Σ_c G[r, c]·B[c, dims] and OUT_G[rows] = Σ_c G[r, c] (program_id(1) == 0)
        for BM rows × BDO dims, G the logit gradient of the rows' direction (unprefixed arguments) and
        of the columns' direction (T_ arguments, indexed by column)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < N
        dims = tl.program_id(1) * BDO + tl.arange(0, BDO)
        dim_ok = dims < D
        scale = tl.load(SCALE).to(ACC)
        bias = tl.load(BIAS).to(ACC)
        acc = tl.full([BM, BDO], 0.0, dtype=ACC)
        g_sum = tl.full([BM], 0, dtype=ACC)
        zero = tl.full([BM, BN], 0.0, dtype=ACC)
        for c0 in range(0, M, BN):
            cols = c0 + tl.arange(0, BN)
            col_ok = cols < M
            L = _tile_logits(A, B, rows, row_ok, cols, col_ok, D, scale, bias, BM, BN, BK, ACC, FMA, WIDEN,
                             PRECISION)  # fmt: skip
            valid = row_ok[:, None] & col_ok[None, :]
            G = zero
            if HAS_LSE or SUM_KIND != 0:
                G += _direction_grad(L, zero, valid, rows, row_ok, cols, col_ok, TGT, LSE, G_LSE, LSE_ROW,
                                     LSE_COL, G_SUM, SUM_ROW, SUM_COL, factor, HAS_LSE, LSE_EXCL,
                                     LSE_HAS_ROW, LSE_HAS_COL, SUM_KIND, SUM_EXCL, SUM_HAS_ROW,
                                     SUM_HAS_COL, True)  # fmt: skip
            if T_HAS_LSE or T_SUM_KIND != 0:
                G += _direction_grad(L, zero, valid, cols, col_ok, rows, row_ok, T_TGT, T_LSE, T_G_LSE,
                                     T_LSE_ROW, T_LSE_COL, T_G_SUM, T_SUM_ROW, T_SUM_COL, t_factor, T_HAS_LSE,
                                     T_LSE_EXCL, T_LSE_HAS_ROW, T_LSE_HAS_COL, T_SUM_KIND, T_SUM_EXCL,
                                     T_SUM_HAS_ROW, T_SUM_HAS_COL, False)  # fmt: skip
            g_sum += tl.sum(G, axis=1)
            b = tl.load(B + cols.to(tl.int64)[:, None] * D + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
            if FMA:
                acc += tl.sum(G[:, :, None] * b.to(ACC)[None, :, :], axis=1)
            else:
                # 16-bit rows: G rounded to their dtype for the tensor cores (FlashAttention rounds P).
                g_in = G.to(b.dtype)
                if WIDEN:
                    g_in = g_in.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(g_in, b, acc, input_precision=PRECISION)
        out = rows.to(tl.int64)[:, None] * D + dims[None, :]
        tl.store(OUT_R + out, acc, mask=row_ok[:, None] & dim_ok[None, :])
        if tl.program_id(1) == 0:
            tl.store(OUT_G + rows, g_sum, mask=row_ok)
