"""Distillation in the training step (``train.distill``; docs/distillation.md).

The objective's loss becomes ``contrastive + Σ_k weight_k · distill_k(student, teacher)``, each
``distill_k`` a registered distillation loss (``register_distill_losses``) over the student's and the
teacher's :class:`~clipkit.contract.types.DistillView` of the same anchors. The teacher's embeddings
of this process's batch come from

* a live teacher (``train.distill.teacher``): a frozen :class:`~clipkit.model.teacher.Teacher` run
  under ``no_grad`` inside the step, on the same (augmented) batch the student sees. It is a plain
  attribute, not a sub-module of the wrapped step: DDP and DeepSpeed never see its parameters, and
  every process holds it whole (ZeRO-3 and FSDP2 are refused for it at validation);
* stored embeddings (``train.distill.stored``): ``batch["teacher_image"]`` / ``batch["teacher_text"]``
  [B, d], which the loader reads from shards ``clipkit shard --teacher`` wrote (the teacher is never
  loaded; its logit scale and bias come from the shards' manifest).

Either way they are gathered like the student's features (without gradient), and the teacher's
logits are ``scale · image @ text.T + bias`` over the same rows and columns as the student's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from clipkit.config.recipe import distill_config, section
from clipkit.contract.types import DistillLoss, DistillView, Logits, LossOutput, PointSet, optional_member
from clipkit.data.teacher_shards import StoredTeacher, stored_teacher
from clipkit.errors import ClipkitError
from clipkit.model import build_slot
from clipkit.model.teacher import Teacher, teacher_logits
from clipkit.train.runtime import Runtime


@dataclass(frozen=True)
class WeightedLoss:
    """One entry of ``train.distill.losses``: its name, weight and built loss."""

    name: str
    weight: float
    loss: DistillLoss


@dataclass
class Distillation:
    """The teacher's terms of the objective.

    losses:      the weighted distillation losses, in recipe order.
    scale, bias: the teacher's logit scale and bias.
    teacher:     the live teacher, or None when the embeddings are stored in the batch.
    student_transform: the student's preprocessing (a live teacher's input is derived from it).
    shares_tokens: the student's token ids are the teacher's (else ``batch["teacher_tokens"]``).
    """

    losses: tuple[WeightedLoss, ...]
    scale: float
    bias: float
    teacher: Teacher | None = None
    student_transform: Any = None
    shares_tokens: bool = True

    def local_embeddings(self, batch: dict) -> tuple[Tensor, Tensor]:
        """This process's teacher embeddings (image [n, d], text [n, d]), fp32, without gradient."""
        if self.teacher is None:
            return batch["teacher_image"].float(), batch["teacher_text"].float()
        images = self.teacher.images_from(batch["image"], self.student_transform)
        if not self.shares_tokens and "teacher_tokens" not in batch:
            raise ClipkitError(
                f"train.distill.teacher: {self.teacher.where} tokenizes differently from the student, and "
                "this batch carries no teacher_tokens (shards give them; a data.stream does not): use a "
                "teacher with the student's model.tokenizer, or stored embeddings"
            )
        tokens = batch["text"] if self.shares_tokens else batch["teacher_tokens"]
        return self.teacher.embed(images, tokens)

    def add(
        self,
        out: LossOutput,
        student_logits: Logits,
        student_image: PointSet,
        student_text: PointSet,
        batch: dict,
        runtime: Runtime,
        *,
        local: bool,
    ) -> LossOutput:
        """``out`` (the contrastive loss) plus the weighted distillation terms, with their metrics.

        student_logits: the logits the contrastive loss scored — over the global batch, or this
        process's anchors against the global candidates when ``local``; student_image / student_text:
        the anchors' point sets (global [N, 1, d], or local [n, 1, d] when ``local``).
        """
        image, text = self.local_embeddings(batch)
        all_image, all_text = runtime.gather_rows(image), runtime.gather_rows(text)  # [N, d]
        rows_image, rows_text = (image, text) if local else (all_image, all_text)
        teacher = DistillView(
            Logits(
                i2t=teacher_logits(rows_image, all_text, self.scale, self.bias),
                t2i=teacher_logits(rows_text, all_image, self.scale, self.bias),
            ),
            rows_image,
            rows_text,
        )
        student = DistillView(student_logits, vector(student_image), vector(student_text))
        total, metrics = out.loss, {**out.metrics, "contrastive": out.loss.detach()}
        for entry in self.losses:
            term = entry.loss(student, teacher)
            total = total + entry.weight * term.loss
            metrics[f"distill/{entry.name}"] = term.loss.detach()
            metrics.update({f"distill/{entry.name}/{key}": value for key, value in term.metrics.items()})
        return LossOutput(total, metrics)


