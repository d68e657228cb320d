"""`dot`: CLIP's scaled dot product (METHODS.md §1; SigLIP's bias: §7).

For point sets with M > 1 the points are first pooled by their weighted mean
(ū = Σ_i w_i u_i), so ``dot`` on point sets is the linear term of WPSE (§2); for
CLIP's M == 1 unit vectors it is exactly s·x·y.

Hand-derived case (tested): x = [[1, 0]], y = [[0.6, 0.8]], s = 10 -> logit 6.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor, nn

from clipkit.config.constraints import POSITIVE
from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.similarities.temperature import bounded_exp, check_start, log_bounds, register_log_value
from clipkit.plugins.similarities.tiles import ScaledEmbeddingTiles


class DotSimilarity(ScaledEmbeddingTiles, nn.Module):
    """L_ab = s·ū_a·v̄_b (+ c), s = exp(t). Tileable (``train.tiled``): a tile is s·E_a·E_bᵀ (+ c).

    init_scale:  initial s (CLIP: 1/0.07 ≈ 14.29; SigLIP: 10).
    learn_scale: learn t = log s; otherwise s is a fixed buffer.
    max_scale:   s is at most this (CLIP: 100): a learnable t is clamped to log max_scale after
                 each optimiser step, as open_clip does (``parameter_bounds``); the forward pass
                 uses exp(t) with its gradient, so a scale at the bound can come back down.
    bias:        initial learnable bias c (SigLIP: -10), or None for no bias.
    """

    def __init__(
        self,
        init_scale: Annotated[float, POSITIVE] = 1 / 0.07,
        learn_scale: bool = True,
        max_scale: Annotated[float | None, POSITIVE] = 100.0,
        bias: float | None = None,
    ) -> None:
        super().__init__()
        if init_scale <= 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if max_scale is not None and not max_scale > 0:  # its log bounds the scale: log(0) has no value
            raise ValueError(f"max_scale must be > 0 (or null for no bound), got {max_scale}")
        check_start("init_scale", init_scale, "max_scale", max_scale)
        register_log_value(self, "log_scale", init_scale, learnable=learn_scale, maximum=max_scale)
        self.max_scale = max_scale
        # [1], not 0-d: DeepSpeed cannot broadcast 0-d parameters (see register_log_value).
        self.bias = nn.Parameter(torch.tensor([float(bias)])) if bias is not None else None

    def scale(self) -> Tensor:
        """0-d tensor s = exp(t), at most ``max_scale``."""
        return bounded_exp(self.log_scale, self.max_scale)

    def parameter_bounds(self) -> dict[str, tuple[float | None, float | None]]:
        """t ≤ log max_scale, applied to the parameter after each optimiser step (open_clip's clamp)."""
        return log_bounds(self, "log_scale", self.max_scale)

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor:
        """[B, M, d] -> [B, d] pooled vectors with logits = s·embed(a) @ embed(b).T (+ c)."""
        return x.points[:, 0] if x.num_points == 1 and x.mask is None else x.mean()

    #: bf16/fp16 point sets give fp32 logits: the products accumulate and come out in fp32
    #: (``train.similarity_precision: half``; :func:`products`).
    half_features = True
    #: plain tensor code: train.compile_scope=step compiles it with the loss (clipkit.train.compile)
    compiles = True

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Ma, d], b: [Nb, Mb, d] -> Logits(i2t [Na, Nb], t2i [Nb, Na]); fp32 logits for
        fp32, bf16 or fp16 points (fp64 points give fp64)."""
        i2t = self.scale() * products(self.embed(a), self.embed(b))
        if self.bias is not None:
            i2t = i2t + self.bias
        return Logits.symmetric(i2t)

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """CLIP's prompt ensembling: mean of the prompts' unit vectors, renormalised.

        x: [B, M, d] prompt point sets, groups: [B] class id in [0, G) -> PointSet [G, 1, d].
        """
        pooled = nn.functional.normalize(self.embed(x), dim=-1)
        num_groups = int(groups.max()) + 1
        sums = pooled.new_zeros(num_groups, pooled.shape[1]).index_add_(0, groups, pooled)
        return PointSet(nn.functional.normalize(sums, dim=-1).unsqueeze(1))

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        out = {"logit_scale": float(self.scale().detach())}
        if self.bias is not None:
            out["logit_bias"] = float(self.bias.detach())
        return out


def products(x: Tensor, y: Tensor) -> Tensor:
    """[Na, d] @ [Nb, d]ᵀ -> [Na, Nb]. Half-precision rows are multiplied with fp32 accumulation
    and an fp32 result (:class:`HalfProducts`); other dtypes are a plain product."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return x @ y.t()
    return HalfProducts.apply(x, y)


def half_gemm(a: Tensor, b: Tensor) -> Tensor:
    """[m, k] @ [k, n] of half tensors -> fp32 [m, n], accumulated in fp32: on CUDA one bf16/fp16
    tensor-core GEMM writing fp32 (``out_dtype``); on the CPU the same products from the operands
    upcast (exact: half values are fp32 values)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class HalfProducts(torch.autograd.Function):
    """x [Na, d] @ y [Nb, d]ᵀ for bf16/fp16 rows, fp32 out, with its own backward.

    Why a Function: torch (2.11 on CUDA, seen on an H200) has no derivative for ``mm`` with
    ``out_dtype``. The backward is what autocast would do for a half GEMM: the fp32 gradient of the
    products is rounded to the rows' dtype once, and each gradient is one half GEMM accumulated in
    fp32, returned in the rows' dtype:  dx = g y,  dy = gᵀ x.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor) -> Tensor:
        ctx.save_for_backward(x, y)
        return half_gemm(x, y.t())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, y = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = half_gemm(grad, y).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_y = half_gemm(grad.t(), x).to(y.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_y
