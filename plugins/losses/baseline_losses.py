"""Baseline losses named by the papers: SigLIP, CyCLIP, decoupled and debiased contrastive
(METHODS.md §7 and §11).

Each is a callable class with a ``requires`` frozenset, like :mod:`clipkit.plugins.losses.infonce`.
Logits arrive already scaled by the similarity; each class says what it assumes about them.
Rows are anchors; ``targets[i]`` is the column of row i's positive (the diagonal ``arange(N)``
for a full batch, offset columns for a rank's local slice of rows).

Hand-derived cases (tested):

* SigLIP, N = 2, L = [[2, -1], [0, 3]]: the positives give softplus(-2) + softplus(-3) and the
  negatives softplus(-1) + softplus(0); the loss is their sum / 2 ≈ 0.590962.
* CyCLIP, x = (e1, e2), y = (e1, (e1 + e2)/√2), λ = 1 each: x·y = [[1, c], [0, c]] with
  c = 1/√2, so the cross term is (0² + c² + c² + 0²)/2 = 1/2; the Gram matrices are
  I and [[1, c], [c, 1]], so the in-modal term is (0 + c² + c² + 0)/2 = 1/2.
* Decoupled, N = 2, L = [[2, 0], [0, 2]]: each row is -2 + lse(0) = -2, so the loss is -2.
  DCLW with σ = 1 on L = [[2, 0], [0, 1]]: softmax(2, 1) = (0.731059, 0.268941), so
  w = 2 − 2·softmax = (0.537883, 1.462117); rows −2w₀ + 0 and −w₁ + 0, in both directions,
  give the loss −(2w₀ + w₁)/2 ≈ −1.268941.
* Debiased, N = 2, τ⁺ = 0, L = [[2, 0], [0, 2]], t = 0.5: N_g = max(e⁰, e⁻²) = 1, each row is
  -log(e² / (e² + 1)) = log(1 + e⁻²) ≈ 0.126928 (InfoNCE's value); with L = [[2, -3], [-3, 2]]
  the clamp e⁻² > e⁻³ is active and each row is log(1 + e⁻⁴) ≈ 0.018150.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from clipkit.config.constraints import NON_NEGATIVE, POSITIVE, Range
from clipkit.contract.types import Logits, LossContext, LossOutput
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.tiled import ArgMax, LogSumExp, RowSum, SigmoidPairTerms, TiledLogits


def _positive_mask(scores: Tensor, targets: Tensor) -> Tensor:
    """[Na, Nb] bool, True at (i, targets[i])."""
    return F.one_hot(targets, scores.shape[1]).bool()


def _positives_and_negative_lse(scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """scores [Na, Nb], targets [Na] -> (positive logit [Na], lse over the row's negatives [Na]).

    The positive is masked with -inf rather than removed, so the row keeps its shape and the
    gradient to the masked entry is exactly zero.
    """
    if scores.shape[1] < 2:
        raise ValueError(
            f"these losses need at least 2 candidates per row (one negative), got {scores.shape[1]}"
        )
    positive = scores.gather(1, targets.unsqueeze(1)).squeeze(1)
    negatives = scores.masked_fill(_positive_mask(scores, targets), float("-inf"))
    return positive, torch.logsumexp(negatives, dim=1)


def _accuracy(scores: Tensor, targets: Tensor) -> Tensor:
    return (scores.detach().argmax(dim=1) == targets).float().mean()


def tiled_positives_and_negative_lse(logits: TiledLogits) -> tuple[dict, dict, Tensor]:
    """The tiled counterpart of :func:`_positives_and_negative_lse` for both directions, in one sweep:
    ({direction: positive logits [rows]}, {direction: lse over the negatives [rows]}, acc_i2t)."""
    for direction in ("i2t", "t2i"):
        if logits.num_candidates(direction) < 2:
            raise ValueError(
                f"these losses need at least 2 candidates per row (one negative), got "
                f"{logits.num_candidates(direction)}"
            )
    lse_i2t, lse_t2i, best = logits.reduce(
        LogSumExp("i2t", exclude_positive=True), LogSumExp("t2i", exclude_positive=True), ArgMax("i2t")
    )
    positives = {d: logits.positives(d) for d in ("i2t", "t2i")}
    accuracy = (best == logits.targets("i2t")).float().mean()
    return positives, {"i2t": lse_i2t, "t2i": lse_t2i}, accuracy


class SigLIPLoss:
    """SigLIP's pairwise sigmoid loss (METHODS.md §7; normalisation from §11).

    loss = -(1/N) Σ_ab log σ(z_ab L_ab),  z_ab = +1 if b == targets[a] else -1,

    summed over all N × Nb pairs of ``logits.i2t`` and divided by the number of rows N (the
    paper's and code's "sum over all pairs / batch size", not a mean over pairs).

    Assumes L_ab = s·x_a·y_b + c: the learnable scale s (init 10) and bias c (init -10) live in
    the similarity (``dot`` with ``init_scale: 10, bias: -10``); the loss has no parameters.
    Only i2t is used: each pair's term is symmetric in (a, b), so t2i adds nothing.
    """

    requires: frozenset[str] = frozenset()
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True
    fused_reductions = True  # its tiled_loss runs in the fused kernels on CUDA (clipkit.tiled.fused)

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        scores = logits.i2t
        positive = _positive_mask(scores, targets)
        signs = positive.to(scores.dtype) * 2 - 1
        # logsigmoid is log σ(v) = -softplus(-v): stable for large |v| (the bias starts at -10).
        pair_terms = -F.logsigmoid(signs * scores)
        rows = scores.shape[0]
        loss = pair_terms.sum() / rows
        return LossOutput(
            loss,
            {
                "loss_pos": (pair_terms.detach() * positive).sum() / rows,
                "loss_neg": (pair_terms.detach() * ~positive).sum() / rows,
                "acc_i2t": _accuracy(scores, targets),
            },
        )

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from tile sums of the pair terms (``train.tiled``; clipkit.tiled)."""
        row_terms, best = logits.reduce(RowSum("i2t", SigmoidPairTerms()), ArgMax("i2t"))
        rows = logits.num_rows("i2t")
        positive_terms = -F.logsigmoid(logits.positives("i2t").detach())
        total = row_terms.sum()
        return LossOutput(
            total / rows,
            {
                "loss_pos": positive_terms.sum() / rows,
                "loss_neg": (total.detach() - positive_terms.sum()) / rows,
                "acc_i2t": (best == logits.targets("i2t")).float().mean(),
            },
        )


class CyCLIPLoss:
    """CyCLIP: symmetric InfoNCE plus two cyclic-consistency regularisers (METHODS.md §7, §11).

    loss = InfoNCE(logits)
         + λ_cross · (1/N) Σ_ab (x_a·y_b − x_b·y_a)²     (cross-modal: the i2t cosine matrix is symmetric)
         + λ_in    · (1/N) Σ_ab (x_a·x_b − y_a·y_b)²     (in-modal: both modalities' Gram matrices agree)

    x [N, d], y [N, d] are the unit pooled embeddings of ``ctx.features`` (PointSet.mean(), then
    L2-normalised), so the regularisers use *unscaled* cosines whatever scale the logits carry.
    N is the features' batch size; the 1/N over an N² sum is deliberate: the CyCLIP code takes
    the mean over the N² entries and multiplies by the batch size. Mapping to the CyCLIP code:
    its ``cylambda1`` is ``lambda_in`` (in-modal) and its ``cylambda2`` is ``lambda_cross``.
    Paper defaults λ = 0.25 each (the code defaults to 0). The InfoNCE term is
    :class:`clipkit.plugins.losses.infonce.InfoNCE` on the logits handed in (any scale).
    """

    #: train.tiled: the cyclic terms compare whole N×N cosine and Gram matrices entry by entry.
    tiled_unsupported = "its cyclic-consistency terms are sums over the N×N cosine and Gram matrices"
    requires: frozenset[str] = frozenset({"features"})
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True

    def __init__(
        self,
        lambda_cross: Annotated[float, NON_NEGATIVE] = 0.25,
        lambda_in: Annotated[float, NON_NEGATIVE] = 0.25,
    ) -> None:
        for name, value in (("lambda_cross", lambda_cross), ("lambda_in", lambda_in)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.lambda_cross = lambda_cross
        self.lambda_in = lambda_in
        self.infonce = InfoNCE()

    @staticmethod
    def cyclic_terms(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, d], y [N, d] unit rows -> (cross-modal term, in-modal term), each (1/N)·Σ over N² pairs."""
        batch = x.shape[0]
        cross = x @ y.t()
        cross_term = (cross - cross.t()).square().sum() / batch
        in_term = (x @ x.t() - y @ y.t()).square().sum() / batch
        return cross_term, in_term

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image, text = ctx.features
        x = F.normalize(image.mean(), dim=-1)
        y = F.normalize(text.mean(), dim=-1)
        contrastive = self.infonce(logits, targets, ctx)
        cross_term, in_term = self.cyclic_terms(x, y)
        loss = contrastive.loss + self.lambda_cross * cross_term + self.lambda_in * in_term
        return LossOutput(
            loss,
            {
                "infonce": contrastive.loss.detach(),
                "cyclic_cross": cross_term.detach(),
                "cyclic_in_modal": in_term.detach(),
                "acc_i2t": contrastive.metrics["acc_i2t"],
            },
        )


class DecoupledContrastiveLoss:
    """Decoupled contrastive loss, DCL of Yeh et al. 2022 (METHODS.md §7, §11), cross-modal form.

    Per direction (i2t, then t2i), with P_i = L[i, targets[i]] the positive logit of row i:

        ℓ_i = −w_i·P_i + lse_{j ≠ targets[i]} L_ij          (the positive is left out of the denominator)
        loss = ½ [ mean_i ℓ_i(i2t) + mean_i ℓ_i(t2i) ]

    Without weighting w_i = 1. Identity (tested): lse_{j≠i} L_ij = lse_j L_ij + log(1 − p_ii),
    p = softmax of the row, so each unweighted row equals InfoNCE's row plus log(1 − p_ii).
    Negatives are the cross-modal candidates only (the two-view SimCLR form of the paper also
    uses in-view negatives; those would need ``in_modal``, which this cross-modal form does not use).

    DCLW (``weighting_sigma`` = σ): the von Mises–Fisher weighting of the positive,
        w_i = 2 − exp(P_i/σ) / mean_k exp(P_k/σ) = 2 − N_rows · softmax_k(P_k/σ)_i,
    the mean running over the rows of this direction (so mean_i w_i = 1). The paper writes it
    on cosines, w = 2 − exp(⟨z_i, z_i'⟩/σ_paper)/E[...]; the logits here are already scaled
    (P = cos/τ for ``dot`` with init_scale = 1/τ), so ``weighting_sigma`` acts on logits:
    the paper's σ_paper = 0.5 at τ = 0.1 is ``weighting_sigma = σ_paper/τ = 5``. The weights are
    detached (a weighting of the positive term, as Lightly's implementation does; the unofficial
    raminnakhli/Decoupled-Contrastive-Learning code back-propagates through them instead).

    Assumes logits of the form s·cos (paper: τ = 0.1, i.e. ``dot`` with init_scale 10, fixed).
    """

    requires: frozenset[str] = frozenset()
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True
    fused_reductions = True  # its tiled_loss runs in the fused kernels on CUDA (clipkit.tiled.fused)

    def __init__(self, weighting_sigma: Annotated[float | None, POSITIVE] = None) -> None:
        if weighting_sigma is not None and not weighting_sigma > 0:
            raise ValueError(f"weighting_sigma must be > 0 (or None for no weighting), got {weighting_sigma}")
        self.weighting_sigma = weighting_sigma

    def positive_weights(self, positive: Tensor) -> Tensor:
        """[Na] positive logits -> [Na] detached DCLW weights (ones when unweighted)."""
        if self.weighting_sigma is None:
            return torch.ones_like(positive)
        positive = positive.detach()
        return 2 - positive.shape[0] * torch.softmax(positive / self.weighting_sigma, dim=0)

    def direction(self, scores: Tensor, targets: Tensor) -> Tensor:
        """scores [Na, Nb], targets [Na] -> mean_i ℓ_i (0-d)."""
        positive, negative_lse = _positives_and_negative_lse(scores, targets)
        return (-self.positive_weights(positive) * positive + negative_lse).mean()

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image_to_text = self.direction(logits.i2t, targets)
        text_to_image = self.direction(logits.t2i, targets)
        return LossOutput(
            (image_to_text + text_to_image) / 2,
            {
                "loss_i2t": image_to_text.detach(),
                "loss_t2i": text_to_image.detach(),
                "acc_i2t": _accuracy(logits.i2t, targets),
            },
        )

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from the positives and the negatives' lse of each row (``train.tiled``)."""
        positives, negative_lse, accuracy = tiled_positives_and_negative_lse(logits)
        image_to_text, text_to_image = (
            (-self.positive_weights(positives[d]) * positives[d] + negative_lse[d]).mean()
            for d in ("i2t", "t2i")
        )
        return LossOutput(
            (image_to_text + text_to_image) / 2,
            {"loss_i2t": image_to_text.detach(), "loss_t2i": text_to_image.detach(), "acc_i2t": accuracy},
        )


class DebiasedContrastiveLoss:
    """Debiased contrastive loss of Chuang et al. 2020 — NUCLR's "DCL" baseline (METHODS.md §11).

    Per direction, anchor i with positive logit pos = L[i, targets[i]], negatives neg_j = L_ij
    (j ≠ targets[i]), K = Nb − 1 negatives:

        N_g = max( (−τ⁺·K·e^{pos} + Σ_j e^{neg_j}) / (1 − τ⁺),  K·e^{−1/t} )
        ℓ_i = −log( e^{pos} / (e^{pos} + N_g) )
        loss = ½ [ mean_i ℓ_i(i2t) + mean_i ℓ_i(t2i) ]

    The logits are assumed to be cosine / t, i.e. ``dot`` with a fixed ``init_scale = 1/t``
    (``learn_scale: false``); ``temperature`` must equal that t — it is used only for the clamp
    K·e^{−1/t}, the smallest value Σ_j e^{neg_j} can take when every cosine is −1. Negatives are
    the cross-modal candidates only (Chuang et al.'s two-view form counts 2N − 2). With τ⁺ = 0
    and the clamp inactive, ℓ_i is InfoNCE's row loss.

    Computed in log space: log N_g = max(log A, log K − 1/t) with
    log A = lse_neg + log1p(−τ⁺K·e^{pos − lse_neg}) − log(1 − τ⁺) when the bracket is positive
    (−∞ otherwise, where the clamp wins), and ℓ_i = logaddexp(pos, log N_g) − pos.
    """

    requires: frozenset[str] = frozenset()
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True
    fused_reductions = True  # its tiled_loss runs in the fused kernels on CUDA (clipkit.tiled.fused)

    def __init__(
        self,
        tau_plus: Annotated[float, Range(ge=0, lt=1)] = 0.1,
        temperature: Annotated[float, POSITIVE] = 0.5,
    ) -> None:
        if not 0.0 <= tau_plus < 1.0:
            raise ValueError(f"tau_plus (the positive class prior τ⁺) must be in [0, 1), got {tau_plus}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.tau_plus = tau_plus
        self.temperature = temperature

    def log_negative_estimate(
        self, positive: Tensor, negative_lse: Tensor, num_negatives: int
    ) -> tuple[Tensor, Tensor]:
        """[Na] pos, [Na] lse of the negatives -> ([Na] log N_g, [Na] bool: the clamp is active)."""
        log_unclamped = negative_lse
        if self.tau_plus > 0:
            # log(τ⁺K e^{pos} / Σ e^{neg}): the bracket −τ⁺K e^{pos} + Σ e^{neg} is positive iff it is < 0.
            log_ratio = math.log(self.tau_plus * num_negatives) + positive - negative_lse
            positive_bracket = log_ratio < 0
            # Feed a harmless value where the bracket is not positive so that no inf/nan reaches
            # the gradient through the branch torch.where discards.
            safe_ratio = torch.where(positive_bracket, log_ratio, torch.full_like(log_ratio, -1.0)).exp()
            log_unclamped = torch.where(
                positive_bracket,
                negative_lse + torch.log1p(-safe_ratio) - math.log1p(-self.tau_plus),
                torch.full_like(negative_lse, float("-inf")),
            )
        log_clamp = math.log(num_negatives) - 1 / self.temperature
        return torch.clamp(log_unclamped, min=log_clamp), log_unclamped.detach() < log_clamp

    def direction(self, scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """scores [Na, Nb], targets [Na] -> (mean_i ℓ_i, fraction of rows where the clamp is active)."""
        positive, negative_lse = _positives_and_negative_lse(scores, targets)
        return self.direction_from(positive, negative_lse, scores.shape[1] - 1)

    def direction_from(
        self, positive: Tensor, negative_lse: Tensor, num_negatives: int
    ) -> tuple[Tensor, Tensor]:
        """[Na] positives, [Na] lse of the negatives -> (mean_i ℓ_i, fraction of clamped rows)."""
        log_negatives, clamp_active = self.log_negative_estimate(positive, negative_lse, num_negatives)
        return (torch.logaddexp(positive, log_negatives) - positive).mean(), clamp_active.float().mean()

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from the positives and the negatives' lse of each row (``train.tiled``)."""
        positives, negative_lse, accuracy = tiled_positives_and_negative_lse(logits)
        (image_to_text, clamped_i2t), (text_to_image, clamped_t2i) = (
            self.direction_from(positives[d], negative_lse[d], logits.num_candidates(d) - 1)
            for d in ("i2t", "t2i")
        )
        return LossOutput(
            (image_to_text + text_to_image) / 2,
            {
                "loss_i2t": image_to_text.detach(),
                "loss_t2i": text_to_image.detach(),
                "clamp_fraction": (clamped_i2t + clamped_t2i) / 2,
                "acc_i2t": accuracy,
            },
        )

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image_to_text, clamped_i2t = self.direction(logits.i2t, targets)
        text_to_image, clamped_t2i = self.direction(logits.t2i, targets)
        return LossOutput(
            (image_to_text + text_to_image) / 2,
            {
                "loss_i2t": image_to_text.detach(),
                "loss_t2i": text_to_image.detach(),
                "clamp_fraction": (clamped_i2t + clamped_t2i) / 2,
                "acc_i2t": _accuracy(logits.i2t, targets),
            },
        )
