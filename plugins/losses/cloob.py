"""CLOOB: InfoLOOB (`infoloob`, `cloob` losses) with Hopfield retrieval (the `hopfield` similarity,
:mod:`clipkit.plugins.similarities.hopfield`).

METHODS.md §4 (seed 001, §2, Pseudocode 1), with the official-code notes of §11.

Training (the similarity in ``train()`` mode, paired batch Na == Nb): with X, Y [N, d] the unit
pooled image / text embeddings of the batch, the batch itself is the Hopfield memory and

    H(β, Q, S)_i = Σ_k softmax_k(β S_k·Q_i) S_k              (then re-normalised to unit length)
    U_x = H(β, X, X)   U_y = H(β, Y, X)   V_x = H(β, X, Y)   V_y = H(β, Y, Y)
    i2t = U_x U_yᵀ / τ   [N, N]   (image anchors, retrieved from the image store)
    t2i = V_y V_xᵀ / τ   [N, N]   (text anchors, retrieved from the text store; NOT i2t.T)
    InfoLOOB(L)  = mean_i [ −L_ii + lse_{j≠i} L_ij ]          (positive left out of the denominator)
    cloob loss   = τ · ( InfoLOOB(i2t) + InfoLOOB(t2i) )

Evaluation (``eval()`` mode, or Na != Nb such as images against class prompts): there is no
paired store to retrieve from, so the logits are the plain scaled cosine of the pooled
embeddings, as CLOOB evaluates zero-shot with the encoders' embeddings.

Hand-derived case (tested): InfoLOOB of L = [[2, 0, 1], [0, 1, 0], [1, 1, 3]] over rows is
mean(−2 + log(1 + e), −1 + log 2, −3 + 1 + log 2) ≈ −0.766815.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from clipkit.config.constraints import POSITIVE
from clipkit.contract.types import Logits, LossContext, LossOutput
from clipkit.tiled import TiledLogits


def info_loob(logits: Tensor, targets: Tensor) -> Tensor:
    """InfoLOOB over the rows of ``logits`` [Na, Nb]: mean_i [ −L_i,t_i + lse_{j≠t_i} L_ij ].

    targets [Na]: the column of each row's positive. The positive is removed from the
    log-sum-exp (set to −inf there), so the loss is linear in the positive's logit with slope
    −1/Na and can go below zero. Needs Nb ≥ 2 (a row with no negative has an empty lse).
    """
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"InfoLOOB needs logits [Na, Nb] with Nb >= 2 candidates, got {tuple(logits.shape)}")
    columns = targets.unsqueeze(1)
    positives = logits.gather(1, columns).squeeze(1)  # [Na]
    is_positive = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, columns, True)
    negatives = logits.masked_fill(is_positive, float("-inf")).logsumexp(dim=1)  # [Na]
    return (negatives - positives).mean()


def _directions(logits: Logits, targets: Tensor) -> tuple[Tensor, Tensor]:
    """InfoLOOB over the rows of i2t (image anchors) and of t2i (text anchors)."""
    return info_loob(logits.i2t, targets), info_loob(logits.t2i, targets)


def _metrics(logits: Logits, targets: Tensor, image_to_text: Tensor, text_to_image: Tensor) -> dict:
    accuracy = (logits.i2t.detach().argmax(dim=1) == targets).float().mean()
    return {"loss_i2t": image_to_text.detach(), "loss_t2i": text_to_image.detach(), "acc_i2t": accuracy}


def _tiled_directions(logits: TiledLogits) -> tuple[Tensor, Tensor, dict]:
    """InfoLOOB of both directions from tiles: mean_r (lse_{j≠t_r} L_rj − L_r,t_r); and the metrics."""
    from clipkit.plugins.losses.baseline_losses import tiled_positives_and_negative_lse

    positives, negative_lse, accuracy = tiled_positives_and_negative_lse(logits)
    image_to_text, text_to_image = ((negative_lse[d] - positives[d]).mean() for d in ("i2t", "t2i"))
    metrics = {"loss_i2t": image_to_text.detach(), "loss_t2i": text_to_image.detach(), "acc_i2t": accuracy}
    return image_to_text, text_to_image, metrics


class InfoLOOB:
    """Symmetric InfoLOOB (METHODS §4): ½ [ InfoLOOB(rows of i2t) + InfoLOOB(rows of t2i) ].

    Assumes logits already scaled, L_ij = A_i·B_j/τ (any similarity: with ``dot`` it is the
    "InfoLOOB, Hopfield off" ablation; with ``hopfield`` it is CLOOB up to the factor 2τ).
    The halving mirrors ``infonce`` so the two are drop-in ablations of each other.
    targets: [Na] the column of each row's positive (the diagonal for a full batch).
    Metrics: ``loss_i2t``, ``loss_t2i`` (each direction's InfoLOOB) and ``acc_i2t``.
    """

    requires: frozenset[str] = frozenset()
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True
    fused_reductions = True  # its tiled_loss runs in the fused kernels on CUDA (clipkit.tiled.fused)

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image_to_text, text_to_image = _directions(logits, targets)
        loss = (image_to_text + text_to_image) / 2
        return LossOutput(loss, _metrics(logits, targets, image_to_text, text_to_image))

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from tiles (``train.tiled``; any tileable similarity, e.g. ``dot``)."""
        image_to_text, text_to_image, metrics = _tiled_directions(logits)
        return LossOutput((image_to_text + text_to_image) / 2, metrics)


class CLOOBLoss:
    """CLOOB's objective (METHODS §4): τ · ( InfoLOOB(rows of i2t) + InfoLOOB(rows of t2i) ).

    With ``hopfield`` logits (scale 1/τ) this is τ·(InfoLOOB(U_x, U_y) + InfoLOOB(V_y, V_x)).
    It follows the paper and the official code (§11: ``infoLOOB`` returns τ·(pos + neg) per
    direction and the image and text terms are summed, not averaged). The factor τ only
    rescales the gradient (with AdamW it mostly cancels) but keeps the loss values comparable
    with the paper's.

    inverse_tau: 1/τ > 0; must equal the similarity's 1/τ (seed 001: 30). It is a constant:
                 with a learnable 1/τ in the similarity, the official code multiplies by the
                 live τ instead (METHODS fixes τ, so recipes should not learn it).
    targets: [Na] the column of each row's positive (the diagonal for a full batch).
    Metrics: ``loss_i2t``, ``loss_t2i`` (each direction's InfoLOOB, before the factor τ), ``acc_i2t``.
    """

    requires: frozenset[str] = frozenset()
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True

    def __init__(self, inverse_tau: Annotated[float, POSITIVE] = 30.0) -> None:
        if inverse_tau <= 0:
            raise ValueError(f"inverse_tau (1/τ) must be > 0, got {inverse_tau}")
        self.tau = 1.0 / inverse_tau

    def similarity_refusal(self, similarity: torch.nn.Module) -> str | None:
        """Why ``similarity`` does not start at this loss's 1/τ (the two must be equal, METHODS §4),
        or None. A learnable 1/τ may move afterwards: the loss keeps its constant, as documented."""
        from clipkit.plugins.similarities.temperature import scale_refusal

        return scale_refusal(similarity, 1.0 / self.tau, f"loss.inverse_tau={1.0 / self.tau:g}", fixed=False)

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image_to_text, text_to_image = _directions(logits, targets)
        loss = self.tau * (image_to_text + text_to_image)
        return LossOutput(loss, _metrics(logits, targets, image_to_text, text_to_image))

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from tiles (``train.tiled``); CLOOB's own ``hopfield`` similarity cannot tile."""
        image_to_text, text_to_image, metrics = _tiled_directions(logits)
        return LossOutput(self.tau * (image_to_text + text_to_image), metrics)
