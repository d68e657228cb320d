"""`wpse` and `cosine_mean`: kernel similarity of point sets and its `cossim∘mean` ablation (METHODS.md §2).

WPSE compares two (weighted) point sets X = {u_i, w_i}, Y = {v_j, w'_j} by the mean kernel value

    g(X, Y) = Σ_ij w̃_i w̃'_j k(u_i, v_j),   k(u, v) = α1·u·v + α2·k̃(u, v),

with w̃ the normalised weights (uniform 1/M over the unmasked points when the set has none).
With random Fourier features z (Rahimi & Recht) the shift-invariant part factorises,
k̃(u, v) ≈ z(u)·z(v), so by linearity

    g(X, Y) ≈ α1·ū·v̄ + α2·z̄_X·z̄_Y,   ū = Σ_i w̃_i u_i,   z̄_X = Σ_i w̃_i z(u_i),

and the logits L_ab = s·g(X_a, Y_b) cost one matrix product of pooled vectors.

Hand-derived cases (tested): with α = (1, 0), u = (1, 0), v = (0.6, 0.8), s = 10 the logit is 6;
with α = (0, 1), D = 2, ω = [(π/3, 0), (0, π/3)], β = (0, π), u = (1, 0), v = (0, 1):
z(u) = (cos π/3, cos π) = (½, −1), z(v) = (cos 0, cos(π/3 + π)) = (1, −½), so z(u)·z(v) = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from clipkit.config.constraints import NON_NEGATIVE, POSITIVE, Numbers, OneOf
from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.plugins.similarities.tiles import ScaledEmbeddingTiles

KERNELS = ("gaussian", "imq")

#: Seed of the features drawn when no generator is given (evaluation must be deterministic).
DEFAULT_FEATURE_SEED = 0


@dataclass(frozen=True)
class KernelWeights:
    """The constraint on WPSE's ``alpha`` that ``clipkit validate`` checks: null (the default
    weights) or [α1, α2], both ≥ 0 and not both 0 (a zero kernel scores every pair alike)."""

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None
        problem = Numbers(2, NON_NEGATIVE).problem(value)
        if problem is None and not any(value):
            return f"must not be all zero (no kernel left), got {list(value)}"
        return problem


#: The narrowest kernel (σ, or the IMQ's c) the random features can represent. The frequencies ω
#: scale as 1/width and the features are cos(x·ω + β) in fp32: at width 1e-6 the phases reach 10^6
#: rad, where fp32 keeps 1/16 rad of them, narrower they are noise, and below ~1e-19 (c) or ~1e-38
#: (σ) ω overflows to inf and every loss is NaN. The papers use 0.3 to 0.5.
MIN_KERNEL_WIDTH = 1e-6


@dataclass(frozen=True)
class KernelWidth:
    """The constraint on WPSE's ``sigma`` and ``c`` that ``clipkit validate`` checks: > 0, and at
    least :data:`MIN_KERNEL_WIDTH` (a narrower kernel's random features overflow fp32: a NaN run)."""

    def problem(self, value: Any) -> str | None:
        problem = POSITIVE.problem(value)
        if problem is None and isinstance(value, int | float) and 0 < value < MIN_KERNEL_WIDTH:
            return (
                f"must be >= {MIN_KERNEL_WIDTH:g} (narrower, the random features cos(x·ω + β) "
                f"lose their phase in fp32, then overflow to NaN), got {value!r}"
            )
        return problem


def _logit_scale(init_scale: float, learn_scale: bool, max_scale: float | None) -> DotSimilarity:
    """The learnable, clamped s = exp(t) of CLIP (METHODS §1), reused from ``dot``: a
    ``DotSimilarity`` without bias holds exactly that parameter and its ``scale()`` clamp."""
    return DotSimilarity(init_scale=init_scale, learn_scale=learn_scale, max_scale=max_scale)


class WPSESimilarity(ScaledEmbeddingTiles, nn.Module):
    """WPSE, METHODS.md §2: L_ab = s·(α1·ū_a·v̄_b + α2·z̄_a·z̄_b), s = exp(t) learnable and clamped.

    embed_dim:    d, the dimension of the points (passed by the host; ω is [d, D]).
    kernel:       "gaussian" k̃ = exp(−‖u−v‖²/(2σ²)) or "imq" k̃ = c/sqrt(c² + ‖u−v‖²).
    alpha:        [α1, α2] ≥ 0, not both 0 (default [0.5, 0.5]; recipes use (0.75, 0.25), (0.25, 0.75)).
    sigma:        Gaussian bandwidth σ ≥ 1e-6 (paper 0.3; the authors' code 0.5, §11).
    c:            IMQ scale c ≥ 1e-6 (narrower kernels overflow the random features: NaN).
    num_features: D, the number of random Fourier features (training 512).
    init_scale, learn_scale, max_scale: the logit scale s, as ``dot`` (CLIP: 1/0.07, learnable, ≤ 100).

    Random features z(v) = sqrt(2/D)·cos(ω_t·v + β_t), β_t ~ U[0, 2π) (sqrt(2/D), not the seed's
    printed sqrt(1/(2D)), is the scaling with E[z(u)·z(v)] = k̃(u, v)). Every call draws fresh
    (ω, β) from ``generator`` — the training loop passes one seeded per step, identical on every
    rank — and one call uses the same features for both sides. ``generator=None`` draws from a
    generator seeded with :data:`DEFAULT_FEATURE_SEED` (0), so a call without one is deterministic.
    To compare two ``embed`` calls, give each a generator seeded identically.
    """

    #: Scores depend on the feature draw: evaluation repeats over several seeds (METHODS §8).
    uses_random_features = True

    def __init__(
        self,
        embed_dim: int,
        kernel: Annotated[str, OneOf(KERNELS)] = "gaussian",
        alpha: Annotated[list | None, KernelWeights()] = None,
        sigma: Annotated[float, KernelWidth()] = 0.3,
        c: Annotated[float, KernelWidth()] = 0.5,
        num_features: Annotated[int, POSITIVE] = 512,
        init_scale: Annotated[float, POSITIVE] = 1 / 0.07,
        learn_scale: bool = True,
        max_scale: Annotated[float | None, POSITIVE] = 100.0,
    ) -> None:
        super().__init__()
        alpha = [0.5, 0.5] if alpha is None else list(alpha)
        _validate(embed_dim, kernel, alpha, sigma, c, num_features)
        self.embed_dim = int(embed_dim)
        self.kernel = kernel
        self.alpha = (float(alpha[0]), float(alpha[1]))
        self.sigma = float(sigma)
        self.c = float(c)
        self.num_features = int(num_features)
        self.logit_scale = _logit_scale(init_scale, learn_scale, max_scale)

    def scale(self) -> Tensor:
        """0-d tensor s = exp(t), clamped to ``max_scale``."""
        return self.logit_scale.scale()

    def sample_features(self, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw (ω [d, D], β [D]) in fp32 on the generator's device.

        Drawing in a fixed dtype makes the features depend on the seed only (not on whether the
        points are fp32 or fp64); callers cast them to the points' dtype and device.
        """
        if generator is None:
            generator = torch.Generator().manual_seed(DEFAULT_FEATURE_SEED)
        d, count = self.embed_dim, self.num_features
        options = {"generator": generator, "device": generator.device, "dtype": torch.float32}
        if self.kernel == "gaussian":
            omega = torch.randn(d, count, **options) / self.sigma
        else:
            # IMQ = Gamma mixture of Gaussians: λ ~ Gamma(shape ½, rate c²), ω ~ N(0, 2λ I).
            # Gamma(½, rate c²) = χ²₁/(2c²) = N(0, 1)²/(2c²) exactly, so λ needs only the public,
            # generator-aware torch.randn: no private API (torch._standard_gamma), and the same
            # stream of normal draws on every backend that implements randn.
            lam = torch.randn(count, **options).square() / (2 * self.c**2)
            omega = torch.randn(d, count, **options) * (2 * lam).sqrt()
        beta = torch.rand(count, **options) * (2 * math.pi)
        return omega, beta

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor:
        """[B, M, d] -> [B, d + D] = concat(√α1·ū, √α2·z̄), so the logits are s·embed(a) @ embed(b).T
        when both calls use identically seeded generators."""
        return self._embed(x, self.sample_features(generator))

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Ma, d], b: [Nb, Mb, d] -> Logits(i2t [Na, Nb], t2i = i2t.T); one feature draw for both."""
        features = self.sample_features(generator)
        i2t = self.scale() * self._embed(a, features) @ self._embed(b, features).t()
        return Logits.symmetric(i2t)

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """WPSE's prompt ensembling (METHODS §2, §8): the mean of the prompts' RKHS embeddings.

        x: [B, M, d] prompts, groups: [B] class id in [0, G) -> PointSet [G, K·M, d] with K the
        largest group: the union of a group's prompts, each prompt's normalised weights divided
        by its group's prompt count; padding slots (and masked input points) have mask False and
        weight 0. The logits are linear in ū and z̄, so logits(image, ensemble) equals the mean of
        logits(image, prompt) over the group's prompts (same features). Point coordinates are
        never averaged.
        """
        return union_by_group(x, groups)

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        return {"logit_scale": float(self.scale().detach())}

    def extra_repr(self) -> str:
        width = f"sigma={self.sigma}" if self.kernel == "gaussian" else f"c={self.c}"
        alpha = f"alpha={self.alpha}"
        return f"embed_dim={self.embed_dim}, kernel={self.kernel}, {alpha}, {width}, D={self.num_features}"

    def _embed(self, x: PointSet, features: tuple[Tensor, Tensor]) -> Tensor:
        """[B, M, d] and (ω [d, D], β [D]) -> [B, d + D]; the features are pooled without holding the
        [B, M, D] feature tensor when it exceeds one chunk (:func:`pooled_random_features`)."""
        if x.dim != self.embed_dim:
            raise ValueError(f"WPSE was built for points of dimension {self.embed_dim}, got {x.dim}")
        omega, beta = (f.to(device=x.points.device, dtype=x.points.dtype) for f in features)
        weights = x.normalized_weights()  # [B, M]
        mean_points = (weights.unsqueeze(-1) * x.points).sum(dim=1)  # ū [B, d]
        mean_features = pooled_random_features(x.points, weights, omega, beta)  # z̄ [B, D]
        alpha1, alpha2 = self.alpha
        return torch.cat([math.sqrt(alpha1) * mean_points, math.sqrt(alpha2) * mean_features], dim=1)


#: Feature values (rows·M·D) per chunk of :func:`pooled_random_features`: 2^20 = 4 MiB in fp32.
FEATURE_CHUNK = 1 << 20


def pooled_random_features_unfused(points: Tensor, weights: Tensor, omega: Tensor, beta: Tensor) -> Tensor:
    """z̄ = Σ_m w_m z(x_m), z(x) = sqrt(2/D)·cos(x ω + β), by materialising z for every point (reference).

    points [B, M, d], weights [B, M] (mixture weights, 0 on masked points), ω [d, D], β [D] -> [B, D].
    Plain autograd: saves the [B, M, D] features (and cos's input) for backward.
    """
    point_features = math.sqrt(2 / omega.shape[1]) * torch.cos(points @ omega + beta)  # [B, M, D]
    return (weights.unsqueeze(-1) * point_features).sum(dim=1)


def pooled_random_features(
    points: Tensor, weights: Tensor, omega: Tensor, beta: Tensor, *, fused: bool | None = None
) -> Tensor:
    """z̄ [B, D] as :func:`pooled_random_features_unfused`, by default without ever holding the
    [B, M, D] features when they exceed one chunk of :data:`FEATURE_CHUNK` values.

    fused: True = chunk by chunk of batch rows, forward and backward (:class:`_PooledRandomFeatures`:
    memory O(chunk), one extra GEMM in backward to recompute x ω + β); False = the unfused reference;
    None = fused when B·M·D > FEATURE_CHUNK (below that the features are no bigger than a chunk,
    and plain autograd is faster). The features are random and fixed within a call (ω, β carry
    no gradient in WPSE); if a caller makes them require grad, the unfused path runs, so that
    gradient stays exact.
    """
    if fused is None:
        fused = points.shape[0] * points.shape[1] * omega.shape[1] > FEATURE_CHUNK
    if not fused or omega.requires_grad or beta.requires_grad:
        return pooled_random_features_unfused(points, weights, omega, beta)
    return _PooledRandomFeatures.apply(points, weights, omega, beta)


def _row_chunks(points: Tensor, num_features: int) -> list[slice]:
    batch, num_points = points.shape[:2]
    rows = max(1, FEATURE_CHUNK // max(1, num_points * num_features))
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]


def _chunk_values(chunks: list[slice], per_row: int) -> int:
    """Values in the largest chunk (the first): the size of a scratch buffer every chunk reuses."""
    return (chunks[0].stop - chunks[0].start) * per_row if chunks else 0


class _PooledRandomFeatures(torch.autograd.Function):
    """z̄_b = c Σ_m w_bm cos(x_bm·ω + β), c = sqrt(2/D), chunk by chunk of batch rows.

    A custom Function rather than torch.utils.checkpoint over chunks: per chunk, backward is one
    GEMM recomputing P = x ω + β, one GEMM for ∂x and one batched matrix-vector product for ∂w,

        ∂z̄/∂w_bm = c Σ_t g_bt cos P_bmt,      ∂z̄/∂x_bm = −c w_bm Σ_t g_bt sin P_bmt ω_:t,

    (sin P is one chunk-sized temporary, cos runs in place on P). Checkpointing would re-run the
    chunk's forward under autograd (saving cos's input and output and a weighted copy, all of
    chunk size) and then backpropagate through those ops. Saved for backward: the inputs only.
    """

    @staticmethod
    def forward(ctx, points, weights, omega, beta):
        batch, num_points, dim = points.shape
        scale = math.sqrt(2 / omega.shape[1])
        pooled = points.new_empty(batch, omega.shape[1])
        chunks = _row_chunks(points, omega.shape[1])
        # One scratch buffer for every chunk: a fresh multi-MiB tensor per chunk costs page faults.
        buffer = points.new_empty(_chunk_values(chunks, num_points * omega.shape[1]))
        for rows in chunks:
            flat = points[rows].reshape(-1, dim)
            phases = torch.addmm(
                beta, flat, omega, out=buffer[: flat.shape[0] * omega.shape[1]].view(-1, omega.shape[1])
            )
            cosines = phases.cos_().view(-1, num_points, omega.shape[1])
            pooled[rows] = torch.bmm(weights[rows].unsqueeze(1), cosines).squeeze(1).mul_(scale)
        ctx.save_for_backward(points, weights, omega, beta)
        return pooled

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_pooled):
        points, weights, omega, beta = ctx.saved_tensors
        need_points, need_weights = ctx.needs_input_grad[:2]
        batch, num_points, dim = points.shape
        count = omega.shape[1]
        scale = math.sqrt(2 / count)
        grad_points = points.new_empty(points.shape) if need_points else None  # contiguous
        grad_weights = weights.new_empty(weights.shape) if need_weights else None
        chunks = _row_chunks(points, count)
        size = _chunk_values(chunks, num_points * count)
        buffer, sine_buffer = points.new_empty(size), points.new_empty(size if need_points else 0)
        for rows in chunks:
            flat = points[rows].reshape(-1, dim)
            values = flat.shape[0] * count
            phases = torch.addmm(beta, flat, omega, out=buffer[:values].view(-1, count))
            phases = phases.view(-1, num_points, count)
            upstream = grad_pooled[rows].unsqueeze(-1)  # [r, D, 1]
            if need_points:
                # −c w_bm g_bt sin P_bmt, then one GEMM with ωᵀ straight into the gradient's rows.
                sines = torch.sin(phases, out=sine_buffer[:values].view_as(phases))
                sines.mul_(grad_pooled[rows].unsqueeze(1))
                sines.mul_(weights[rows].unsqueeze(-1) * -scale)
                torch.mm(sines.view(-1, count), omega.t(), out=grad_points[rows].view(-1, dim))
            if need_weights:
                grad_weights[rows] = torch.bmm(phases.cos_(), upstream).squeeze(-1).mul_(scale)
        return grad_points, grad_weights, None, None


class CosineMeanSimilarity(ScaledEmbeddingTiles, nn.Module):
    """The `cossim∘mean` ablation of METHODS.md §2: L_ab = s·cos(ū_a, v̄_b), s = exp(t) as ``dot``.

    Same point-set encoders as WPSE; the weighted point means are compared by cosine, i.e. ``dot``
    on the renormalised means. ``embed`` is the unit mean; ``ensemble`` is CLIP's rule (mean of the
    prompts' unit embeddings, renormalised) -> PointSet [G, 1, d].
    """

    #: plain tensor code: train.compile_scope=step compiles it with the loss (clipkit.train.compile)
    compiles = True

    def __init__(
        self,
        init_scale: Annotated[float, POSITIVE] = 1 / 0.07,
        learn_scale: bool = True,
        max_scale: Annotated[float | None, POSITIVE] = 100.0,
    ) -> None:
        super().__init__()
        self.logit_scale = _logit_scale(init_scale, learn_scale, max_scale)

    def scale(self) -> Tensor:
        """0-d tensor s = exp(t), clamped to ``max_scale``."""
        return self.logit_scale.scale()

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor:
        """[B, M, d] -> [B, d] unit weighted means ū/‖ū‖ (logits = s·embed(a) @ embed(b).T)."""
        return nn.functional.normalize(x.mean(), dim=-1)

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Ma, d], b: [Nb, Mb, d] -> Logits(i2t [Na, Nb], t2i = i2t.T)."""
        return Logits.symmetric(self.scale() * self.embed(a) @ self.embed(b).t())

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """x: [B, M, d] prompts, groups: [B] ids in [0, G) -> PointSet [G, 1, d] (``dot``'s CLIP rule
        applied to the pooled means)."""
        return self.logit_scale.ensemble(x, groups)

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training."""
        return {"logit_scale": float(self.scale().detach())}


