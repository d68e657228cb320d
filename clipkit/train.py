"""The one training loop. Papers differ in plugins and YAML, never here.

Read :func:`train_loop` top to bottom: encode this process's batch under autocast, gather
the point sets into the global batch in fp32, compare them with the similarity, hand the
loss exactly the context it declared, step. Everything distributed or precision-related
is delegated to :mod:`clipkit.runtime`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clipkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from clipkit.data import BatchStream
from clipkit.errors import ClipkitError
from clipkit.model import batched_input_size, build_model, build_slot, build_transform
from clipkit.recipe import save_recipe, section
from clipkit.registry import Registry
from clipkit.runtime import Runtime, rng_state, set_rng_state
from clipkit.shard import ensure_shards, read_manifest
from clipkit.transforms import ResizedUInt8
from clipkit.types import Logits, LossContext


@dataclass(frozen=True)
class RunInfo:
    """What ``on_metrics`` loggers get to know about the run."""

    directory: Path
    recipe: str
    is_main: bool


@dataclass
class Trainer:
    """Everything the loop touches, built from a validated recipe."""

    recipe: dict
    registry: Registry
    runtime: Runtime
    model: Any
    loss: Any
    optimizer: Any
    schedule: Any
    stream: BatchStream
    run: RunInfo
    start_step: int = 0
    augment: Any = None  # BatchedDeviceAugment under data.augment: batched


def default_shard_dir(source: str) -> Path:
    """Where shards made from ``source`` go when the recipe names no directory: ./data/<slug>."""
    import hashlib
    import os

    slug = hashlib.sha1(source.encode()).hexdigest()[:12]
    return Path(os.environ.get("CLIPKIT_DATA_DIR", "data")) / f"shards-{slug}"


def build_trainer(recipe: dict, run_dir: Path, registry: Registry, *, resume: bool = False) -> Trainer:
    data, train = section(recipe, "data"), section(recipe, "train")
    runtime = Runtime(precision=train.precision, seed=int(recipe.get("seed", 0)))
    shards = ensure_shards(data.shards or str(default_shard_dir(data.source)), data.source, pm=registry.pm)
    num_samples = int(read_manifest(shards)["n"])

    model = build_model(recipe, registry)
    loss = build_slot(
        registry, "loss", recipe["loss"], "loss", num_samples=num_samples, total_steps=train.steps
    )
    optimizer = build_slot(
        registry, "optimizer", recipe["optimizer"], "optimizer", list(model.named_parameters())
    )
    schedule = build_slot(
        registry, "schedule", recipe["schedule"], "schedule", optimizer=optimizer, total_steps=train.steps
    )
    two_view, batched = model.pair == "two_view", data.augment == "batched"
    transform = ResizedUInt8(batched_input_size(recipe)) if batched else build_transform(recipe, train=True)
    stream = BatchStream(
        shards,
        batch_size=data.batch_size,
        transform=transform,
        tokenizer=model.tokenizer,
        seed=int(recipe.get("seed", 0)),
        num_workers=data.num_workers,
        shuffle_buffer=data.shuffle_buffer,
        resampled=data.resampled,
        views=2 if two_view and not batched else 1,  # batched: both views are made on the device
        meta_keys=dict(data.meta_keys),
    )
    run = RunInfo(Path(run_dir), recipe.get("name", "?"), runtime.is_main)
    trainer = Trainer(recipe, registry, runtime, model, loss, optimizer, schedule, stream, run)
    if batched:
        trainer.augment = BatchedDeviceAugment(build_transform(recipe, train=True), runtime, two_view)
    if resume:
        restore(trainer)
    if isinstance(loss, torch.nn.Module):
        loss.to(runtime.device)
    trainer.model, trainer.optimizer = runtime.prepare(model, optimizer, None)[:2]
    return trainer


class BatchedDeviceAugment:
    """``data.augment: batched``: the loader's uint8 images [B, 3, S0, S0] become normalised
    random-resized crops [B, 3, S, S] in one tensor op on the training device (and, for two-view
    recipes, a second independent view ``image2``). Crop boxes come from a CPU generator seeded by
    (seed, step, rank), so a resumed run draws the same boxes and ranks draw different ones."""

    def __init__(self, transform, runtime: Runtime, two_view: bool) -> None:
        from clipkit.batched_augment import BatchedAugment

        self.augment = BatchedAugment.from_image_transform(transform).to(runtime.device)
        self.runtime, self.two_view = runtime, two_view

    def __call__(self, batch: dict, step: int) -> dict:
        generator = torch.Generator()
        rank = self.runtime.accelerator.process_index
        generator.manual_seed((self.runtime.seed * 1_000_003 + step) * 1_009 + rank)
        raw = batch["image"]
        batch = {**batch, "image": self.augment(raw, generator)}
        if self.two_view:
            batch["image2"] = self.augment(raw, generator)
        return batch


def restore(trainer: Trainer) -> None:
    """Load the newest checkpoint of the run into every stateful piece."""
    path = latest_checkpoint(trainer.run.directory)
    if path is None:
        raise ClipkitError(f"{trainer.run.directory}: nothing to resume (no checkpoints/step-*.pt)")
    state = load_checkpoint(path)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.schedule.load_state_dict(state["schedule"])
    if state.get("loss") is not None:
        trainer.loss.load_state_dict(state["loss"])
    trainer.stream.restore(state["data"])
    set_rng_state(state["rng"])
    trainer.start_step = int(state["step"])


def checkpoint(trainer: Trainer, step: int) -> Path | None:
    if not trainer.runtime.is_main:
        return None
    train = section(trainer.recipe, "train")
    state = {
        "model": trainer.runtime.unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "schedule": trainer.schedule.state_dict(),
        "loss": trainer.loss.state_dict() if isinstance(trainer.loss, torch.nn.Module) else None,
        "data": trainer.stream.position(),
        "rng": rng_state(),
        "recipe": trainer.recipe,
    }
    return save_checkpoint(trainer.run.directory, step, state, keep=train.keep_checkpoints)


def loss_context(
    requires: frozenset[str], batch: dict, a, b, similarity, step: int, epoch: float
) -> LossContext:
    """Build only the fields the loss declared (in-modal similarities cost two more N×N products)."""
    fields: dict[str, Any] = {}
    if "index" in requires:
        fields["index"] = batch["index"]
    if "meta" in requires:
        fields["meta"] = batch["meta"]
    if "in_modal" in requires:
        fields["in_modal"] = Logits(i2t=similarity(a, a).i2t, t2i=similarity(b, b).i2t)
    if "features" in requires:
        fields["features"] = (a, b)
    if "step" in requires:
        fields["step"] = step
    if "epoch" in requires:
        fields["epoch"] = epoch
    return LossContext(**fields)


def train_loop(trainer: Trainer, *, progress=None) -> dict[str, float]:
    """Run from ``trainer.start_step`` to ``train.steps``; returns the last logged metrics.

    ``progress(done, total, metrics)`` is called after every step (the CLI's progress bar).
    """
    rt, model, loss_fn, optimizer = trainer.runtime, trainer.model, trainer.loss, trainer.optimizer
    train = section(trainer.recipe, "train")
    similarity = rt.unwrap(model).similarity
    requires = frozenset(getattr(loss_fn, "requires", frozenset()))
    batches = iter(trainer.stream)
    last: dict[str, float] = {}
    tick, samples = time.perf_counter(), 0
    model.train()
    for step in range(trainer.start_step, train.steps):
        batch = rt.to_device(next(batches))
        if trainer.augment is not None:
            batch = trainer.augment(batch, step)
        with rt.autocast():  # only the towers run in reduced precision
            local_a, local_b = model(batch)
        a, b = rt.gather(local_a), rt.gather(local_b)  # global batch, fp32
        logits = similarity(a, b, generator=rt.generator(step))
        epoch = (
            trainer.stream.epoch + trainer.stream.batch_in_epoch * a.batch_size / trainer.stream.num_samples
        )
        ctx = loss_context(requires, batch, a, b, similarity, step, epoch)
        out = loss_fn(logits, rt.targets(a), ctx)
        if not torch.isfinite(out.loss):
            raise ClipkitError(
                f"step {step + 1}: the loss is {float(out.loss)}; stopping (last good: {last})"
            )

        optimizer.zero_grad(set_to_none=True)
        rt.backward(out.loss)
        grad_norm = rt.clip_grad_norm(model, train.grad_clip) if train.grad_clip > 0 else None
        optimizer.step()
        trainer.schedule.step()

        samples += a.batch_size
        done = step + 1
        if done % train.log_every == 0 or done == train.steps:
            elapsed, tick = time.perf_counter() - tick, time.perf_counter()
            last = step_metrics(out, optimizer, similarity, grad_norm, epoch, samples / max(elapsed, 1e-9))
            samples = 0
            trainer.registry.pm.hook.on_metrics(step=done, metrics=last, run=trainer.run)
        if train.eval_every and done % train.eval_every == 0 and done < train.steps:
            evaluate_during_training(trainer, done)
        if done % train.checkpoint_every == 0 or done == train.steps:
            checkpoint(trainer, done)
        if progress is not None:
            progress(done, train.steps, last)
    return last


def evaluate_during_training(trainer: Trainer, step: int) -> list[dict]:
    """Run the recipe's eval tasks on the in-memory model — the code ``clipkit eval`` runs on an
    export — and log their float metrics as ``eval/<task>/<metric>`` at ``step``.

    Evaluation must not change training: the RNG states are restored afterwards (so a run with
    evaluation takes the same steps as one without), and the model goes back to train mode.
    """
    from clipkit.evaluate import run_evals
    from clipkit.report import metric_rows, task_label

    tasks = trainer.recipe.get("eval") or []
    if not tasks or not trainer.runtime.is_main:
        return []
    saved = rng_state()
    model = trainer.runtime.unwrap(trainer.model)
    try:
        results = run_evals(model, tasks, trainer.registry)
    finally:
        model.train()
        set_rng_state(saved)
    metrics = {
        f"eval/{task_label(result)}/{key}": result[key]
        for result in results
        for key, _ in metric_rows(result)
    }
    trainer.registry.pm.hook.on_metrics(step=step, metrics=metrics, run=trainer.run)
    return results


def step_metrics(
    out, optimizer, similarity, grad_norm, epoch: float, samples_per_s: float
) -> dict[str, float]:
    metrics = {"loss": float(out.loss.detach()), "lr": optimizer.param_groups[0]["lr"], "epoch": epoch}
    metrics.update({k: float(v) for k, v in out.metrics.items()})
    if hasattr(similarity, "metrics"):
        metrics.update(similarity.metrics())
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm
    metrics["samples_per_s"] = samples_per_s
    return {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}


def prepare_run_dir(recipe: dict, run_dir: Path, *, resume: bool) -> None:
    """Create the run directory and save the resolved recipe (refuses to overwrite a run)."""
    run_dir = Path(run_dir)
    if not resume and latest_checkpoint(run_dir) is not None:
        raise ClipkitError(
            f"{run_dir} already holds a run; pass --resume to continue it or pick another --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, run_dir / "recipe.yaml")
