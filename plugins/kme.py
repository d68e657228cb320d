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

Cost: the logits need N_a·N_b·M_x·M_y kernel values. They are computed block-wise by a custom
autograd Function (same structure as memory-efficient attention: a GEMM followed by a
segmented log-sum-exp) that never materialises the [N_a, N_b, M_x, M_y] tensor, neither in
forward nor in backward (which recomputes each block).

Hand-derived cases (tested): one point each, w = 1: s = γ(u·v − 1); u = e1, v = (0.6, 0.8), γ = 10
gives −4. Two image points e1, e2 with weights (1, 3) against v = e1, γ = 2:
s = log(1·e^0 + 3·e^{−2}) = log(1 + 3e^{−2}).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from clipkit.plugins.temperature import clamped_exp, register_log_value
from clipkit.types import Logits, PointSet


def log_weights(x: PointSet, dtype: torch.dtype) -> Tensor:
    """[B, M] log w_i in ``dtype``: log of the raw weights, or −log M_real when weights is None;
    −inf on masked points.

    The masked weights are replaced by 1 *before* the log (a zero or garbage weight under the
    mask must not send a NaN gradient back through ``log``).
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
        logw = weights.log()
    else:
        count = x.points.new_full((x.batch_size, 1), float(x.num_points), dtype=dtype)
        if mask is not None:
            count = mask.sum(dim=1, keepdim=True).to(dtype).clamp_min(1.0)
        logw = (-count.log()).expand(x.batch_size, x.num_points)
    if mask is not None:
        logw = logw.masked_fill(~mask, float("-inf"))
    return logw


def _block_scores(
    u: Tensor, logw_u: Tensor, v: Tensor, logw_v: Tensor, gamma: Tensor
) -> tuple[Tensor, Tensor]:
    """One block's scores.

    u: [ba, Mx, d], logw_u: [ba, Mx], v: [bb, My, d], logw_v: [bb, My], gamma: 0-d
    -> (scores [ba, Mx, bb, My] = log w_i + log w'_j + γ u_i·v_j, the flat points u [ba·Mx, d]).
    The layout [ba, Mx, bb, My] is the plain GEMM output reshaped: no permute/copy needed.
    """
    ba, mx, d = u.shape
    bb, my, _ = v.shape
    flat_u = u.reshape(ba * mx, d)
    scores = (flat_u @ v.reshape(bb * my, d).t()).view(ba, mx, bb, my)
    scores.mul_(gamma).add_(logw_u.view(ba, mx, 1, 1)).add_(logw_v.view(1, 1, bb, my))
    return scores, flat_u


def _blocks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


class _BlockwiseKME(torch.autograd.Function):
    """s_ab = lse_{i,j}(log w_ai + log w'_bj + γ u_ai·v_bj) − γ, one [block, block] tile at a time.

    Saved for backward: the inputs and lse [Na, Nb] only. With P_{ab,ij} the softmax over (i, j)
    of the block scores of pair (a, b) and g_ab the incoming gradient:

        ∂s_ab/∂u_ai      = γ Σ_j P_{ab,ij} v_bj
        ∂s_ab/∂v_bj      = γ Σ_i P_{ab,ij} u_ai
        ∂s_ab/∂log w_ai  = Σ_j P_{ab,ij}
        ∂s_ab/∂log w'_bj = Σ_i P_{ab,ij}
        ∂s_ab/∂γ         = Σ_ij P_{ab,ij} u_ai·v_bj − 1

    Backward recomputes each tile's scores, forms Q = g_ab·P_{ab,ij} and reduces it with two GEMMs
    (Q @ V for u, Qᵀ @ U for v); the γ term Σ Q u·v = Σ_i u_i·(Q @ V)_i reuses the first GEMM.
    Peak memory: O(block²·Mx·My + Na·Nb + inputs).
    """

    @staticmethod
    def forward(ctx, u, logw_u, v, logw_v, gamma, block_size):
        lse = u.new_empty(u.shape[0], v.shape[0])
        for rows in _blocks(u.shape[0], block_size):
            for cols in _blocks(v.shape[0], block_size):
                scores, _ = _block_scores(u[rows], logw_u[rows], v[cols], logw_v[cols], gamma)
                lse[rows, cols] = torch.logsumexp(scores, dim=(1, 3))
        ctx.save_for_backward(u, logw_u, v, logw_v, gamma, lse)
        ctx.block_size = block_size
        return lse - gamma

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, logw_u, v, logw_v, gamma, lse = ctx.saved_tensors
        need_u, need_wu, need_v, need_wv, need_gamma, _ = ctx.needs_input_grad
        grad_u = torch.zeros_like(u) if need_u else None
        grad_v = torch.zeros_like(v) if need_v else None
        grad_wu = torch.zeros_like(logw_u) if need_wu else None
        grad_wv = torch.zeros_like(logw_v) if need_wv else None
        grad_gamma = -grad_out.sum() if need_gamma else None
        # A set with no real point has lse = −inf: subtract 0 instead so its P is exp(−inf) = 0, not NaN.
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        for rows in _blocks(u.shape[0], ctx.block_size):
            for cols in _blocks(v.shape[0], ctx.block_size):
                ub, vb = u[rows], v[cols]
                scores, flat_u = _block_scores(ub, logw_u[rows], vb, logw_v[cols], gamma)
                ba, mx, bb, my = scores.shape
                q = scores.sub_(lse[rows, cols].view(ba, 1, bb, 1)).exp_()
                q.mul_(grad_out[rows, cols].view(ba, 1, bb, 1))
                if need_wu:
                    grad_wu[rows] += q.sum(dim=(2, 3))
                if need_wv:
                    grad_wv[cols] += q.sum(dim=(0, 1))
                flat_q = q.view(ba * mx, bb * my)
                if need_u or need_gamma:
                    q_v = flat_q @ vb.reshape(bb * my, -1)  # [ba·Mx, d] = Σ_j Q_ij v_j
                    if need_u:
                        grad_u[rows] += (gamma * q_v).view_as(ub)
                    if need_gamma:
                        grad_gamma = grad_gamma + (flat_u * q_v).sum()
                if need_v:
                    grad_v[cols] += (gamma * (flat_q.t() @ flat_u)).view_as(vb)
        return grad_u, grad_wu, grad_v, grad_wv, grad_gamma, None


def kme_logits(a: PointSet, b: PointSet, gamma: Tensor, block_size: int = 64) -> Tensor:
    """[Na, Nb] KME-CLIP logits s(a_i, b_j) (see the module docstring), computed block-wise.

    a: [Na, Mx, d], b: [Nb, My, d]; gamma: 0-d tensor (already clamped). Inputs below fp32 (bf16,
    fp16) are upcast to fp32 (the lse of thousands of exponentials needs it); fp64 stays fp64.
    """
    if a.dim != b.dim:
        raise ValueError(f"point dimensions differ: a has d = {a.dim}, b has d = {b.dim}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    dtype = torch.promote_types(torch.promote_types(a.points.dtype, b.points.dtype), torch.float32)
    return _BlockwiseKME.apply(
        a.points.to(dtype),
        log_weights(a, dtype),
        b.points.to(dtype),
        log_weights(b, dtype),
        gamma.to(dtype),
        block_size,
    )


class KMESimilarity(nn.Module):
    """KME-CLIP (METHODS.md §3): L_ab = log Σ_ij w_i w'_j exp(γ(u_i·v_j − 1)), γ = exp(t).

    init_gamma:  initial γ = 1/σ² (1/0.07, so that M = 1 starts exactly as CLIP's logit scale).
    learn_gamma: learn t = log γ; otherwise γ is a fixed buffer.
    max_gamma:   γ is clamped to at most this in the forward pass (like CLIP's scale: 100), which
                 stops its gradient above the clamp; None = no clamp.
    block_size:  anchors × candidates per tile of the block-wise computation; a tile holds
                 block_size²·Mx·My fp32 scores (64² · 197 · 77 ≈ 62 M floats ≈ 250 MB for ViT-B/16).

    ``embed`` returns None (the log of a kernel sum does not factorise into one matrix product);
    ``ensemble`` unions the prompts' weighted point sets (mean of RKHS embeddings).
    """

    def __init__(
        self,
        init_gamma: float = 1 / 0.07,
        learn_gamma: bool = True,
        max_gamma: float | None = 100.0,
        block_size: int = 64,
    ) -> None:
        super().__init__()
        if not init_gamma > 0:
            raise ValueError(f"init_gamma must be > 0, got {init_gamma}")
        if max_gamma is not None and not max_gamma > 0:
            raise ValueError(f"max_gamma must be > 0 or None, got {max_gamma}")
        if int(block_size) != block_size or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        register_log_value(self, "log_gamma", init_gamma, learnable=learn_gamma)
        self.max_gamma = max_gamma
        self.block_size = int(block_size)

    def gamma(self) -> Tensor:
        """0-d tensor γ = exp(t), clamped to ``max_gamma``."""
        return clamped_exp(self.log_gamma, self.max_gamma)

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Mx, d], b: [Nb, My, d] -> Logits(i2t [Na, Nb], t2i = i2t.T). ``generator`` is unused."""
        return Logits.symmetric(kme_logits(a, b, self.gamma(), self.block_size))

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> None:
        """None: log Σ_ij w_i w'_j k(u_i, v_j) is not a matrix product of fixed-size embeddings."""
        return None

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
        num_groups = int(groups.max()) + 1
        counts = torch.bincount(groups, minlength=num_groups)
        order = torch.argsort(groups, stable=True)
        sorted_groups = groups[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x.batch_size, device=groups.device) - starts[sorted_groups]
        per_group = int(counts.max())
        _, m, d = x.points.shape

        mask = x.mask if x.mask is not None else torch.ones_like(x.points[..., 0], dtype=torch.bool)
        if x.weights is not None:
            weights = x.weights
        else:  # the forward pass's rule for weights None, made explicit per prompt
            weights = (1.0 / mask.sum(dim=1, keepdim=True).clamp_min(1)).to(x.points.dtype).expand(-1, m)
        weights = weights / counts[groups].unsqueeze(1).to(weights.dtype)

        points = x.points.new_zeros(num_groups, per_group, m, d)
        points[sorted_groups, slot] = x.points[order]
        out_weights = weights.new_ones(num_groups, per_group, m)
        out_weights[sorted_groups, slot] = torch.where(mask, weights, torch.ones_like(weights))[order]
        out_mask = mask.new_zeros(num_groups, per_group, m)
        out_mask[sorted_groups, slot] = mask[order]
        return PointSet(
            points.view(num_groups, per_group * m, d),
            out_weights.view(num_groups, per_group * m),
            out_mask.view(num_groups, per_group * m),
        )

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        return {"gamma": float(self.gamma().detach())}