def union_by_group(x: PointSet, groups: Tensor) -> PointSet:
    """WPSE's union: each prompt's normalised weights divided by its group size (masked points and
    padding slots weight 0). x: [B, M, d], groups: [B] -> PointSet [G, K·M, d]."""
    union = x.union_by_group(groups, x.normalized_weights(), fill_weight=0.0)
    if x.weight_normalization == "count":
        # Signed weights (WPSE code): keep the mixture weights exactly, since re-dividing them by
        # their sum (which may be ~0) is not the same mixture; "count" divides by the real points.
        scale = union.mask.sum(dim=1, keepdim=True).to(union.weights.dtype)
        union = PointSet(union.points, union.weights * scale, union.mask, union.weight_normalization)
    return union


def _validate(embed_dim: int, kernel: str, alpha: list, sigma: float, c: float, num_features: int) -> None:
    if embed_dim <= 0:
        raise ValueError(f"embed_dim must be > 0, got {embed_dim}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if len(alpha) != 2 or not all(isinstance(a, int | float) and not isinstance(a, bool) for a in alpha):
        raise ValueError(f"alpha must be [alpha1, alpha2], two numbers, got {alpha}")
    if min(alpha) < 0 or max(alpha) <= 0:
        raise ValueError(f"alpha must be >= 0 and not all zero, got {alpha}")
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if c <= 0:
        raise ValueError(f"c must be > 0, got {c}")
    for name, width in (("sigma", sigma), ("c", c)):  # the Python API: what validate says of a recipe
        if width < MIN_KERNEL_WIDTH:
            raise ValueError(f"{name} must be >= {MIN_KERNEL_WIDTH:g} (the features overflow), got {width}")
    if num_features <= 0:
        raise ValueError(f"num_features must be > 0, got {num_features}")
