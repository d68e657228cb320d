"""`yaware_infonce`, `cond_align_unif`, `simclr`, `supcon`, `align_uniform` (METHODS.md §5, §11).

Two-view single-modality training: "image" = view 1 and "text" = view 2 of one shared encoder.
All losses but ``align_uniform`` work on the 2N × 2N matrix of view similarities

    F = [[ in_modal.i2t   logits.i2t  ],      rows/columns 0..N-1  = view 1 of samples 0..N-1,
         [ logits.t2i     in_modal.t2i ]]     rows/columns N..2N-1 = view 2 of samples 0..N-1,

so F[i, k] = f(view i, view k) and view v belongs to sample v mod N. The logits are assumed to be
already scaled by the similarity, f(x, x') = x·x'/τ (``dot`` with ``init_scale = 1/τ``,
``learn_scale = false``; τ = 0.1 for SimCLR / y-Aware, 0.07 for SupCon). The diagonal of F (a view
against itself) is never a candidate. Weights between views come from a kernel on per-sample
meta-data y, tiled to 2N × 2N (the two views of a sample share y, so they get w = 1).

Kernel spec (constructor argument ``kernel``): a list of factors whose product is the kernel
(METHODS §5: mixed meta-data multiply kernels), e.g.
``[{"key": "age", "type": "rbf", "sigma": 5.0}, {"key": "sex", "type": "delta"}]``:

* ``rbf``:   w = exp(−‖y − y'‖² / (2σ²)) on numbers (or equal-length number lists: Euclidean).
* ``delta``: w = 1[y == y'] on any hashable values (strings, ints, ...).

or the string ``"same_sample"`` for w = δ(same sample), which turns y-Aware InfoNCE into SimCLR.
``None`` means the official y-Aware setting (§11): RBF on ``age`` with σ = 5.

Hand-derived case (tested; N = 2, views 0, 1 = view 1 and 2, 3 = view 2): every row of F holds
ln 2 for the other view of the same sample, ln 3 for the same view of the other sample and 0 for
the other view of the other sample, so each row's softmax denominator is 2 + 3 + 1 = 6.
SimCLR = −ln(2/6) = ln 3; with w = r = e^{−1/2} between samples (RBF, |Δage| = σ) y-Aware =
[ln 3 + r·ln 12] / (1 + 2r), conditional alignment = −[ln 2 + r·ln 3] / (1 + 2r) and, since
1 − Ẑ = (2 − 2r)/3, conditional uniformity = log(4 rows · 6 / 12 pairs) = ln 2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch import Tensor, nn

from clipkit.config.constraints import NON_NEGATIVE, POSITIVE, OneOf
from clipkit.contract.types import Logits, LossContext, LossOutput
from clipkit.errors import ClipkitError
from clipkit.tiled import ArgMax, LogSumExp, RowSum, TiledLogits

SAME_SAMPLE = "same_sample"
#: The official y-Aware code's kernel (METHODS §11): RBF on age with σ = 5.
DEFAULT_KERNEL: tuple[dict[str, Any], ...] = ({"key": "age", "type": "rbf", "sigma": 5.0},)
NORMALISATIONS = ("rows", "code")


# --------------------------------------------------------------------------- kernels on meta-data


@dataclass(frozen=True)
class KernelFactor:
    """One factor of a product kernel: ``rbf`` (with ``sigma``) or ``delta`` on ``meta[key]``."""

    key: str
    type: str
    sigma: float | None = None


KernelSpec = tuple[KernelFactor, ...] | str


def parse_kernel(kernel: Sequence[Mapping[str, Any]] | str | None) -> KernelSpec:
    """Validate a kernel spec (see the module docstring) -> tuple of factors, or ``"same_sample"``.

    Raises ValueError for an unknown type, a missing/empty key, a non-positive or missing sigma,
    unknown fields or an empty list. Idempotent: an already parsed spec is returned as is.
    """
    if kernel is None:
        kernel = DEFAULT_KERNEL
    if isinstance(kernel, str):
        if kernel != SAME_SAMPLE:
            raise ValueError(
                f"kernel must be a list of factors or {SAME_SAMPLE!r}, got the string {kernel!r}"
            )
        return kernel
    if isinstance(kernel, Mapping) or not isinstance(kernel, Sequence) or len(kernel) == 0:
        raise ValueError(
            f"kernel must be a non-empty list of factors like {list(DEFAULT_KERNEL)} or {SAME_SAMPLE!r}, "
            f"got {kernel!r}"
        )
    return tuple(_parse_factor(factor) for factor in kernel)


@dataclass(frozen=True)
class KernelConstraint:
    """The constraint on a ``kernel`` argument that ``clipkit validate`` checks: whatever
    :func:`parse_kernel` refuses, refused before training with the key named (loss.kernel)."""

    def problem(self, value: Any) -> str | None:
        try:
            parse_kernel(value)
        except ValueError as error:
            return str(error)
        return None


#: A loss's ``kernel`` argument: a kernel spec (module docstring), None = the default kernel.
KERNEL = Annotated[list | str | None, KernelConstraint()]


def _parse_factor(factor: Mapping[str, Any] | KernelFactor) -> KernelFactor:
    if isinstance(factor, KernelFactor):
        return factor
    if not isinstance(factor, Mapping):
        raise ValueError(f"each kernel factor must be a dict with 'key' and 'type', got {factor!r}")
    unknown = set(factor) - {"key", "type", "sigma"}
    if unknown:
        raise ValueError(f"unknown kernel factor fields {sorted(unknown)} in {dict(factor)!r}")
    key, kind = factor.get("key"), factor.get("type")
    if not isinstance(key, str) or not key:
        raise ValueError(f"kernel factor needs a non-empty string 'key', got {dict(factor)!r}")
    if kind == "delta":
        if "sigma" in factor:
            raise ValueError(f"a delta kernel factor takes no sigma, got {dict(factor)!r}")
        return KernelFactor(key, "delta")
    if kind == "rbf":
        sigma = factor.get("sigma")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
            raise ValueError(f"an rbf kernel factor needs 'sigma' > 0, got {dict(factor)!r}")
        return KernelFactor(key, "rbf", float(sigma))
    raise ValueError(f"unknown kernel type {kind!r} for key {key!r}: expected 'rbf' or 'delta'")


def meta_kernel(
    meta: Mapping[str, Any], spec: Sequence[Mapping[str, Any]] | str | None, *, size: int | None = None
) -> Tensor:
    """Sample kernel w(y_a, y_b): meta name -> N raw values (list, or tensor [N] / [N, p]) -> [N, N] float64.

    The product of the spec's factors; ``"same_sample"`` gives the identity (of ``size``, or of the
    length of the meta lists when ``size`` is None). Raises ValueError naming a missing key, a
    non-numeric / non-finite rbf value, or a length that disagrees with ``size``.
    """
    spec = parse_kernel(spec)
    if isinstance(spec, str):
        if size is None:
            lengths = {len(values) for values in meta.values()}
            if len(lengths) != 1:
                raise ValueError("meta_kernel('same_sample') needs size= when meta does not fix N")
            size = lengths.pop()
        return torch.eye(size, dtype=torch.float64)
    kernel = None
    for factor in spec:
        if factor.key not in meta:
            raise ValueError(missing_meta(factor.key, meta))
        values = meta[factor.key]
        if size is not None and len(values) != size:
            raise ValueError(f"meta[{factor.key!r}] has {len(values)} values, expected {size}")
        rbf = factor.type == "rbf"
        term = _rbf(values, factor.key, factor.sigma) if rbf else _delta(values, factor.key)
        if kernel is not None and term.shape != kernel.shape:
            raise ValueError(f"meta[{factor.key!r}] has {term.shape[0]} values, expected {kernel.shape[0]}")
        kernel = term if kernel is None else kernel * term
    return kernel


def missing_meta(key: str, meta: Mapping[str, Any]) -> str:
    """Why the batch cannot feed the kernel factor on ``key``, and the override that maps a column to it
    (a recipe's kernel names meta-data its data may call otherwise, e.g. ``age`` for ``extent``)."""
    return (
        f"meta-data key {key!r} required by the kernel is missing; got {sorted(meta)}; "
        f"name the column it comes from with data.meta_keys.{key}=COLUMN"
    )


def _rbf(values: Any, key: str, sigma: float) -> Tensor:
    """exp(−‖y_a − y_b‖² / (2σ²)) -> [N, N] float64; numbers [N] or equal-length number lists [N, p]."""
    y = rbf_values(values, key)
    return rbf_pairs(y, y, sigma)


def rbf_values(values: Any, key: str) -> Tensor:
    """meta values -> [N, p] float64 (numbers [N] or equal-length number lists), checked finite."""
    try:
        y = torch.as_tensor(values.tolist() if isinstance(values, Tensor) else values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        shown = list(values[:3]) if isinstance(values, (list, tuple)) else values
        raise ValueError(
            f"rbf kernel on meta[{key!r}] needs numbers or equal-length number lists, got {shown!r}...; "
            f"a category is compared by a delta kernel ({{key: {key}, type: delta}})"
        ) from error
    if y.dim() == 1:
        y = y.unsqueeze(1)
    if y.dim() != 2 or not torch.isfinite(y).all():
        raise ValueError(f"rbf kernel on meta[{key!r}] needs finite numbers [N] or [N, p], got {values!r}")
    return y


def rbf_pairs(y_a: Tensor, y_b: Tensor, sigma: float) -> Tensor:
    """[Na, p], [Nb, p] -> [Na, Nb] exp(−‖y_a − y_b‖² / (2σ²))."""
    # Explicit differences rather than ‖a‖² + ‖b‖² − 2ab: exact zeros on the diagonal and no
    # cancellation for large ages with small σ.
    squared = ((y_a.unsqueeze(1) - y_b.unsqueeze(0)) ** 2).sum(-1)
    return torch.exp(-squared / (2 * sigma**2))


def _delta(values: Any, key: str) -> Tensor:
    """1[y_a == y_b] -> [N, N] float64 on hashable values (lists/tensor rows compared as tuples)."""
    codes_t = delta_codes(values, key)
    return (codes_t.unsqueeze(1) == codes_t.unsqueeze(0)).to(torch.float64)


def delta_codes(values: Any, key: str) -> Tensor:
    """meta values -> [N] long codes, equal exactly where the values are equal."""
    items = values.tolist() if isinstance(values, Tensor) else list(values)
    ids: dict[Any, int] = {}
    try:
        codes = [ids.setdefault(tuple(v) if isinstance(v, list) else v, len(ids)) for v in items]
    except TypeError as error:
        raise ValueError(f"delta kernel on meta[{key!r}] needs hashable values: {error}") from error
    return torch.tensor(codes)


# --------------------------------------------------------------------------- shared view algebra


def view_logits(logits: Logits, in_modal: Logits) -> Tensor:
    """F [2N, 2N] = [[in_modal.i2t, logits.i2t], [logits.t2i, in_modal.t2i]] (see module docstring)."""
    n = logits.i2t.shape[0]
    shapes = [tuple(t.shape) for t in (logits.i2t, logits.t2i, in_modal.i2t, in_modal.t2i)]
    if any(shape != (n, n) for shape in shapes):
        raise ValueError(
            "two-view losses need the full batch: logits.i2t/t2i and in_modal.i2t/t2i must all be "
            f"[N, N], got {shapes}"
        )
    top = torch.cat([in_modal.i2t, logits.i2t], dim=1)
    bottom = torch.cat([logits.t2i, in_modal.t2i], dim=1)
    return torch.cat([top, bottom], dim=0)


def view_weights(sample_kernel: Tensor) -> Tensor:
    """Sample kernel [N, N] -> view weights [2N, 2N]: tiled 2 × 2, diagonal (self-pairs) zeroed."""
    tiled = sample_kernel.repeat(2, 2)
    return tiled.masked_fill(torch.eye(tiled.shape[0], dtype=torch.bool, device=tiled.device), 0.0)


def _off_diagonal_log_softmax(views: Tensor) -> Tensor:
    """log(e^{F_ik} / Σ_{j≠i} e^{F_ij}) [2N, 2N] with 0 on the diagonal (never a candidate)."""
    eye = torch.eye(views.shape[0], dtype=torch.bool, device=views.device)
    # −inf before the softmax removes self-pairs from the denominator; the 0 afterwards avoids
    # 0 · (−inf) = NaN in the weighted sums (the weights' diagonal is 0).
    return torch.log_softmax(views.masked_fill(eye, float("-inf")), dim=1).masked_fill(eye, 0.0)


def yaware_infonce(views: Tensor, weights: Tensor, normalisation: str = "rows") -> Tensor:
    """y-Aware InfoNCE (METHODS §5) of F [2N, 2N] with view weights [2N, 2N] (zero diagonal) -> scalar.

    ``rows`` (the paper): −mean_i Σ_{k≠i} [w_ik / Σ_{j≠i} w_ij] log softmax_{j≠i}(F_i·)_k.
    ``code`` (official code, §11): w_ik / Σ_{j≠k} w_jk (column sums; numpy's ``weights /=
    weights.sum(axis=1)`` broadcasts over columns), summed over the 2N anchors and divided by N.
    The kernels are symmetric, so column k's sum is row k's and ``code`` = 2 × ``rows`` whenever
    w_ik > 0 only between views of equal row sums: all row sums equal (§11's balanced labels), but
    also any delta kernel (a class's members share one row sum, balanced or not) and same_sample.
    They differ for RBF kernels whose row sums vary (tested).
    """
    log_prob = _off_diagonal_log_softmax(views)
    if normalisation == "rows":
        normalised = weights / weights.sum(dim=1, keepdim=True)
        return -(normalised * log_prob).sum(dim=1).mean()
    if normalisation == "code":
        normalised = weights / weights.sum(dim=0, keepdim=True)
        return -(normalised * log_prob).sum() / (views.shape[0] // 2)
    raise ValueError(f"unknown normalisation {normalisation!r}: expected one of {NORMALISATIONS}")


def conditional_alignment(views: Tensor, weights: Tensor) -> Tensor:
    """L_align^y = −mean_i Σ_{k≠i} [w_ik / Σ_{j≠i} w_ij] F_ik (METHODS §5) -> scalar."""
    normalised = weights / weights.sum(dim=1, keepdim=True)
    return -(normalised * views).sum(dim=1).mean()


def conditional_uniformity(views: Tensor, weights: Tensor, eps: float = 1e-6) -> Tensor:
    """L_unif^y = log mean_{i≠j} [(1 − w_ij) / (1 − Ẑ_i)] e^{F_ij}, Ẑ_i = mean_{j≠i} w_ij (§5) -> scalar.

    The mean runs over the 2N(2N − 1) ordered pairs of distinct views; 1 − Ẑ_i is clamped to
    ≥ eps. Computed as a log-sum-exp with log weights (a zero weight is −inf, i.e. no term). It is
    −inf when every pair has w = 1 (all meta-data equal): nothing is left to repel.
    """
    size = views.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=views.device)
    z_hat = weights.sum(dim=1, keepdim=True) / (size - 1)
    factor = (1 - weights).clamp_min(0) / (1 - z_hat).clamp_min(eps)
    terms = (views + factor.log()).masked_fill(eye, float("-inf"))
    return torch.logsumexp(terms.flatten(), dim=0) - torch.log(views.new_tensor(size * (size - 1.0)))


def _accuracy(logits: Logits, targets: Tensor) -> Tensor:
    """Top-1 of view 1 retrieving its own view 2 among the batch's view 2s."""
    return (logits.i2t.detach().argmax(dim=1) == targets).float().mean()


# --------------------------------------------------------------------------- losses


class _KernelLoss:
    """Shared plumbing: parse the kernel once, build F and the view weights per batch."""

    requires: frozenset[str] = frozenset({"in_modal", "meta"})

    def __init__(self, kernel: list | str | None) -> None:
        self.kernel = parse_kernel(kernel)
        if isinstance(self.kernel, str):
            # δ(same sample) reads no meta-data: do not make the host supply any.
            self.requires = frozenset({"in_modal"})

    def _views_and_weights(self, logits: Logits, ctx: LossContext) -> tuple[Tensor, Tensor]:
        views = view_logits(logits, ctx.in_modal)
        n = logits.i2t.shape[0]
        meta = {} if isinstance(self.kernel, str) else ctx.meta
        kernel = meta_kernel(meta, self.kernel, size=n).to(dtype=views.dtype, device=views.device)
        return views, view_weights(kernel)


class YAwareInfoNCE(_KernelLoss):
    """y-Aware InfoNCE over 2N views (METHODS §5; code differences §11).

    L = −mean_i Σ_{k≠i} [w(y_i, y_k) / Σ_{j≠i} w(y_i, y_j)] · log(e^{F_ik} / Σ_{j≠i} e^{F_ij}).

    Logits: ``logits.i2t`` = view1·view2/τ [N, N], ``ctx.in_modal`` = view1–view1 and view2–view2
    [N, N] with the same scaling (diagonals ignored); a full batch (square logits) is required.
    ``targets`` only feed the ``acc_i2t`` metric: positives come from the kernel.

    kernel:        kernel spec (module docstring); None = RBF on ``age`` with σ = 5 (§11);
                   ``"same_sample"`` = SimCLR.
    normalisation: ``"rows"`` (the paper's formula, mean over 2N anchors) or ``"code"`` (the
                   official code: column sums, sum over anchors / N; see :func:`yaware_infonce`).
    """

    def __init__(
        self, kernel: KERNEL = None, normalisation: Annotated[str, OneOf(NORMALISATIONS)] = "rows"
    ) -> None:
        super().__init__(kernel)
        if normalisation not in NORMALISATIONS:
            raise ValueError(f"unknown normalisation {normalisation!r}: expected one of {NORMALISATIONS}")
        self.normalisation = normalisation

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        views, weights = self._views_and_weights(logits, ctx)
        loss = yaware_infonce(views, weights, self.normalisation)
        return LossOutput(loss, {"acc_i2t": _accuracy(logits, targets)})

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss over the 2N views tile by tile (``train.tiled``; the target weights come from
        the kernel per tile): :func:`yaware_infonce_tiled`."""
        return yaware_infonce_tiled(self, logits, ctx)


class SimCLRLoss(YAwareInfoNCE):
    """SimCLR's NT-Xent (METHODS §5 baselines, τ = 0.1 per §11, set in the similarity).

    Over the 2N views, the positive of view i is the other view of the same sample and the
    denominator runs over all k ≠ i: exactly :class:`YAwareInfoNCE` with w = δ(same sample), so it
    is implemented as that configuration. Logits as for :class:`YAwareInfoNCE` (x·x'/τ).
    """

    requires: frozenset[str] = frozenset({"in_modal"})

    def __init__(self) -> None:
        super().__init__(kernel=SAME_SAMPLE, normalisation="rows")


class SupConLoss(YAwareInfoNCE):
    """Supervised contrastive loss, Khosla et al. "L_out" (METHODS §5 baselines; τ = 0.07, §11).

    For each of the 2N views i, P(i) = other views whose sample has the same ``meta[label_key]``:
    L = −(τ / base_τ) · mean_i (1/|P(i)|) Σ_{p∈P(i)} log(e^{F_ip} / Σ_{a≠i} e^{F_ia}),
    which is y-Aware InfoNCE with a delta kernel on the label (implemented as that), times τ/base_τ.

    The logits must already be divided by τ (``dot`` with ``init_scale = 1/temperature``):
    ``temperature`` here only enters the τ/base_τ factor, applied when ``base_temperature`` is
    given (None = factor 1, as Khosla's default base_temperature = temperature).
    """

    def __init__(
        self,
        label_key: str = "label",
        base_temperature: Annotated[float | None, POSITIVE] = None,
        temperature: Annotated[float, POSITIVE] = 0.07,
    ) -> None:
        if not isinstance(label_key, str) or not label_key:
            raise ValueError(f"label_key must be a non-empty string, got {label_key!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if base_temperature is not None and not base_temperature > 0:
            raise ValueError(f"base_temperature must be > 0 or None, got {base_temperature}")
        super().__init__(kernel=[{"key": label_key, "type": "delta"}], normalisation="rows")
        self.label_key = label_key
        self.factor = 1.0 if base_temperature is None else temperature / base_temperature

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        out = super().__call__(logits, targets, ctx)
        return LossOutput(out.loss * self.factor, out.metrics)

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        out = super().tiled_loss(logits, ctx)
        return LossOutput(out.loss * self.factor, out.metrics)


class ConditionalAlignUniform(_KernelLoss):
    """Conditional alignment + λ · conditional uniformity (METHODS §5, the proposed loss).

    L_align^y = −mean_i Σ_{k≠i} w̃_ik F_ik,  w̃_ik = w_ik / Σ_{j≠i} w_ij;
    L_unif^y  = log mean_{i≠j} [(1 − w_ij) / max(1 − Ẑ_i, eps)] e^{F_ij},  Ẑ_i = mean_{j≠i} w_ij
    (mean over the 2N(2N − 1) ordered pairs of distinct views). Logits and kernel as for
    :class:`YAwareInfoNCE`. Metrics: ``align``, ``unif``.

    kernel: kernel spec; None = RBF on ``age`` with σ = 5.  lam: λ ≥ 0 (1 by default; the paper
    sweeps it).  eps: > 0, lower bound of 1 − Ẑ.
    """

    #: train.tiled: not implemented yet (its uniformity term is one lse over all 4N² view pairs with
    #: per-row factors; tileable in principle, like yaware_infonce).
    tiled_unsupported = "no tiled form yet (conditional uniformity); use train.tiled=false"

    def __init__(
        self,
        kernel: KERNEL = None,
        lam: Annotated[float, NON_NEGATIVE] = 1.0,
        eps: Annotated[float, POSITIVE] = 1e-6,
    ) -> None:
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got {lam}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        super().__init__(kernel)
        self.lam = lam
        self.eps = eps

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        views, weights = self._views_and_weights(logits, ctx)
        align = conditional_alignment(views, weights)
        unif = conditional_uniformity(views, weights, self.eps)
        return LossOutput(align + self.lam * unif, {"align": align.detach(), "unif": unif.detach()})


class AlignUniform:
    """Alignment + uniformity of Wang & Isola (METHODS §5 baselines; α = 2, t = 2, equal weights §11).

    From ``ctx.features`` = (view 1, view 2) PointSets [N, M, d]: pooled by their weighted mean,
    then L2-normalised to x, x' [N, d]. The logits are not used.
    L_align = mean_i ‖x_i − x'_i‖^α;  L_unif(x) = log mean_{i<j} e^{−t‖x_i − x_j‖²};
    loss = align_weight · L_align + uniform_weight · (L_unif(x) + L_unif(x'))/2.
    Metrics: ``align``, ``unif``.
    """

    requires: frozenset[str] = frozenset({"features"})

    #: train.tiled: it reads the pooled features, not the logits (its uniformity is over N² pairs).
    tiled_unsupported = "it works on the features, not on a similarity's logits"

    def __init__(
        self,
        alpha: Annotated[float, POSITIVE] = 2.0,
        t: Annotated[float, POSITIVE] = 2.0,
        align_weight: Annotated[float, NON_NEGATIVE] = 1.0,
        uniform_weight: Annotated[float, NON_NEGATIVE] = 1.0,
    ) -> None:
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if not t > 0:
            raise ValueError(f"t must be > 0, got {t}")
        if not (align_weight >= 0 and uniform_weight >= 0):
            raise ValueError(
                f"align_weight and uniform_weight must be >= 0, got {align_weight}, {uniform_weight}"
            )
        if align_weight == uniform_weight == 0:  # the loss would be 0 and nothing would train
            raise ValueError(
                "align_weight and uniform_weight are both 0, so the loss is 0; give one a weight > 0"
            )
        self.alpha, self.t = alpha, t
        self.align_weight, self.uniform_weight = align_weight, uniform_weight

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        view1, view2 = (nn.functional.normalize(x.mean(), dim=-1) for x in ctx.features)
        if view1.shape != view2.shape or view1.shape[0] < 2:
            raise ValueError(
                f"align_uniform needs two views of N >= 2 samples, got {view1.shape}, {view2.shape}"
            )
        align = ((view1 - view2) ** 2).sum(dim=1).pow(self.alpha / 2).mean()
        unif = (self._uniformity(view1) + self._uniformity(view2)) / 2
        loss = self.align_weight * align + self.uniform_weight * unif
        return LossOutput(loss, {"align": align.detach(), "unif": unif.detach()})

    def _uniformity(self, x: Tensor) -> Tensor:
        """log mean_{i<j} exp(−t‖x_i − x_j‖²) for x [N, d]."""
        rows, cols = torch.triu_indices(x.shape[0], x.shape[0], offset=1, device=x.device)
        # ‖a − b‖² from the Gram matrix: O(N²) memory instead of pdist's per-pair difference
        # vectors, and no sqrt whose gradient is undefined at coincident points.
        squared_norms = (x * x).sum(dim=1)
        gram = x @ x.t()
        squared = (squared_norms[rows] + squared_norms[cols] - 2 * gram[rows, cols]).clamp_min(0)
        count = x.new_tensor(float(rows.numel()))
        return torch.logsumexp(-self.t * squared, dim=0) - torch.log(count)


# --------------------------------------------------------------------------- tiled form (train.tiled)
# Over the 2N views F (TiledLogits.views()), with target weights w_ik = K(y_{i mod N}, y_{k mod N})
# (0 on self-pairs) computed per tile from the meta-data:
#     ℓ_i = lse_{k≠i} F_ik − S_i / W_i,   S_i = Σ_{k≠i} w_ik F_ik,   W_i = Σ_{k≠i} w_ik,
# and the loss is mean_i ℓ_i — the paper's "rows" normalisation, in one sweep. The official code's
# "code" normalisation divides by column sums of w weighted by each row's lse (two sweeps); it is
# refused with a message (use the full path).


def tile_kernel(meta: Mapping[str, Any], spec, size: int) -> Callable[[Tensor, Tensor], Tensor]:
    """(rows [tr], cols [tc] view indices in [0, 2N)) -> [tr, tc] float64 sample kernel of their samples."""
    spec = parse_kernel(spec)
    if isinstance(spec, str):  # same_sample: SimCLR
        return lambda rows, cols: ((rows % size).unsqueeze(1) == (cols % size).unsqueeze(0)).double()
    factors = []
    for factor in spec:
        if factor.key not in meta:
            raise ValueError(missing_meta(factor.key, meta))
        values = meta[factor.key]
        if len(values) != size:
            raise ValueError(f"meta[{factor.key!r}] has {len(values)} values, expected {size}")
        if factor.type == "rbf":
            factors.append(("rbf", rbf_values(values, factor.key), factor.sigma))
        else:
            factors.append(("delta", delta_codes(values, factor.key), None))

    def kernel(rows: Tensor, cols: Tensor) -> Tensor:
        r, c = (rows % size).cpu(), (cols % size).cpu()
        out = torch.ones(len(r), len(c), dtype=torch.float64)
        for kind, values, sigma in factors:
            if kind == "rbf":
                out = out * rbf_pairs(values[r], values[c], sigma)
            else:
                out = out * (values[r].unsqueeze(1) == values[c].unsqueeze(0)).double()
        return out.to(rows.device)

    return kernel


def yaware_infonce_tiled(loss, logits: TiledLogits, ctx: LossContext) -> LossOutput:
    """:class:`clipkit.plugins.losses.yaware.YAwareInfoNCE` (and its SimCLR / SupCon forms) from tiles."""
    if loss.normalisation != "rows":
        raise ClipkitError(
            f"train.tiled: y-Aware's normalisation {loss.normalisation!r} needs two sweeps and is not tiled; "
            "use normalisation=rows or train.tiled=false"
        )
    size = logits.num_rows("i2t")
    meta = {} if isinstance(loss.kernel, str) else ctx.meta
    kernel = tile_kernel(meta, loss.kernel, size)
    views = logits.views()

    def weights(values: Tensor, tile) -> Tensor:
        return kernel(tile.rows, tile.cols).to(values.dtype).masked_fill(tile.positive, 0.0)

    lse, weighted, totals = views.reduce(
        LogSumExp("i2t", exclude_positive=True),
        RowSum("i2t", lambda values, tile: weights(values, tile) * values),
        RowSum("i2t", lambda values, tile: weights(values, tile)),
    )
    value = (lse - weighted / totals.detach()).mean()
    (best,) = logits.reduce(ArgMax("i2t"))
    return LossOutput(value, {"acc_i2t": (best == logits.targets("i2t")).float().mean()})