def vector(points: PointSet) -> Tensor:
    """A student's one-point-per-input PointSet [N, 1, d] -> [N, d]."""
    if points.num_points != 1:
        raise ClipkitError(
            f"train.distill: the student gives {points.num_points} points per input; distillation compares "
            "one vector per input (M = 1)"
        )
    return points.points[:, 0]


def build_distillation(
    recipe: dict, registry, runtime: Runtime, student_transform, shards: str | None
) -> Distillation | None:
    """The recipe's :class:`Distillation` (None without ``train.distill``): the losses built and
    checked against the teacher's width, and the live teacher loaded (or the stored one's manifest
    read from ``shards``)."""
    config = distill_config(recipe)
    if config is None:
        return None
    names = [entry["name"] for entry in config.losses]
    losses = tuple(
        WeightedLoss(
            name if names.count(name) == 1 else f"{name}.{i}",  # two entries of one loss log apart
            float(entry.get("weight", 1.0)),
            build_slot(registry, "distill_loss", without_weight(entry), f"train.distill.losses.{i}"),
        )
        for i, (name, entry) in enumerate(zip(names, config.losses, strict=True))
    )
    student_dim = section(recipe, "model").embed_dim
    if config.stored:
        stored = read_stored_teacher(recipe, shards)
        check_widths(losses, stored.dim, student_dim, f"{shards} (stored teacher)")
        return Distillation(losses, stored.scale, stored.bias)
    check_teacher(recipe, registry)
    teacher = Teacher.load(config.teacher, registry, runtime.device)
    check_widths(losses, teacher.dim, student_dim, config.teacher)
    shares = teacher.shares_tokens(section(recipe, "model").tokenizer)
    if runtime.is_main:
        how = "the student's token ids" if shares else "its own tokenizer"
        print(
            f"distill: teacher {config.teacher} (width {teacher.dim}, scale {teacher.scale:.4g}; "
            f"{how}), frozen, run in every step",
            file=sys.stderr,
        )
    return Distillation(losses, teacher.scale, teacher.bias, teacher, student_transform, shares)


def check_teacher(recipe: dict, registry=None) -> None:
    """A live teacher's path holds something a model can be read from: asked by ``clipkit validate``
    and by ``clipkit train`` before its run directory is written
    (:func:`clipkit.train.build.check_data_location`), and again when the teacher is loaded. A
    file-system check, so not part of the recipe's validation: a recipe may name a teacher that a
    first run will export (quickstart@distill). ``registry``: whose ``read_model`` plugins may read
    more than the built-in layouts (then only a missing path or an empty folder is refused here)."""
    config = distill_config(recipe)
    if config is None or config.stored or not config.teacher:
        return  # stored embeddings, or no teacher at all (which validation refuses)
    problem = teacher_path_problem(Path(config.teacher), built_in_readers_only(registry))
    if problem is not None:
        raise ClipkitError(
            f"train.distill.teacher: {config.teacher} {problem}; a teacher path holds {TEACHERS}"
        )


