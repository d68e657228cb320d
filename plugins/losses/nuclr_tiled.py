"""SogCLR / NUCLR on tiled logits (``train.tiled``; METHODS §6): the quantities of
:func:`clipkit.plugins.losses.nuclr.direction_step` from row/column reductions, never an N×N tensor.

Per direction d (rows = anchors i, candidates j, ζ_j of direction d, P_i = L_ii):
  sweep 1 (no gradient): lse_{j≠i}(L_ij − ζ_j/τ) and max_j L_ij, giving
      log g_i = lse − P_i − log(B−1),  b_i ← max(b_i, τ(max_j L_ij − P_i)),  then u, log_den as the
      full path (:func:`clipkit.plugins.losses.nuclr.updated_log_u`);
  sweep 2: the surrogate's row sums Σ_j τ·coef_ij·L_ij with coef_ij = exp(L_ij − P_i − ζ_j/τ −
      log_den_i)/(B(B−1)) (0 at j = i; detached, so autograd sees exactly τ·coef_ij), minus
      τ·P_i·Σ_j coef_ij (the diagonal's gradient), and for NUCLR the column lse of z*:
      lse_i (L_ij − P_i − ζ_j/τ − log_den_ζ,i).
The per-sample per-weights ζ_j enter as per-candidate offsets of the log-sum-exp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from clipkit.tiled import LogSumExp, Max, RowSum, Separable, SoftmaxWeightedLogits, TiledLogits

OTHER = {"i2t": "t2i", "t2i": "i2t"}


def first_sweep(module, logits: TiledLogits, zetas: dict) -> dict:
    """direction -> (negatives' lse of L − ζ/τ [B], row max [B]) (detached)."""
    reductions = []
    for direction, zeta in zetas.items():
        offset = None if zeta is None else Separable(col=-zeta / module.tau)
        reductions += [LogSumExp(direction, exclude_positive=True, offset=offset), Max(direction)]
    with torch.no_grad():
        values = logits.reduce(*reductions)
    return {d: (values[2 * k].detach(), values[2 * k + 1]) for k, d in enumerate(zetas)}


def second_sweep(module, logits: TiledLogits, positive: Tensor, zetas: dict, rows: dict) -> dict:
    """direction -> (surrogate row sums [B] with gradient, z* column lse [B] or None).

    rows[d] = (log_den [B], log_den_ζ [B] or None), the anchors' denominators (detached)."""
    size = positive.shape[0]
    reductions, layout = [], {}
    for direction, zeta in zetas.items():
        log_den, log_den_zeta = rows[direction]
        layout[direction] = [len(reductions)]
        reductions.append(RowSum(direction, _surrogate_terms(module.tau, positive, zeta, log_den, size)))
        if log_den_zeta is not None:
            layout[direction].append(len(reductions))
            # Over anchors i for each candidate j: the transposed direction's rows are the j.
            offset = _zeta_column_offset(module.tau, positive, zeta, log_den_zeta)
            reductions.append(LogSumExp(OTHER[direction], offset=offset))
    values = logits.reduce(*reductions)
    return {
        d: (values[idx[0]], values[idx[1]].detach() if len(idx) > 1 else None) for d, idx in layout.items()
    }


def _surrogate_terms(tau: float, positive: Tensor, zeta, log_den: Tensor, size: int) -> SoftmaxWeightedLogits:
    """RowSum term τ·coef_ij·L_ij, coef_ij = exp(L_ij − P_i − log_den_i − ζ_j/τ)/(B(B−1)) detached and 0
    on the positive."""
    weight = Separable(row=-positive.detach() - log_den, col=None if zeta is None else -zeta / tau)
    return SoftmaxWeightedLogits(tau / (size * (size - 1)), weight, exclude_positive=True)


def _zeta_column_offset(tau: float, positive: Tensor, zeta: Tensor, log_den_zeta: Tensor) -> Separable:
    """Offset of the transposed tile (rows = candidates j, cols = anchors i): −P_i − ζ_j/τ − log_den_ζ,i."""
    return Separable(row=-zeta / tau, col=-positive.detach() - log_den_zeta)


def row_coefficient_sums(log_g: Tensor, log_den: Tensor, size: int) -> Tensor:
    """[B] Σ_{j≠i} coef_ij = (B−1)·g_i / den_i / (B(B−1)) (detached)."""
    return (log_g + math.log(size - 1) - log_den).exp() / (size * (size - 1))
