"""The contrastive objective of one step, after the towers: the gather into the global batch, the
similarity and the loss (:func:`contrastive_loss`) — and what the loop does when the loss is not finite.

:class:`clipkit.train.step.TrainingStep` calls :func:`contrastive_loss` inside its forward; exact
accumulation (:mod:`clipkit.train.accumulate`) calls it on the cached features too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from clipkit.errors import ClipkitError
from clipkit.types import Logits, LossContext, LossOutput, PointSet, optional_member

if TYPE_CHECKING:
    from clipkit.train.build import Trainer


def contrastive_loss(
    trainer: Trainer, local_a: PointSet, local_b: PointSet, batch: dict, step: int
) -> LossOutput:
    """This process's point sets -> the recipe's loss on the contrastive batch.

    Global loss (default): every process scores the whole gathered batch. Local loss
    (``train.distributed.local_loss``): this process's anchors against all candidates; DDP's
    gradient averaging turns the mean of the local losses into the full-batch loss.
    """
    rt, loss_fn, similarity = trainer.runtime, trainer.loss, similarity_of(trainer)
    a, b = rt.gather(local_a), rt.gather(local_b)  # global batch, fp32
    epoch = trainer.stream.epoch + trainer.stream.batch_in_epoch * a.batch_size / trainer.stream.num_samples
    if uses_tiles(trainer, a.batch_size):  # loss.tiled: never materialise the N×N logits
        from clipkit.tiled.train import tiled_contrastive_loss

        gathered = {} if rt.local_loss else global_fields(trainer, batch)
        ctx = loss_context(trainer, gathered, a, b, step, epoch, in_modal=False)  # tiled losses score views
        return tiled_contrastive_loss(trainer, similarity, local_a, local_b, a, b, ctx, step)
    if rt.local_loss:
        n = local_a.batch_size
        image_rows = similarity(local_a.float(), b, generator=rt.generator(step)).i2t  # [n, N]
        text_rows = similarity(a, local_b.float(), generator=rt.generator(step)).t2i  # [n, N]
        ctx = loss_context(trainer, {}, a, b, step, epoch)
        return loss_fn(Logits(i2t=image_rows, t2i=text_rows), rt.targets(n, offset=rt.rank * n), ctx)
    logits = similarity(a, b, generator=rt.generator(step))
    ctx = loss_context(trainer, global_fields(trainer, batch), a, b, step, epoch)
    return loss_fn(logits, rt.targets(a.batch_size), ctx)


def uses_tiles(trainer: Trainer, batch_size: int) -> bool:
    """Whether ``loss.tiled`` (clipkit.tiled.settings) routes this contrastive batch to the tiled path."""
    tiling = trainer.tiling
    if tiling is None or tiling.mode == "false":
        return False
    from clipkit.tiled.contract import refusal

    return tiling.applies(batch_size, refusal(trainer.loss, similarity_of(trainer)))


def similarity_of(trainer: Trainer) -> nn.Module:
    """The model's similarity module: the one that scores (and owns the comparison's parameters)."""
    return trainer.model.similarity


def loss_context(
    trainer: Trainer, gathered: dict, a, b, step: int, epoch: float, *, in_modal: bool = True
) -> LossContext:
    """Only the fields the loss declared (in-modal similarities cost two more N×N products).

    ``gathered`` holds the global batch's ``index`` and ``meta`` (gathered over processes);
    ``in_modal=False`` leaves the N×N in-modal logits out (the tiled path scores them by tiles).
    """
    requires, similarity = optional_member(trainer.loss, "requires"), similarity_of(trainer)
    fields: dict[str, Any] = {key: gathered[key] for key in ("index", "meta") if key in requires}
    if "in_modal" in requires and in_modal:
        fields["in_modal"] = Logits(i2t=similarity(a, a).i2t, t2i=similarity(b, b).i2t)
    if "features" in requires:
        fields["features"] = (a, b)
    if "step" in requires:
        fields["step"] = step
    if "epoch" in requires:
        fields["epoch"] = epoch
    return LossContext(**fields)


def global_fields(trainer: Trainer, batch: dict) -> dict:
    """The global batch's sample indices and meta-data, gathered only when the loss declared them."""
    rt, requires, fields = trainer.runtime, optional_member(trainer.loss, "requires"), {}
    if "index" in requires:
        fields["index"] = rt.gather_rows(batch["index"])
    if "meta" in requires:
        fields["meta"] = {key: rt.gather_list(list(values)) for key, values in batch["meta"].items()}
    return fields


def loss_is_finite(trainer: Trainer, out: LossOutput, step: int) -> bool:
    """All processes agree whether the loss is finite; a non-finite one stops the run or
    (``train.nonfinite: skip``) drops the step's gradients, and the caller skips the step."""
    if trainer.runtime.all_true(bool(torch.isfinite(out.loss.detach()))):
        return True
    trainer.runtime.zero_grad(trainer.step, trainer.optimizer)
    handle_nonfinite(trainer, step, f"the loss is {float(out.loss.detach())}")
    return False


def handle_nonfinite(trainer: Trainer, step: int, what: str) -> None:
    """Raise unless the recipe says skip — and always for per-sample-state losses, whose state the
    non-finite batch has already corrupted."""
    skip = trainer.settings.nonfinite == "skip"
    stateful = optional_member(trainer.loss, "stateful")
    if skip and not stateful:
        return
    reason = (
        f"{type(trainer.loss).__name__} updated its per-sample state from this batch"
        if stateful and skip
        else "train.nonfinite=skip skips such steps instead"
    )
    raise ClipkitError(
        f"step {step + 1}: {what}; stopping ({reason}; lower the learning rate or use fp32/bf16)"
    )