#: What ``train.distill.teacher`` may name (what :func:`clipkit.artifacts.reader.load_model` reads).
TEACHERS = (
    "a clipkit export (clipkit.json + model.safetensors), an open_clip or Hugging Face CLIP directory, "
    "or an OpenAI-layout .safetensors state dict"
)


def teacher_path_problem(path: Path, built_in_only: bool) -> str | None:
    """Why no model can be read from ``path`` (``does not exist``, ``is an empty folder``, ...), or
    None. An empty folder or a stray file used to pass ``clipkit validate`` and fail only when the
    teacher was loaded, after the data was sharded and the student built. Beyond a missing path and an
    empty folder, the refusals hold for the built-in readers only (``built_in_only``): a plugin's
    ``read_model`` may read other files."""
    try:
        if not path.exists():
            return "does not exist"
        if path.is_dir():
            if not any(path.iterdir()):
                return "is an empty folder"
            export = path / "export"
            if (
                built_in_only
                and not (path / "clipkit.json").is_file()
                and (export / "clipkit.json").is_file()
            ):
                return f"is a run directory, not its export ({export})"
            return None
    except OSError:
        return None  # unreadable: the loader names what it cannot read
    if built_in_only and path.suffix != ".safetensors":
        return "is a file but not a .safetensors state dict"
    return None


def built_in_readers_only(registry) -> bool:
    """True when no plugin but clipkit's own implements ``read_model`` (the layouts clipkit knows);
    without a ``registry``, the process's own (:func:`clipkit.contract.registry.default_registry`)."""
    if registry is None:
        from clipkit.contract.registry import default_registry

        registry = default_registry()
    impls = registry.pm.hook.read_model.get_hookimpls()
    return all(impl.plugin_name.startswith("clipkit.") for impl in impls)


def read_stored_teacher(recipe: dict, shards: str | None) -> StoredTeacher:
    """The stored teacher of the shard directory ``shards`` (its manifest's ``info.teacher``, checked
    against the recipe's augmentation); a streamed set or mixture (``shards`` None) has no manifest."""
    if shards is None:
        raise ClipkitError(
            "train.distill.stored: stored embeddings are read from a clipkit shard directory's manifest "
            "(data.shards from `clipkit shard --teacher`), not a mixture, URL or folder of tars"
        )
    return stored_teacher(shards, section(recipe, "data"))


def check_stored_teacher(recipe: dict, shards: str | None) -> None:
    """Stored embeddings are in the shards the run reads: asked by ``clipkit validate`` and by
    ``clipkit train`` before it shards or writes anything (:func:`clipkit.train.build.check_data_location`),
    so plain shards (or views of another augmentation) are refused before the student is built. Only
    the manifest is read; a missing member of one sample is still the loader's to say."""
    config = distill_config(recipe)
    if config is not None and config.stored:
        read_stored_teacher(recipe, shards)


def without_weight(entry: dict) -> dict:
    """A ``train.distill.losses`` entry as its factory's slot (the host keeps ``weight``)."""
    return {key: value for key, value in entry.items() if key != "weight"}


def check_widths(losses: tuple[WeightedLoss, ...], teacher_dim: int, student_dim: int, where: str) -> None:
    """Feature losses compare embeddings one to one: refuse a teacher of another width."""
    comparing = [entry.name for entry in losses if optional_member(entry.loss, "compares_features")]
    if comparing and teacher_dim != student_dim:
        raise ClipkitError(
            f"train.distill.losses: {', '.join(comparing)} compare(s) embeddings one to one, but the "
            f"teacher {where} has width {teacher_dim} and the student model.embed_dim {student_dim}; "
            "use the kl loss (similarity distributions need no projection) or a student of the "
            "teacher's width"
        )


def teacher_tokenizer(distillation: Distillation | None):
    """The tokenizer the loader must run for the teacher (None when it shares the student's ids)."""
    if distillation is None or distillation.teacher is None or distillation.shares_tokens:
        return None
    return distillation.teacher.tokenizer
