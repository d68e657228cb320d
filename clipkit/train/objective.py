"""The contrastive objective of one step, after the towers: the gather into the global batch, the
similarity and the loss — built once per run (:func:`build_objective`), called once per step.

An :class:`Objective` needs no trainer: the loss, the similarity, the runtime's gathers and the
tiling decision are resolved when it is built; what changes per step (the step, the epoch, the
batch's indices and meta-data) is passed per call. So the loss pass of one batch runs from a model,
an objective and a batch alone::

    objective = build_objective(recipe, registry, model)      # one process, the recipe's loss
    step = TrainingStep(model, objective)                      # clipkit.train.step
    loss, out = step(batch, step=0, epoch=0.0)                 # towers -> gather -> similarity -> loss

:class:`clipkit.train.step.TrainingStep` calls the objective inside its forward; exact accumulation
(:mod:`clipkit.train.accumulate`) calls it on the cached features too.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clipkit.contract.built import check_logits, check_loss_output, plugin_label
from clipkit.contract.types import Logits, Loss, LossContext, LossOutput, PointSet, optional_member
from clipkit.errors import BatchRefusedError, ClipkitError
from clipkit.tiled.settings import Decision, Tiling, decide
from clipkit.train.bounds import Bound, bounded_parameters
from clipkit.train.distill import Distillation
from clipkit.train.runtime import Runtime


@dataclass
class Objective:
    """Point sets of this process -> the recipe's loss on the contrastive batch.

    loss:       the loss plugin (an ``nn.Module`` when it keeps per-sample state)
    similarity: the model's similarity module (it owns the comparison's parameters)
    runtime:    the gathers into the global batch, the per-step generator, the precision contexts
    tile_size:  rows and columns per tile when the loss runs tiled (``train.tiled``); None: the
                full N×N logits. Decided once, for the run's contrastive batch (:func:`decide`).
    bounds:     the similarity's and loss's bounded parameters (:mod:`clipkit.train.bounds`), which
                the loop clamps after every applied optimiser step (CLIP's logit scale ≤ 100).
    """

    loss: Loss
    similarity: nn.Module
    runtime: Runtime
    tile_size: int | None = None
    bounds: tuple[Bound, ...] = ()
    feature_dtype: torch.dtype = torch.float32  # train.similarity_precision: half -> the towers' dtype
    # train.compile_scope: step: score() compiled (clipkit.train.compile.compile_scoring); None: eager
    compiled_scoring: Callable[..., LossOutput] | None = None
    distill: Distillation | None = None  # train.distill: the teacher's terms (clipkit.train.distill)

    @property
    def requires(self) -> frozenset:
        """The LossContext fields the loss declared."""
        return frozenset(optional_member(self.loss, "requires") or ())

    def __call__(
        self, local_a: PointSet, local_b: PointSet, batch: dict, *, step: int, epoch: float
    ) -> LossOutput:
        """local_a, local_b [n, M, d]: this process's point sets; ``batch`` its input (indices and
        meta-data, gathered when the loss declares them); ``step`` seeds the similarity's randomness;
        ``epoch`` is the fractional epoch (losses with schedules read it).

        Global loss (default): every process scores the whole gathered batch. Local loss
        (``train.distributed.local_loss``): this process's anchors against all candidates; DDP's
        gradient averaging turns the mean of the local losses into the full-batch loss.

        A plugin's ValueError on the batch (the loss's kernel naming meta-data the batch lacks, say)
        is its refusal, as a factory's ValueError is of its arguments: one line naming the plugin
        (:func:`batch_refusal`), not a traceback from deep inside the step.
        """
        try:
            return self.score_batch(local_a, local_b, batch, step=step, epoch=epoch)
        except ClipkitError:
            raise
        except ValueError as error:
            raise batch_refusal(error, self.loss, self.similarity) from error

    def score_batch(
        self, local_a: PointSet, local_b: PointSet, batch: dict, *, step: int, epoch: float
    ) -> LossOutput:
        """What :meth:`__call__` returns, with the plugins' ValueErrors as they raised them."""
        rt = self.runtime
        if self.tile_size is not None:  # train.tiled: never materialise the N×N logits (fp32)
            a, b = rt.gather(local_a), rt.gather(local_b)  # global batch
            gathered = {} if rt.local_loss else self.global_fields(batch)
            ctx = self.context(gathered, a, b, step, epoch, in_modal=False)  # tiled losses score views
            return self.tiled(local_a, local_b, a, b, ctx, step)
        dtype = self.feature_dtype  # fp32, or the towers' half dtype (the similarity returns fp32 logits)
        a, b = rt.gather(local_a, dtype), rt.gather(local_b, dtype)  # global batch
        if rt.local_loss:  # this process's anchors: the diagonal shifted to its rows of the global batch
            local_a, local_b = local_a.cast(dtype), local_b.cast(dtype)
            n = local_a.batch_size
            targets, gathered = rt.targets(n, offset=rt.rank * n), {}
        else:
            targets, gathered = rt.targets(a.batch_size), self.global_fields(batch)
        if self.compiled_scoring is not None:  # train.compile_scope: step (clipkit.train.compile)
            return self.compiled_scoring(local_a, local_b, a, b, gathered, targets)

        def generator_for() -> torch.Generator:
            return rt.generator(step)  # a fresh, identically seeded generator per similarity call

        local = rt.local_loss
        if self.distill is None:
            return self.score(local_a, local_b, a, b, gathered, targets, local, step, epoch, generator_for)
        # train.distill: the teacher's terms beside the contrastive loss (eager; never compiled)
        logits, ctx = self.logits(local_a, local_b, a, b, gathered, local, step, epoch, generator_for)
        out = self.loss(logits, targets, ctx)
        student_a, student_b = (local_a, local_b) if local else (a, b)
        return self.distill.add(out, logits, student_a.float(), student_b.float(), batch, rt, local=local)

    def score(
        self,
        local_a: PointSet,
        local_b: PointSet,
        a: PointSet,
        b: PointSet,
        gathered: dict,
        targets: torch.Tensor,
        local: bool,
        step: int,
        epoch: float,
        generator_for: Callable[[], torch.Generator | None],
    ) -> LossOutput:
        """Similarity then loss on gathered point sets (a, b [N, M, d]; local_a, local_b [n, M, d]
        this process's, in the features' dtype where ``local``): the part of the step that
        ``train.compile_scope: step`` compiles. ``local``: this process's anchors against all
        candidates (``targets`` [n] their columns), else the whole batch (``targets`` [N]);
        ``gathered``: the global batch's declared index/meta."""
        logits, ctx = self.logits(local_a, local_b, a, b, gathered, local, step, epoch, generator_for)
        return check_loss_output(self.loss(logits, targets, ctx), plugin_label("loss", self.loss))

    def logits(
        self,
        local_a: PointSet,
        local_b: PointSet,
        a: PointSet,
        b: PointSet,
        gathered: dict,
        local: bool,
        step: int,
        epoch: float,
        generator_for: Callable[[], torch.Generator | None],
    ) -> tuple[Logits, LossContext]:
        """The fp32 logits the loss reads (i2t, t2i: [n, N] this process's rows where ``local``, else
        [N, N]) and the loss's context (arguments as :meth:`score`)."""
        similarity, who = self.similarity, plugin_label("similarity", self.similarity)

        def scored(x: PointSet, y: PointSet) -> Logits:  # a plugin's wrong output named, not deep in the loss
            return check_logits(similarity(x, y, generator=generator_for()), x.batch_size, y.batch_size, who)

        if local:
            image_rows = scored(local_a, b).i2t  # [n, N]
            text_rows = scored(a, local_b).t2i  # [n, N]
            return in_fp32(Logits(i2t=image_rows, t2i=text_rows)), self.context({}, a, b, step, epoch)
        logits = scored(a, b)
        return in_fp32(logits), self.context(gathered, a, b, step, epoch)  # the loss reduces in fp32

    def tiled(
        self, local_a: PointSet, local_b: PointSet, a: PointSet, b: PointSet, ctx: LossContext, step: int
    ) -> LossOutput:
        """The tiled branch: the full path's gather, targets and context, with the logits replaced by
        :class:`clipkit.tiled.TiledLogits` (local_a, local_b [n, M, d]; a, b [N, M, d])."""
        from clipkit.tiled.contract import tiled_global_loss, tiled_local_loss

        rt, loss, similarity = self.runtime, self.loss, self.similarity

        def generator_for():
            return rt.generator(step)  # a fresh, identically seeded generator per side (WPSE's features)

        tiles = {"tile_size": self.tile_size, "generator_for": generator_for}
        if rt.local_loss:
            offset = rt.rank * local_a.batch_size
            return tiled_local_loss(
                loss, similarity, local_a.float(), b, a, local_b.float(), offset, ctx, **tiles
            )
        return tiled_global_loss(loss, similarity, a, b, ctx, **tiles)

    def context(
        self, gathered: dict, a: PointSet, b: PointSet, step: int, epoch: float, *, in_modal: bool = True
    ) -> LossContext:
        """Only the fields the loss declared (in-modal similarities cost two more N×N products).

        ``gathered`` holds the global batch's ``index`` and ``meta`` (gathered over processes);
        ``in_modal=False`` leaves the N×N in-modal logits out (the tiled path scores them by tiles).
        """
        requires, similarity = self.requires, self.similarity
        fields: dict[str, Any] = {key: gathered[key] for key in ("index", "meta") if key in requires}
        if "in_modal" in requires and in_modal:
            fields["in_modal"] = in_fp32(Logits(i2t=similarity(a, a).i2t, t2i=similarity(b, b).i2t))
        if "features" in requires:
            fields["features"] = (a, b)
        if "step" in requires:
            fields["step"] = step
        if "epoch" in requires:
            fields["epoch"] = epoch
        return LossContext(**fields)

    def global_fields(self, batch: dict) -> dict:
        """The global batch's sample indices and meta-data, gathered only when the loss declared them."""
        rt, fields = self.runtime, {}
        if "index" in self.requires:
            fields["index"] = rt.gather_rows(batch["index"])
        if "meta" in self.requires:
            fields["meta"] = {key: rt.gather_list(list(values)) for key, values in batch["meta"].items()}
        return fields


