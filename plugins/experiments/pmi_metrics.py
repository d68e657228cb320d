"""How close a learned similarity is to the true PMI: Pearson/RMSE after the best shift, and the
held-out InfoNCE gap to the PMI's own loss (METHODS §8)."""

from __future__ import annotations

import torch
from torch import Tensor

from clipkit.contract.types import Logits, LossContext


def pmi_fidelity(learned: Tensor, true: Tensor) -> dict[str, float]:
    """Distance between a learned similarity and the true PMI on the same pairs.

    learned, true: same shape (e.g. [N, N] logits and PMI of a held-out batch). The similarity is
    defined up to a constant (InfoNCE cannot see one), so ``learned`` is first shifted by the
    best constant c = mean(true − learned) (the least-squares shift).
    Returns pearson (correlation, shift- and scale-free), rmse (after the shift; in nats),
    shift (c), true_std (the PMI's standard deviation: the RMSE of the best constant predictor) and
    sup_error = min_C max |learned + C − true| = (max − min of true − learned)/2: the uniform
    approximation error with its own best constant, the measure of seed 000's §5.1 and Thm 5.1
    (over these pairs: an estimate from below of the sup over the whole support).
    """
    if learned.shape != true.shape:
        raise ValueError(f"learned {tuple(learned.shape)} and true {tuple(true.shape)} differ in shape")
    a, b = learned.detach().double().flatten(), true.detach().double().flatten()
    if a.numel() < 2 or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("pmi_fidelity needs at least 2 finite values on both sides")
    shift = (b - a).mean()
    residual = a + shift - b
    a_centered, b_centered = a - a.mean(), b - b.mean()
    denominator = a_centered.norm() * b_centered.norm()
    pearson = float((a_centered @ b_centered) / denominator) if float(denominator) > 0 else 0.0
    return {
        "pearson": pearson,
        "rmse": float(residual.square().mean().sqrt()),
        "shift": float(shift),
        "true_std": float(b_centered.square().mean().sqrt()),
        "sup_error": float(((b - a).max() - (b - a).min()) / 2),
    }


def infonce(i2t: Tensor, t2i: Tensor | None = None) -> Tensor:
    """Symmetric CLIP loss (METHODS §1) of [N, N] logits whose positives are the diagonal:
    ½ [ mean_a CE(L[a, :], a) + mean_b CE(L_t2i[b, :], b) ], t2i = i2t.T unless given — the
    registered ``infonce`` loss itself, so the study scores with what it trains with."""
    from clipkit.plugins.losses.infonce import InfoNCE

    logits = Logits(i2t=i2t, t2i=i2t.t() if t2i is None else t2i)
    return InfoNCE()(logits, torch.arange(i2t.shape[0], device=i2t.device), LossContext()).loss


def infonce_gap(learned: Tensor | Logits, true_pmi: Tensor) -> float:
    """InfoNCE(learned logits) − InfoNCE(true PMI logits) on the same held-out batch (≥ 0 in
    expectation: PMI + const minimises the expected InfoNCE at every batch size)."""
    learned_loss = infonce(learned.i2t, learned.t2i) if isinstance(learned, Logits) else infonce(learned)
    return float(learned_loss.double() - infonce(true_pmi.double()))
