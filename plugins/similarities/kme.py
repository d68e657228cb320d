"""`kme`: KME-CLIP's similarity, the log of an RKHS inner product of weighted point sets (METHODS.md §3).

For point sets X = {(u_i, w_i)}, Y = {(v_j, w'_j)} of unit vectors and the Gaussian kernel
k(u, v) = exp(−γ‖u − v‖²/2) = exp(γ(u·v − 1)) on the sphere,

    s(X, Y) = log Σ_ij w_i w'_j exp(γ(u_i·v_j − 1)) = lse_ij(log w_i + log w'_j + γ u_i·v_j) − γ,

with γ = exp(t) learnable (init 1/0.07, so that with M = 1 and w = 1 KME-CLIP starts exactly as
CLIP: Proposition 2, s = γ u·v − γ). These are the logits directly: γ is the temperature.

Weights (a choice the spec leaves to us):
- ``PointSet.weights`` given: the encoder's raw positive weights w_i are used as they are, NOT
  renormalised to sum to 1. Their total mass is part of what the model learns (the KME is
  Σ_i w_i φ(u_i), not a probability mixture), and log-total-mass only adds log Σw + log Σw' to
  the logit, which InfoNCE sees as a per-row/column shift, not a constant.
- weights None: uniform 1/M_real over the real (unmasked) points of each set, so a plain
  encoder's set is the empirical mean embedding (as WPSE §2).
- Masked points contribute nothing (log w = −inf). A set with no real point gets s = −inf
  and zero gradient.

Cost: the logits need N_a·N_b·M_x·M_y kernel values (2·N_a·N_b·M_x·M_y·d FLOPs). They are
computed the way memory-efficient attention is (a GEMM followed by a segmented log-sum-exp),
holding at most one tile of scores at a time, in forward and in backward (which recomputes them):
- "blockwise" (any device; the CPU path): a custom autograd Function over tiles of sets, each tile
  one GEMM plus in-place log-sum-exp; tiles of about :data:`TILE_SCORES` scores by default.
- "triton" (CUDA; chosen automatically for bf16/fp16 points, or fp32 with TF32 allowed, when
  triton imports): fused kernels, plugins/similarities/kme_triton.py.
- :func:`kme_logits_naive` is the einsum reference the two are tested against.

Hand-derived cases (tested): one point each, w = 1: s = γ(u·v − 1); u = e1, v = (0.6, 0.8), γ = 10
gives −4. Two image points e1, e2 with weights (1, 3) against v = e1, γ = 2:
s = log(1·e^0 + 3·e^{−2}) = log(1 + 3e^{−2}).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from clipkit.config.constraints import POSITIVE, OneOf
from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.similarities.temperature import bounded_exp, check_start, log_bounds, register_log_value


def log_weights(x: PointSet, dtype: torch.dtype) -> Tensor:
    """[B, M] log w_i in ``dtype``: log of the raw weights, or −log M_real when weights is None;
    −inf on masked points.

    The masked weights are replaced by 1 *before* the log (a zero or garbage weight under the
    mask must not send a NaN gradient back through ``log``). An exact zero weight on a real point
    (softplus underflows to 0 in fp32 below about −104) gets log w = −inf with a zero gradient:
    the point contributes nothing, and ``log``'s 1/w = inf times the zero upstream gradient would
    be NaN. Zero is also what the fp32 chain through softplus gives there (sigmoid(−104) ≈ 0).
    """
    if x.weight_normalization != "sum":
        # log w needs w > 0; "count" weights (the WPSE authors' scaled tanh) may be negative.
        raise ValueError(
            f"kme needs positive weights (weight_normalization='sum', e.g. softplus weights); "
            f"got weight_normalization={x.weight_normalization!r}"
        )
    mask = x.mask
    if x.weights is not None:
        weights = x.weights.to(dtype)
        if mask is not None:
            weights = torch.where(mask, weights, torch.ones_like(weights))
        zero = weights == 0
        logw = torch.where(zero, torch.ones_like(weights), weights).log().masked_fill(zero, float("-inf"))
    else:
        count = x.points.new_full((x.batch_size, 1), float(x.num_points), dtype=dtype)
        if mask is not None:
            count = mask.sum(dim=1, keepdim=True).to(dtype).clamp_min(1.0)
        logw = (-count.log()).expand(x.batch_size, x.num_points)
    if mask is not None:
        logw = logw.masked_fill(~mask, float("-inf"))
    return logw


#: Scores per tile of the block-wise path on CPU when ``block_size`` is None: 2^20 fp32 scores =
#: 4 MiB (one reused buffer). Among 2^16..2^22 it was within 8 % of the fastest for each of three
#: shapes on this 2-core EPYC box (docs/benchmarks.md). The tile is independent of N, so peak
#: memory is O(N² + inputs) whatever the set sizes.
TILE_SCORES = 1 << 20
#: The same on CUDA (the block-wise path serves fp32 points there by default): 2^24 scores = 64 MiB,
#: 16× fewer tiles, so 16× fewer kernel launches from the Python loop. Not measured (no GPU here).
CUDA_TILE_SCORES = 1 << 24

#: Values of ``implementation``: "auto" = "triton" for CUDA inputs when triton imports and the
#: tensor cores apply (see :func:`_triton_applies`), else "blockwise" (the chunked torch path, any
#: device); "naive" = the full einsum reference.
IMPLEMENTATIONS = ("auto", "blockwise", "triton", "naive")


def tile_shape(
    num_a: int, num_b: int, mx: int, my: int, block_size: int | None, scores: int | None = None
) -> tuple[int, int]:
    """(anchors, candidates) per tile of the block-wise path.

    An explicit ``block_size`` gives square tiles of block_size × block_size sets. None sizes the
    tile to about ``scores`` (default :data:`TILE_SCORES`) scores, split so both GEMM operands have
    about as many points (ba·Mx ≈ bb·My ≈ sqrt(scores)): a balanced GEMM, and a tile that stays
    bounded when M grows (2^20 scores, ViT-B/16 × text: 5 anchors × 13 captions; M = 1: 1024 × 1024).
    """
    if block_size is not None:
        return max(1, min(block_size, num_a)), max(1, min(block_size, num_b))
    scores = TILE_SCORES if scores is None else scores
    rows = max(1, min(num_a, round(scores**0.5 / max(mx, 1))))
    cols = max(1, min(num_b, int(scores // (rows * max(mx, 1) * max(my, 1)))))
    return rows, cols


def largest_square_tile(mx: int, my: int, scores: int = TILE_SCORES) -> int:
    """The largest t with ``tile_shape(t, t, mx, my, None, scores) == (t, t)``: t × t sets in one block."""
    side = max(1, min(round(scores**0.5 / max(mx, 1)), math.isqrt(scores // max(mx * my, 1))))
    while side > 1 and tile_shape(side, side, mx, my, None, scores) != (side, side):
        side -= 1
    return side


def _blocks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _tile_scores(
    scaled_u: Tensor, logw_u: Tensor, v: Tensor, logw_v: Tensor, rows: slice, cols: slice, buffer: Tensor
) -> Tensor:
    """One tile's scores log w_i + log w'_j + γ u_i·v_j -> [ba, Mx, bb, My], written into ``buffer``.

    scaled_u: [Na, Mx, d] = γ·u (scaled once per call, which saves a pass over every tile);
    v: [Nb, My, d]; logw_u: [Na, Mx]; logw_v: [Nb, My]; buffer: flat, ≥ ba·Mx·bb·My values, reused
    by every tile (a fresh 4 MiB tile per GEMM costs page faults: measured 47 vs 64 GFLOP/s here).
    The layout [ba, Mx, bb, My] is the plain GEMM output reshaped: no permute/copy. The two
    broadcast adds are in place.
    """
    ub, vb = scaled_u[rows], v[cols]
    ba, mx, d = ub.shape
    bb, my, _ = vb.shape
    scores = buffer[: ba * mx * bb * my].view(ba * mx, bb * my)
    torch.mm(ub.reshape(ba * mx, d), vb.reshape(bb * my, d).t(), out=scores)
    scores = scores.view(ba, mx, bb, my)
    return scores.add_(logw_u[rows].view(ba, mx, 1, 1)).add_(logw_v[cols].view(1, 1, bb, my))


def _tile_buffer(u: Tensor, v: Tensor, tile: tuple[int, int]) -> Tensor:
    """Flat scratch for the largest tile: min(ba, Na)·Mx·min(bb, Nb)·My values."""
    (num_a, mx, _), (num_b, my, _) = u.shape, v.shape
    return u.new_empty(min(tile[0], num_a) * mx * min(tile[1], num_b) * my)


def _reduce_pairs(scores: Tensor, reduce) -> Tensor:
    """[ba, Mx, bb, My] -> [ba, bb] with ``reduce`` (Tensor.amax or Tensor.sum) over i, then over j.

    Two passes beat one over dims (1, 3): reducing dim 1 runs along contiguous rows of bb·My values
    (vectorised), then dim 3 is the last dim of a tensor Mx times smaller. Measured on this CPU
    for a [20, 50, 52, 20] tile: amax 0.15 ms vs 5.6 ms for amax(dim=(1, 3)). Size-1 dims are
    indexed away (their "reduction" would be a copy). Always returns a fresh tensor.
    """
    pairs = reduce(scores, dim=1) if scores.shape[1] > 1 else scores[:, 0].clone()
    return reduce(pairs, dim=-1) if pairs.shape[-1] > 1 else pairs[..., 0]


def _pair_logsumexp_(scores: Tensor) -> tuple[Tensor, Tensor]:
    """[ba, Mx, bb, My] -> (lse [ba, bb] over (i, j), shift [ba, bb]), overwriting ``scores`` with
    exp(score − shift) (no temporaries of the tile's size). shift is the pair's max score, or 0 for
    a pair with no real point (all −inf), whose lse is then −inf, not NaN."""
    peak = _reduce_pairs(scores, Tensor.amax)
    shift = peak.masked_fill(torch.isneginf(peak), 0.0)
    scores.sub_(shift[:, None, :, None]).exp_()
    return _reduce_pairs(scores, Tensor.sum).log_().add_(shift), shift


class _BlockwiseKME(torch.autograd.Function):
    """s_ab = lse_{i,j}(log w_ai + log w'_bj + γ u_ai·v_bj) − γ, one [ba, bb] tile of sets at a time.

    Saved for backward: the inputs and lse [Na, Nb] only. With P_{ab,ij} the softmax over (i, j)
    of the scores of pair (a, b), g_ab the incoming gradient and Q = g_ab·P_{ab,ij}:

        ∂L/∂u_ai      = γ Σ_bj Q v_bj           ∂L/∂log w_ai  = Σ_bj Q
        ∂L/∂v_bj      = γ Σ_ai Q u_ai           ∂L/∂log w'_bj = Σ_ai Q
        ∂L/∂γ         = Σ_ab g_ab (Σ_ij P u_ai·v_bj − 1) = Σ_ai u_ai·(Σ_bj Q v_bj) − Σ_ab g_ab

    Backward recomputes each tile's scores, turns them into Q in place and reduces Q with two
    GEMMs accumulated in place (addmm_): R = Q @ V (which serves both ∂u = γR and, summed at the
    end, ∂γ = Σ u·R − Σg) and Qᵀ @ (γU) for ∂v. (Mx = My = 1 skips the recompute: Q = g.) Peak
    memory: inputs, their gradients, [Na, Nb] and one tile (ba·Mx·bb·My scores) — never Na·Nb·Mx·My.
    """

    @staticmethod
    def forward(ctx, u, logw_u, v, logw_v, gamma, tile):
        scaled_u = u * gamma
        lse = u.new_empty(u.shape[0], v.shape[0])
        buffer = _tile_buffer(u, v, tile)
        row_blocks, col_blocks = _blocks(u.shape[0], tile[0]), _blocks(v.shape[0], tile[1])
        one_pair = u.shape[1] == v.shape[1] == 1
        for rows in row_blocks:
            for cols in col_blocks:
                scores = _tile_scores(scaled_u, logw_u, v, logw_v, rows, cols, buffer)
                if one_pair:  # one point pair per (a, b): its lse is the score itself
                    lse[rows, cols] = scores.view(scores.shape[0], scores.shape[2])
                else:
                    lse[rows, cols], shift = _pair_logsumexp_(scores)
        ctx.tile = tile
        if len(row_blocks) == len(col_blocks) == 1 and not one_pair:
            # The whole problem is one tile (≤ TILE_SCORES scores): keep exp(s − shift), which
            # spares backward the recompute GEMM; bigger problems never keep more than [Na, Nb].
            ctx.save_for_backward(u, logw_u, v, logw_v, gamma, lse, scores, shift)
        else:
            ctx.save_for_backward(u, logw_u, v, logw_v, gamma, lse)
        return lse - gamma

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, logw_u, v, logw_v, gamma, lse, *kept_tile = ctx.saved_tensors
        need_u, need_wu, need_v, need_wv, need_gamma, _ = ctx.needs_input_grad
        (num_a, mx, d), (num_b, my, _) = u.shape, v.shape
        scaled_u = u * gamma
        # R = Σ_bj Q v_bj per anchor point, flat [Na·Mx, d]: ∂u = γR and ∂γ = Σ u·R − Σg.
        q_v = u.new_zeros(num_a * mx, d) if need_u or need_gamma else None
        grad_v = v.new_zeros(num_b * my, d) if need_v else None
        grad_wu = torch.zeros_like(logw_u) if need_wu else None
        grad_wv = torch.zeros_like(logw_v) if need_wv else None
        flat_v = v.reshape(num_b * my, d)
        flat_scaled_u = scaled_u.reshape(num_a * mx, d)
        tiles = _backward_tiles(scaled_u, logw_u, v, logw_v, lse, grad_out, ctx.tile, kept_tile)
        for rows, cols, q in tiles:
            points_a = slice(rows.start * mx, rows.stop * mx)
            points_b = slice(cols.start * my, cols.stop * my)
            if need_wu:
                grad_wu[rows] += q.sum(dim=(2, 3))
            if need_wv:
                grad_wv[cols] += q.sum(dim=(0, 1))
            flat_q = q.view(q.shape[0] * mx, q.shape[2] * my)
            if q_v is not None:
                q_v[points_a].addmm_(flat_q, flat_v[points_b])
            if need_v:
                grad_v[points_b].addmm_(flat_q.t(), flat_scaled_u[points_a])
        grad_gamma = None
        if need_gamma:
            grad_gamma = (u.reshape(num_a * mx, d) * q_v).sum() - grad_out.sum()
        grad_u = q_v.mul_(gamma).view_as(u) if need_u else None  # in place: one [Na·Mx, d] buffer less
        if need_v:
            grad_v = grad_v.view_as(v)
        return grad_u, grad_wu, grad_v, grad_wv, grad_gamma, None


def _backward_tiles(scaled_u, logw_u, v, logw_v, lse, grad_out, tile, kept_tile):
    """Yield (rows, cols, Q [ba, Mx, bb, My]) with Q = g_ab·P_{ab,ij}, tile by tile (one reused buffer).

    No recompute in two cases: Mx = My = 1 (CLIP's case, Proposition 2), where each (a, b) has one
    point pair, so its softmax is 1 (0 for a masked point, whose lse is −inf) and Q = g; and a
    problem that was one tile, whose exp(s − shift) forward kept: P = exp(s − shift)·exp(shift − lse).
    """
    (num_a, mx, _), (num_b, my, _) = scaled_u.shape, v.shape
    empty = torch.isneginf(lse)  # a set with no real point (lse cannot be +inf or NaN for finite inputs)
    everything = slice(0, num_a), slice(0, num_b)
    if mx == 1 and my == 1:
        yield *everything, grad_out.masked_fill(empty, 0.0).view(num_a, 1, num_b, 1)
        return
    if kept_tile:
        exp_scores, shift = kept_tile
        factor = (shift - lse).exp_().masked_fill_(empty, 0.0).mul_(grad_out)
        yield *everything, exp_scores * factor[:, None, :, None]
        return
    # Subtract 0 instead of −inf for an empty set, so its P is exp(−inf) = 0, not NaN.
    lse = lse.masked_fill(empty, 0.0)
    buffer = _tile_buffer(scaled_u, v, tile)
    for rows in _blocks(num_a, tile[0]):
        for cols in _blocks(num_b, tile[1]):
            q = _tile_scores(scaled_u, logw_u, v, logw_v, rows, cols, buffer)
            q.sub_(lse[rows, cols][:, None, :, None]).exp_().mul_(grad_out[rows, cols][:, None, :, None])
            yield rows, cols, q


def _validate(a: PointSet, b: PointSet, block_size: int | None, implementation: str) -> None:
    if a.dim != b.dim:
        raise ValueError(f"point dimensions differ: a has d = {a.dim}, b has d = {b.dim}")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be > 0 or None, got {block_size}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def _compute_dtype(a: PointSet, b: PointSet) -> torch.dtype:
    """fp32 for inputs below fp32 (the lse of thousands of exponentials needs it); fp64 stays fp64."""
    return torch.promote_types(torch.promote_types(a.points.dtype, b.points.dtype), torch.float32)


def kme_logits(
    a: PointSet,
    b: PointSet,
    gamma: Tensor,
    block_size: int | None = None,
    implementation: str = "auto",
) -> Tensor:
    """[Na, Nb] KME-CLIP logits s(a_i, b_j) (see the module docstring).

    a: [Na, Mx, d], b: [Nb, My, d]; gamma: 0-d tensor (already clamped).
    block_size:     sets per side of a tile of the block-wise path; None = tiles of about
                    :data:`TILE_SCORES` scores (see :func:`tile_shape`). Ignored by "triton".
    implementation: one of :data:`IMPLEMENTATIONS`. "blockwise" upcasts inputs below fp32 (bf16,
                    fp16) to fp32 before any arithmetic; "triton" keeps bf16/fp16 points for the
                    tensor-core GEMMs and accumulates in fp32 (plugins/similarities/kme_triton.py).
    """
    _validate(a, b, block_size, implementation)
    if implementation == "auto":
        implementation = "triton" if _triton_applies(a, b) else "blockwise"
    if implementation == "naive":
        return kme_logits_naive(a, b, gamma)
    dtype = _compute_dtype(a, b)
    if implementation == "triton":
        from . import kme_triton

        return kme_triton.kme_logits_triton(
            a, b, gamma, log_weights(a, torch.float32), log_weights(b, torch.float32)
        )
    if a.num_points == 0 or b.num_points == 0:  # no point pair at all: log 0
        empty = a.points.new_full((a.batch_size, b.batch_size), float("-inf"), dtype=dtype)
        return empty + 0 * (a.points.sum() + b.points.sum() + gamma).to(dtype)
    scores = CUDA_TILE_SCORES if a.points.is_cuda else TILE_SCORES
    tile = tile_shape(a.batch_size, b.batch_size, a.num_points, b.num_points, block_size, scores)
    return _BlockwiseKME.apply(
        a.points.to(dtype),
        log_weights(a, dtype),
        b.points.to(dtype),
        log_weights(b, dtype),
        gamma.to(dtype),
        tile,
    )


def kme_logits_naive(a: PointSet, b: PointSet, gamma: Tensor) -> Tensor:
    """The reference: materialise all Na·Nb·Mx·My scores and log-sum-exp them (plain autograd).

    Same formula, weight rule and dtype rule as :func:`kme_logits`; memory O(Na·Nb·Mx·My) forward
    and backward. For tests and benchmarks only.
    """
    if a.dim != b.dim:
        raise ValueError(f"point dimensions differ: a has d = {a.dim}, b has d = {b.dim}")
    dtype = _compute_dtype(a, b)
    gamma = gamma.to(dtype)
    logw_a, logw_b = log_weights(a, dtype), log_weights(b, dtype)
    dots = torch.einsum("amd,bnd->abmn", a.points.to(dtype), b.points.to(dtype))
    scores = (logw_a[:, None, :, None] + logw_b[None, :, None, :] + gamma * dots).flatten(2)
    empty_a, empty_b = (torch.isneginf(logw).all(dim=1) for logw in (logw_a, logw_b))
    return _set_logits(scores, empty_a[:, None] | empty_b[None, :], gamma)


def _set_logits(scores: Tensor, empty: Tensor, gamma: Tensor) -> Tensor:
    """[...] lse over the last dim of ``scores`` [..., S] minus γ; a pair with a set without real
    points (``empty`` [...]) gets −inf with zero (not NaN) gradient, as the fast paths give."""
    lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(scores), scores), dim=-1)
    return torch.where(empty, float("-inf"), lse) - gamma


def kme_pair_logits(a: PointSet, b: PointSet, gamma: Tensor) -> Tensor:
    """[n] s(a_r, b_r) of row-aligned sets a: [n, Mx, d], b: [n, My, d] (the diagonal of
    :func:`kme_logits`, same weight and dtype rules; memory O(n·Mx·My))."""
    if a.batch_size != b.batch_size:
        raise ValueError(
            f"row-aligned pairs need as many sets on both sides, got {a.batch_size} and {b.batch_size}"
        )
    dtype = _compute_dtype(a, b)
    gamma = gamma.to(dtype)
    logw_a, logw_b = log_weights(a, dtype), log_weights(b, dtype)
    dots = torch.einsum("nmd,nkd->nmk", a.points.to(dtype), b.points.to(dtype))
    scores = (logw_a[:, :, None] + logw_b[:, None, :] + gamma * dots).flatten(1)
    empty = torch.isneginf(logw_a).all(dim=1) | torch.isneginf(logw_b).all(dim=1)
    return _set_logits(scores, empty, gamma)


def _triton_applies(a: PointSet, b: PointSet) -> bool:
    """Whether "auto" picks the fused kernels: CUDA points, triton importable, and GEMMs that can use the
    tensor cores: bf16/fp16 points, or fp32 points when torch allows TF32 for fp32 matmuls
    (torch.set_float32_matmul_precision("high")). fp32 at the default "highest" precision stays on
    the block-wise path: there tl.dot lowers to FMA, not MMA (benchmarks/kme_triton_resources.py),
    which is unlikely to beat cuBLAS SGEMM (not measured: no GPU here)."""
    if not (a.points.is_cuda and b.points.is_cuda):
        return False
    dtypes = {a.points.dtype, b.points.dtype}
    if dtypes - {torch.float32, torch.bfloat16, torch.float16}:
        return False
    if torch.float32 in dtypes and torch.get_float32_matmul_precision() == "highest":
        return False
    from . import kme_triton

    return kme_triton.available()


#: ``matmul_dtype`` values: the dtype of the points in the u·v products.
MATMUL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _point_set(features: tuple[Tensor, ...], normalization: str = "sum") -> PointSet:
    """The PointSet of :meth:`KMESimilarity.tile_features` rows ([B, 0] weights / mask = None)."""
    points, weights, mask = features
    return PointSet(
        points,
        None if weights.shape[1] == 0 else weights,
        None if mask.shape[1] == 0 else mask,
        normalization,
    )


def _points_as(x: PointSet, dtype: torch.dtype) -> PointSet:
    """The same point set with its points (only) in ``dtype``; differentiable."""
    return PointSet(x.points.to(dtype), x.weights, x.mask, x.weight_normalization)


class KMESimilarity(nn.Module):
    """KME-CLIP (METHODS.md §3): L_ab = log Σ_ij w_i w'_j exp(γ(u_i·v_j − 1)), γ = exp(t).

    init_gamma:  initial γ = 1/σ² (1/0.07, so that M = 1 starts exactly as CLIP's logit scale:
                 seed 003 Prop. 2, METHODS §3; the paper learns σ through a reparameterisation
                 but its legible text gives no numeric start; WPSE's official code starts its
                 logit scale at 14.29 = 1/0.07 too, METHODS §11). A recipe sets it as
                 ``similarity: {name: kme, init_gamma: ...}``; ``clipkit experiment
                 pmi-fidelity --kme-init-gamma`` for the PMI study.
    learn_gamma: learn t = log γ; otherwise γ is a fixed buffer.
    max_gamma:   γ is clamped to at most this in the forward pass (CLIP's and WPSE's official
                 logit-scale clamp: 100), which stops its gradient above the clamp; None = no
                 clamp (recipe ``max_gamma: null``; ``--kme-max-gamma 0`` in the PMI study).
    block_size:  anchors (= candidates) per tile of the block-wise computation; a tile holds
                 block_size²·Mx·My fp32 scores (16² · 197 · 77 ≈ 3.9 M floats ≈ 16 MB for ViT-B/16).
                 None (default): tiles of about 2^20 scores whatever Mx, My (:func:`tile_shape`).
    implementation: "auto" (the fused triton kernels for bf16/fp16 CUDA points, or fp32 with TF32
                 allowed, when triton imports; else the block-wise path), "blockwise", "triton"
                 or "naive" (the reference; tests and benchmarks only).
    matmul_dtype: "float32" (default: the loop hands the similarity fp32 points, METHODS §11) or
                 "bfloat16": the points are rounded to bf16 for the u·v products (fp32
                 accumulation and log-sum-exp), which on CUDA selects the Triton tensor-core
                 kernels. Opt-in: a dot product off by bf16 rounding (~2^-8 relative) moves a
                 logit by up to γ times that.

    ``embed`` returns None (the log of a kernel sum does not factorise into one matrix product);
    ``ensemble`` unions the prompts' weighted point sets (mean of RKHS embeddings).
    """

    def __init__(
        self,
        init_gamma: Annotated[float, POSITIVE] = 1 / 0.07,
        learn_gamma: bool = True,
        max_gamma: Annotated[float | None, POSITIVE] = 100.0,
        block_size: Annotated[int | None, POSITIVE] = None,
        implementation: Annotated[str, OneOf(IMPLEMENTATIONS)] = "auto",
        matmul_dtype: Annotated[str, OneOf(tuple(MATMUL_DTYPES))] = "float32",
    ) -> None:
        super().__init__()
        if matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {tuple(MATMUL_DTYPES)}, got {matmul_dtype!r}")
        if not init_gamma > 0:
            raise ValueError(f"init_gamma must be > 0, got {init_gamma}")
        if max_gamma is not None and not max_gamma > 0:
            raise ValueError(f"max_gamma must be > 0 or None, got {max_gamma}")
        if block_size is not None and (int(block_size) != block_size or block_size <= 0):
            raise ValueError(f"block_size must be a positive integer or None, got {block_size}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        check_start("init_gamma", init_gamma, "max_gamma", max_gamma)
        register_log_value(self, "log_gamma", init_gamma, learnable=learn_gamma, maximum=max_gamma)
        self.max_gamma = max_gamma
        self.block_size = None if block_size is None else int(block_size)
        self.implementation = implementation
        self.matmul_dtype = MATMUL_DTYPES[matmul_dtype]

    def gamma(self) -> Tensor:
        """0-d tensor γ = exp(t), at most ``max_gamma``."""
        return bounded_exp(self.log_gamma, self.max_gamma)

    def parameter_bounds(self) -> dict[str, tuple[float | None, float | None]]:
        """t ≤ log max_gamma, applied to the parameter after each optimiser step (as CLIP's scale)."""
        return log_bounds(self, "log_gamma", self.max_gamma)

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Mx, d], b: [Nb, My, d] -> Logits(i2t [Na, Nb], t2i = i2t.T). ``generator`` is unused.

        With ``matmul_dtype="bfloat16"`` the points enter the u·v products rounded to bf16 (fp32
        accumulation and log-sum-exp): on CUDA this selects the Triton tensor-core kernels.
        """
        if self.matmul_dtype != torch.float32:
            a, b = _points_as(a, self.matmul_dtype), _points_as(b, self.matmul_dtype)
        return Logits.symmetric(kme_logits(a, b, self.gamma(), self.block_size, self.implementation))

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> None:
        """None: log Σ_ij w_i w'_j k(u_i, v_j) is not a matrix product of fixed-size embeddings."""
        return None

    def tile_features(self, x: PointSet, *, generator: torch.Generator | None = None) -> tuple[Tensor, ...]:
        """``train.tiled``: the point sets themselves, (points [B, M, d], weights [B, M] or [B, 0] for
        None, mask [B, M] or [B, 0] for None); a tile is scored by the block kernels below."""
        absent = x.points.new_zeros(x.batch_size, 0)
        weights = absent if x.weights is None else x.weights
        mask = absent.bool() if x.mask is None else x.mask
        return x.points, weights, mask

    def score_tile(self, a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> Tensor:
        """The logits [ta, tb] of two tiles of point sets (``forward`` on those rows, METHODS §3)."""
        return self.forward(_point_set(a), _point_set(b)).i2t

    def score_pairs(self, a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> Tensor:
        """``train.tiled``: the logits [n] of the row-aligned pairs (a_r, b_r) (the positives), in chunks
        of about :data:`TILE_SCORES` scores that backward recomputes (memory O(chunk), not n·Mx·My)."""
        pa, pb = _point_set(a), _point_set(b)
        if self.matmul_dtype != torch.float32:
            pa, pb = _points_as(pa, self.matmul_dtype), _points_as(pb, self.matmul_dtype)
        gamma = self.gamma()
        rows = max(1, TILE_SCORES // max(pa.num_points * pb.num_points, 1))
        return torch.cat([
            checkpoint(kme_pair_logits, pa.rows(start, start + rows), pb.rows(start, start + rows), gamma,
                       use_reentrant=False)
            for start in range(0, pa.batch_size, rows)
        ])  # fmt: skip

    def largest_tile(self, a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> int | None:
        """``train.tiled``: the largest tile side (sets) the block-wise path scores in one block, or
        None (no cap) when there is nothing to gain.

        The tiled backward scores each tile again with a graph, then back-propagates through it.
        When the tile is one block, ``_BlockwiseKME`` keeps that block's exp-scores and its backward
        skips the recompute GEMM, so a tiled step costs what the full path's does (one forward,
        one recompute, the two gradient GEMMs); a bigger tile would pay the block kernels' forward
        twice in backward. One point per set needs no recompute, and the Triton kernels tile
        themselves: no cap there.
        """
        points_a, points_b = a[0], b[0]
        mx, my = points_a.shape[1], points_b.shape[1]
        if mx == my == 1 or self._uses_triton(points_a, points_b):
            return None
        if self.block_size is not None:
            return self.block_size
        return largest_square_tile(mx, my, CUDA_TILE_SCORES if points_a.is_cuda else TILE_SCORES)

    def _uses_triton(self, points_a: Tensor, points_b: Tensor) -> bool:
        if self.implementation != "auto":
            return self.implementation == "triton"
        if not points_a.is_cuda:
            return False
        # forward() rounds the points to matmul_dtype before "auto" looks at their dtype.
        rounded = self.matmul_dtype != torch.float32
        a, b = (PointSet(p[:1].to(self.matmul_dtype) if rounded else p[:1]) for p in (points_a, points_b))
        return _triton_applies(a, b)

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """Mean of the prompts' RKHS embeddings = union of their point sets, weights / K_g.

        x: [B, M, d] prompt point sets, groups: [B] class ids in [0, G) -> PointSet [G, K·M, d]
        with K the largest group. Prompt k of group g fills slots k·M .. (k+1)·M − 1 of row g;
        its weights are its explicit weights (uniform 1/M_real when x.weights is None) divided by
        K_g, the group's prompt count, so exp(s(X, union)) = mean_k exp(s(X, prompt_k)).
        Point coordinates are never averaged. Unused slots are masked (weight 1, point 0).
        """
        if groups.dim() != 1 or groups.shape[0] != x.batch_size:
            raise ValueError(f"groups must be [B] = [{x.batch_size}], got {tuple(groups.shape)}")
        mask = x.mask if x.mask is not None else torch.ones_like(x.points[..., 0], dtype=torch.bool)
        if x.weights is not None:
            weights = x.weights
        else:  # the forward pass's rule for weights None, made explicit per prompt
            weights = (1.0 / mask.sum(dim=1, keepdim=True).clamp_min(1)).to(x.points.dtype).expand_as(mask)
        # Fill weight 1, not 0: KME takes log w, and masked slots must stay finite before masking.
        union = x.union_by_group(groups, weights, fill_weight=1.0)
        return PointSet(union.points, union.weights, union.mask)

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        return {"gamma": float(self.gamma().detach())}