def batch_refusal(error: ValueError, loss: Loss, similarity: nn.Module) -> BatchRefusedError:
    """``error``, raised while scoring a batch, as one line naming the plugin whose module raised it
    (the loss, else the similarity; both when neither module is on the traceback)."""
    raisers = {
        traceback_frame.f_code.co_filename for traceback_frame, _ in traceback.walk_tb(error.__traceback__)
    }
    named = [
        plugin_label(kind, plugin)
        for kind, plugin in (("loss", loss), ("similarity", similarity))
        if getattr(sys.modules.get(type(plugin).__module__), "__file__", None) in raisers
    ]
    who = named[0] if named else f"{plugin_label('similarity', similarity)} or {plugin_label('loss', loss)}"
    return BatchRefusedError(f"{who} refused the batch: {error}")


def in_fp32(logits: Logits) -> Logits:
    """Half-precision logits upcast to fp32 (fp32 and fp64 ones as they are): losses reduce in fp32
    at least, whatever the features."""
    return Logits(i2t=at_least_fp32(logits.i2t), t2i=at_least_fp32(logits.t2i))


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def feature_dtype(setting: str, precision: str, similarity: nn.Module) -> torch.dtype:
    """The dtype features enter the similarity in: fp32, or under ``train.similarity_precision: half``
    and bf16/fp16 towers their dtype — for a similarity that declares ``half_features``."""
    from clipkit.config.recipe import half_features_refusal
    from clipkit.errors import ClipkitError
    from clipkit.train.runtime import HALF

    if setting != "half" or precision not in HALF:
        return torch.float32
    why = half_features_refusal(similarity)  # validation asked the class; a factory may not name it
    if why:
        raise ClipkitError(f"train.similarity_precision: {why}")
    return HALF[precision]


