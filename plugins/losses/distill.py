"""Distillation losses (``register_distill_losses``; ``train.distill.losses``, docs/distillation.md).

Each maps the student's and the teacher's :class:`~clipkit.contract.types.DistillView` of the same
anchors to a :class:`LossOutput`; the host adds ``weight ×`` its loss to the contrastive loss. The
teacher's tensors carry no gradient.

* ``kl`` — open_clip's distillation term (``DistillClipLoss``, after MobileCLIP / TinyCLIP): per
  anchor row, the KL divergence from the teacher's softmax over candidates to the student's,

      KL_i = Σ_j p_ij (log p_ij − log q_ij),   p = softmax(t_i / T),  q = softmax(s_i / T),

  averaged over rows, then over the two directions (i2t and t2i). open_clip reports the cross-entropy
  −Σ_j p_ij log q_ij instead: the same gradient, larger by the teacher's entropy (a constant), which is
  logged as ``cross_entropy``. No projection is needed: the rows are over the same candidates whatever
  the two models' widths. ``temperature`` T divides both sides' logits (1: open_clip's); no T² factor
  is applied (fold it into the weight).
* ``feature_cosine`` — mean over anchors of 1 − cos(s_i, t_i), averaged over images and texts.
* ``feature_mse`` — mean over anchors of ||s_i − t_i||², averaged over images and texts (for unit
  embeddings 2 − 2·cos: twice ``feature_cosine``). Both compare embeddings one to one, so they
  declare ``compares_features`` and need equal widths (the host refuses others).

Hand-derived cases (tested): s = [[2, 0], [0, 2]], t = [[1, 0], [0, 1]], T = 1: p_i = (σ(1), σ(−1)),
q_i = (σ(2), σ(−2)) with σ the logistic function, every row alike, so the loss is
σ(1)·log(σ(1)/σ(2)) + σ(−1)·log(σ(−1)/σ(−2)) ≈ 0.0826. Cosine of e1 against (e1 + e2)/√2 is 1/√2, so
the cosine loss of that single pair is 1 − 1/√2 ≈ 0.2929.
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor

from clipkit.config.constraints import POSITIVE
from clipkit.contract.types import DistillView, LossOutput


class KLDistillation:
    """KL(teacher ‖ student) over each anchor's similarity distribution, both directions averaged."""

    def __init__(self, temperature: Annotated[float, POSITIVE] = 1.0) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, student: DistillView, teacher: DistillView) -> LossOutput:
        directions = [
            self.direction(s, t) for s, t in zip(student.logits, teacher.logits, strict=True)
        ]  # (kl, cross-entropy) for i2t, then t2i
        kl = (directions[0][0] + directions[1][0]) / 2
        cross_entropy = (directions[0][1] + directions[1][1]) / 2
        return LossOutput(kl, {"cross_entropy": cross_entropy.detach()})

    def direction(self, student: Tensor, teacher: Tensor) -> tuple[Tensor, Tensor]:
        """student, teacher [Na, Nb] logits -> (mean KL over rows, mean cross-entropy over rows)."""
        if student.shape != teacher.shape:
            raise ValueError(
                f"student logits {tuple(student.shape)} and teacher's {tuple(teacher.shape)} differ"
            )
        log_q = F.log_softmax(student / self.temperature, dim=1)
        log_p = F.log_softmax(teacher.detach() / self.temperature, dim=1)
        p = log_p.exp()
        cross_entropy = -(p * log_q).sum(dim=1).mean()
        entropy = -(torch.xlogy(p, p)).sum(dim=1).mean()  # 0·log 0 = 0 for underflowed probabilities
        return cross_entropy - entropy, cross_entropy


class FeatureCosine:
    """1 − cos(student embedding, teacher embedding), mean over anchors, images and texts averaged."""

    compares_features = True

    def __call__(self, student: DistillView, teacher: DistillView) -> LossOutput:
        image = 1 - F.cosine_similarity(student.image, teacher.image.detach(), dim=1).mean()
        text = 1 - F.cosine_similarity(student.text, teacher.text.detach(), dim=1).mean()
        return LossOutput((image + text) / 2, {"image": image.detach(), "text": text.detach()})


class FeatureMSE:
    """||student embedding − teacher embedding||², mean over anchors, images and texts averaged."""

    compares_features = True

    def __call__(self, student: DistillView, teacher: DistillView) -> LossOutput:
        image = (student.image - teacher.image.detach()).pow(2).sum(dim=1).mean()
        text = (student.text - teacher.text.detach()).pow(2).sum(dim=1).mean()
        return LossOutput((image + text) / 2, {"image": image.detach(), "text": text.detach()})
