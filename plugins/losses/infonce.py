"""`infonce`: CLIP's symmetric InfoNCE (METHODS.md §1).

loss = ½ [ mean_a CE(L[a, :], t_a) + mean_b CE(L_t2i[b, :], t_b) ]

Hand-derived case (tested): two pairs with i2t = [[2, 0], [0, 2]] (t2i its transpose):
each row's CE is log(e² + 1) − 2 = log(1 + e⁻²) ≈ 0.126928, so the loss is 0.126928.
"""

from __future__ import annotations

from typing import Annotated

from torch import Tensor, nn

from clipkit.config.constraints import Range
from clipkit.contract.types import Logits, LossContext, LossOutput
from clipkit.tiled import ArgMax, LogSumExp, RowSum, ScaledLogits, TiledLogits


class InfoNCE:
    """Symmetric InfoNCE over the logits' rows (i2t) and columns (t2i).

    targets: [Na] index of each anchor's positive among the candidates (the diagonal for
             a full batch; offset rows for a rank's local slice).
    """

    requires: frozenset[str] = frozenset()
    # Row-wise mean: the mean over processes of local losses (own anchors, all candidates) is the
    # full-batch loss, so train.distributed.local_loss is exact (tests/test_distributed.py).
    supports_local_loss = True
    # Its reductions (lse, argmax, label smoothing's ScaledLogits) run in the fused kernels on CUDA.
    fused_reductions = True
    #: plain tensor code: train.compile_scope=step compiles it with the similarity (clipkit.train.compile)
    compiles = True

    def __init__(self, label_smoothing: Annotated[float, Range(ge=0, lt=1)] = 0.0) -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.label_smoothing = label_smoothing

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        image_to_text = nn.functional.cross_entropy(logits.i2t, targets, label_smoothing=self.label_smoothing)
        text_to_image = nn.functional.cross_entropy(logits.t2i, targets, label_smoothing=self.label_smoothing)
        loss = (image_to_text + text_to_image) / 2
        accuracy = (logits.i2t.argmax(dim=1) == targets).float().mean()
        return LossOutput(
            loss,
            {
                "loss_i2t": image_to_text.detach(),
                "loss_t2i": text_to_image.detach(),
                "acc_i2t": accuracy,
            },
        )

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same loss from row/column reductions (``train.tiled``; clipkit.tiled): per direction,
        CE_r = lse_j L_rj − (1 − ε)·L_r,t_r − ε·mean_j L_rj (ε = label_smoothing)."""
        reductions = [LogSumExp("i2t"), LogSumExp("t2i"), ArgMax("i2t")]
        if self.label_smoothing:
            reductions += [RowSum(d, ScaledLogits(1 / logits.num_candidates(d))) for d in ("i2t", "t2i")]
        values = logits.reduce(*reductions)
        directions = []
        for index, direction in enumerate(("i2t", "t2i")):
            row_loss = values[index] - (1 - self.label_smoothing) * logits.positives(direction)
            if self.label_smoothing:
                row_loss = row_loss - self.label_smoothing * values[3 + index]
            directions.append(row_loss.mean())
        image_to_text, text_to_image = directions
        accuracy = (values[2] == logits.targets("i2t")).float().mean()
        return LossOutput(
            (image_to_text + text_to_image) / 2,
            {"loss_i2t": image_to_text.detach(), "loss_t2i": text_to_image.detach(), "acc_i2t": accuracy},
        )