def tiling_decision(loss: Loss, similarity: nn.Module, runtime: Runtime, tiling: Tiling) -> Decision:
    """The run's tiling decision (:func:`clipkit.tiled.settings.decide`) for its contrastive batch,
    from the built loss and similarity and the runtime's strategy (``tiled: true`` refuses what
    cannot be tiled)."""
    from clipkit.tiled.contract import refusal

    why_not = refusal(loss, similarity) or runtime.tiling_refusal
    return decide(tiling, runtime.plan.global_size, why_not)


def build_objective(
    recipe: dict,
    registry,
    model: nn.Module,
    runtime: Runtime | None = None,
    *,
    num_samples: int = 0,
    total_steps: int | None = None,
    distill: Distillation | None = None,
) -> Objective:
    """The recipe's loss over ``model.similarity`` — built, placed on the runtime's device, checked
    against the runtime (accumulation, local loss) and with the tiling decided.

    ``runtime``: the run's (default: one process, this recipe's batch and precision).
    ``num_samples``: samples per epoch (losses with per-sample state size their tables by it).
    ``distill``: the teacher's terms (``train.distill``; :func:`clipkit.train.distill.build_distillation`).
    """
    from clipkit.config.recipe import section
    from clipkit.model import build_slot
    from clipkit.tiled.settings import loss_factory_config, tiling_of

    settings = section(recipe, "train")
    if runtime is None:
        runtime = Runtime(
            precision=settings.precision,
            seed=int(recipe.get("seed", 0)),
            global_batch_size=section(recipe, "data").batch_size,
        )
    loss = build_slot(
        registry,
        "loss",
        loss_factory_config(recipe["loss"]),
        "loss",
        num_samples=num_samples,
        total_steps=settings.steps if total_steps is None else total_steps,
        batch_size=runtime.plan.global_size,  # the global batch (NUCLR's epoch-based ζ schedule)
    )
    check_loss_fits_runtime(loss, model.similarity, runtime)
    if isinstance(loss, torch.nn.Module):
        loss.to(runtime.device)
    decision = tiling_decision(loss, model.similarity, runtime, tiling_of(recipe))
    bounds = bounded_parameters(similarity=model.similarity, loss=loss)
    if bounds and runtime.parameter_clamp_refusal and runtime.is_main:
        names = ", ".join(bound.name for bound in bounds)
        print(f"note: {names}: {runtime.parameter_clamp_refusal}", file=sys.stderr)
    dtype = feature_dtype(settings.similarity_precision, runtime.precision, model.similarity)
    if distill is not None and decision.tile_size is not None:
        from clipkit.errors import ClipkitError

        raise ClipkitError(
            f"train.distill: the batch of {runtime.plan.global_size} would run tiled (train.tiled), but the "
            "distillation losses need the full logits; set train.tiled=false"
        )
    return Objective(loss, model.similarity, runtime, decision.tile_size, bounds, dtype, distill=distill)


def check_loss_fits_runtime(loss: Loss, similarity: nn.Module, runtime: Runtime) -> None:
    """Refuse combinations that would silently train something else than the recipe says."""
    from clipkit.errors import ClipkitError

    name = type(loss).__name__
    accumulating = runtime.plan.micro_batches > 1
    if accumulating and optional_member(loss, "stateful"):
        raise ClipkitError(
            f"train.micro_batch_size: exact gradient accumulation re-runs the encoders after the loss, but "
            f"{name} updates per-sample state from each batch "
            f"(METHODS §11: SogCLR/NUCLR forbid accumulation); "
            f"use micro_batch_size 0 and a batch that fits, or more processes"
        )
    refusal = runtime.exact_accumulation_refusal
    if accumulating and refusal:
        raise ClipkitError(f"train.micro_batch_size: {refusal}")
    if runtime.local_loss:
        if not optional_member(loss, "supports_local_loss"):
            raise ClipkitError(
                f"train.distributed.local_loss: {name} does not declare supports_local_loss (it needs the "
                f"whole batch, e.g. per-sample state or in-modal terms); set local_loss: false"
            )
        if not optional_member(similarity, "pairwise"):
            raise ClipkitError(
                f"train.distributed.local_loss: the similarity {type(similarity).__name__} is not pairwise "
                f"(its logits depend on the whole batch); set local_loss: false"
            )
    refuse_similarity = optional_member(loss, "similarity_refusal")
    why = refuse_similarity(similarity) if callable(refuse_similarity) else None
    if why:  # e.g. NUCLR's τ against the similarity's scale: another objective, silently
        raise ClipkitError(f"loss: {why}")
