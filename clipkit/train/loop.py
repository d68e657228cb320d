"""The one training loop. Papers differ in plugins and YAML, never here.

Read :func:`train_loop` top to bottom: encode this process's batch under autocast, gather
the point sets into the global batch in fp32, compare them with the similarity, hand the
loss exactly the context it declared, step. Everything distributed or precision-related
is delegated to :mod:`clipkit.train.runtime`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clipkit.data.loader import BatchStream
from clipkit.data.shard import ensure_shards, read_manifest
from clipkit.data.transforms import ResizedUInt8
from clipkit.errors import ClipkitError
from clipkit.model import batched_input_size, build_model, build_slot, build_transform
from clipkit.recipe import distributed_config, save_recipe, section
from clipkit.registry import Registry
from clipkit.train.checkpoint import (
    DEEPSPEED,
    latest_checkpoint,
    load_rng,
    load_state,
    save_checkpoint,
    save_rng,
)
from clipkit.train.runtime import Runtime, rng_state, set_rng_state
from clipkit.types import Logits, LossContext, LossOutput, PointSet


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
    skipped_steps: int = 0  # optimiser steps skipped (non-finite loss with nonfinite: skip, fp16 overflow)
    augment: Any = None  # BatchedDeviceAugment under data.augment: batched


def default_shard_dir(source: str) -> Path:
    """Where shards made from ``source`` go when the recipe names no directory: ./data/<slug>."""
    import hashlib
    import os

    slug = hashlib.sha1(source.encode()).hexdigest()[:12]
    return Path(os.environ.get("CLIPKIT_DATA_DIR", "data")) / f"shards-{slug}"


def build_trainer(recipe: dict, run_dir: Path, registry: Registry, *, resume: bool = False) -> Trainer:
    data, train = section(recipe, "data"), section(recipe, "train")
    runtime = Runtime(
        precision=train.precision,
        seed=int(recipe.get("seed", 0)),
        distributed=distributed_config(recipe),
        global_batch_size=data.batch_size,
        micro_batch_size=train.micro_batch_size,
        grad_clip=train.grad_clip,
    )
    shards = ensure_shards_once(runtime, data, registry)
    num_samples = int(read_manifest(shards)["n"])

    model = build_model(recipe, registry)
    if train.grad_checkpointing:
        enable_grad_checkpointing(model)
    loss = build_slot(
        registry, "loss", recipe["loss"], "loss", num_samples=num_samples, total_steps=train.steps
    )
    check_loss_fits_runtime(loss, model.similarity, runtime)
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
        batch_size=runtime.local_batch_size,
        transform=transform,
        tokenizer=model.tokenizer,
        seed=int(recipe.get("seed", 0)),
        num_workers=data.num_workers,
        shuffle_buffer=data.shuffle_buffer,
        resampled=data.resampled,
        views=2 if two_view and not batched else 1,  # batched: both views are made on the device
        meta_keys=dict(data.meta_keys),
        rank=runtime.rank,
        world_size=runtime.world_size,
    )
    run = RunInfo(Path(run_dir), recipe.get("name", "?"), runtime.is_main)
    if train.compile != "none":
        from clipkit.train.compile import compile_towers, compile_unavailable

        reason = compile_unavailable()
        if reason:
            raise ClipkitError(f"train.compile={train.compile}: {reason}; use train.compile=none")
        model = compile_towers(model, train.compile)
    trainer = Trainer(recipe, registry, runtime, model, loss, optimizer, schedule, stream, run)
    if batched:
        trainer.augment = BatchedDeviceAugment(build_transform(recipe, train=True), runtime, two_view)
    checkpoint_path = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint_path is None:
        raise ClipkitError(f"{run_dir}: nothing to resume (no complete checkpoints/step-*)")
    state = load_state(checkpoint_path) if checkpoint_path else None
    if state is not None and not runtime.uses_deepspeed:
        model.load_state_dict(state["model"])  # before DDP wraps it (every process loads the same)
        optimizer.load_state_dict(state["optimizer"])
    if isinstance(loss, torch.nn.Module):
        loss.to(runtime.device)
    trainer.model, trainer.optimizer = runtime.prepare(model, optimizer)
    if state is not None:
        restore(trainer, checkpoint_path, state)
    return trainer


def ensure_shards_once(runtime: Runtime, data, registry: Registry) -> str:
    """Shard the recipe's source on the main process only; the others wait and read the result."""
    target = data.shards or str(default_shard_dir(data.source))
    if runtime.is_main:
        target = ensure_shards(target, data.source, pm=registry.pm)
    runtime.wait()
    if not runtime.is_main:
        target = ensure_shards(target, data.source, pm=registry.pm)
    return target


def enable_grad_checkpointing(model) -> None:
    """``train.grad_checkpointing``: turn on every encoder module's ``grad_checkpointing`` switch."""
    switched = []
    for name in ("image_encoder", "text_encoder"):
        tower = getattr(model, name)
        if tower is None:
            continue
        modules = [m for m in tower.modules() if hasattr(m, "grad_checkpointing")]
        for module in modules:
            module.grad_checkpointing = True
        switched.append(bool(modules))
    if not any(switched):
        raise ClipkitError(
            "train.grad_checkpointing: neither encoder has a `grad_checkpointing` switch "
            "(encoder plugins expose one to support this)"
        )


def check_loss_fits_runtime(loss, similarity, runtime: Runtime) -> None:
    """Refuse combinations that would silently train something else than the recipe says."""
    requires = frozenset(getattr(loss, "requires", frozenset()))
    name = type(loss).__name__
    if runtime.micro_batches > 1 and "index" in requires:
        raise ClipkitError(
            f"train.micro_batch_size: exact gradient accumulation re-runs the encoders after the loss, but "
            f"{name} updates per-sample state from each batch "
            f"(METHODS §11: SogCLR/NUCLR forbid accumulation); "
            f"use micro_batch_size 0 and a batch that fits, or more processes"
        )
    if runtime.micro_batches > 1 and runtime.uses_deepspeed and runtime.config.zero_stage == 3:
        raise ClipkitError(
            "train.micro_batch_size: exact gradient accumulation is not supported under ZeRO-3 (its loss "
            "pass runs the similarity outside DeepSpeed's forward, where ZeRO-3 has partitioned its "
            "parameters); use zero_stage 2, DDP, or more processes"
        )
    if runtime.config.local_loss and runtime.world_size > 1:
        if not getattr(loss, "supports_local_loss", False):
            raise ClipkitError(
                f"train.distributed.local_loss: {name} does not declare supports_local_loss (it needs the "
                f"whole batch, e.g. per-sample state or in-modal terms); set local_loss: false"
            )
        if not getattr(similarity, "pairwise", True):
            raise ClipkitError(
                f"train.distributed.local_loss: the similarity {type(similarity).__name__} is not pairwise "
                f"(its logits depend on the whole batch); set local_loss: false"
            )


class BatchedDeviceAugment:
    """``data.augment: batched``: the loader's uint8 images [B, 3, S0, S0] become normalised
    random-resized crops [B, 3, S, S] in one tensor op on the training device (and, for two-view
    recipes, a second independent view ``image2``). Crop boxes come from a CPU generator seeded by
    (seed, step, rank), so a resumed run draws the same boxes and ranks draw different ones."""

    def __init__(self, transform, runtime: Runtime, two_view: bool) -> None:
        from clipkit.data.batched_augment import BatchedAugment

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


def restore(trainer: Trainer, path: Path, state: dict) -> None:
    """Load a checkpoint into every stateful piece (model/optimiser already loaded without DeepSpeed)."""
    rt = trainer.runtime
    saved_world = int(state.get("world_size", 1))
    if saved_world != rt.world_size:
        raise ClipkitError(
            f"{path}: the run used {saved_world} process(es), this launch has {rt.world_size}; resume with "
            f"{saved_world} (the data order and RNG streams depend on it)"
        )
    if rt.uses_deepspeed:
        rt.load_sharded(trainer.model, Path(path) / DEEPSPEED)
    trainer.schedule.load_state_dict(state["schedule"])
    if state.get("loss") is not None:
        trainer.loss.load_state_dict(state["loss"])
    rt.load_scaler_state(state.get("scaler"))
    trainer.stream.restore(state["data"])
    trainer.skipped_steps = int(state.get("skipped_steps", 0))
    set_rng_state(load_rng(path, rt.rank))
    trainer.start_step = int(state["step"])


def checkpoint(trainer: Trainer, step: int) -> Path:
    """Every process calls this (DeepSpeed partitions and RNG states are per process)."""
    rt = trainer.runtime
    train = section(trainer.recipe, "train")

    def write_shards(directory: Path) -> None:
        if rt.uses_deepspeed:
            rt.save_sharded(trainer.model, directory / DEEPSPEED)
        save_rng(directory, rt.rank, rng_state())

    def state() -> dict:
        plain = not rt.uses_deepspeed
        return {
            "model": rt.unwrap(trainer.model).state_dict() if plain else None,
            "optimizer": trainer.optimizer.state_dict() if plain else None,
            "schedule": trainer.schedule.state_dict(),
            "loss": trainer.loss.state_dict() if isinstance(trainer.loss, torch.nn.Module) else None,
            "scaler": rt.scaler_state(),
            "data": trainer.stream.position(),
            "skipped_steps": trainer.skipped_steps,
            "world_size": rt.world_size,
            "recipe": trainer.recipe,
        }

    return save_checkpoint(
        trainer.run.directory,
        step,
        is_main=rt.is_main,
        barrier=rt.wait,
        write_shards=write_shards,
        state=state,
        keep=train.keep_checkpoints,
    )


def loss_context(requires: frozenset[str], fields_source: dict, a, b, similarity, step: int, epoch: float):
    """Build only the fields the loss declared (in-modal similarities cost two more N×N products).

    ``fields_source`` holds the global batch's ``index`` and ``meta`` (gathered over processes).
    """
    fields: dict[str, Any] = {}
    if "index" in requires:
        fields["index"] = fields_source["index"]
    if "meta" in requires:
        fields["meta"] = fields_source["meta"]
    if "in_modal" in requires:
        fields["in_modal"] = Logits(i2t=similarity(a, a).i2t, t2i=similarity(b, b).i2t)
    if "features" in requires:
        fields["features"] = (a, b)
    if "step" in requires:
        fields["step"] = step
    if "epoch" in requires:
        fields["epoch"] = epoch
    return LossContext(**fields)


@dataclass
class StepOutcome:
    """One optimiser step: the loss output, whether the update was applied, the gradient norm."""

    out: LossOutput
    applied: bool
    grad_norm: float | None


def contrastive_loss(
    trainer: Trainer, local_a: PointSet, local_b: PointSet, batch: dict, step: int
) -> LossOutput:
    """This process's point sets -> the recipe's loss on the contrastive batch.

    Global loss (default): every process scores the whole gathered batch. Local loss
    (``train.distributed.local_loss``): this process's anchors against all candidates; DDP's
    gradient averaging turns the mean of the local losses into the full-batch loss.
    """
    rt, loss_fn = trainer.runtime, trainer.loss
    similarity = rt.unwrap(trainer.model).similarity
    a, b = rt.gather(local_a), rt.gather(local_b)  # global batch, fp32
    epoch = trainer.stream.epoch + trainer.stream.batch_in_epoch * a.batch_size / trainer.stream.num_samples
    requires = frozenset(getattr(loss_fn, "requires", frozenset()))
    if rt.config.local_loss and rt.world_size > 1:
        n = local_a.batch_size
        image_rows = similarity(local_a.float(), b, generator=rt.generator(step)).i2t  # [n, N]
        text_rows = similarity(a, local_b.float(), generator=rt.generator(step)).t2i  # [n, N]
        ctx = loss_context(requires, {}, a, b, similarity, step, epoch)
        return loss_fn(Logits(i2t=image_rows, t2i=text_rows), rt.targets(n, offset=rt.rank * n), ctx)
    logits = similarity(a, b, generator=rt.generator(step))
    ctx = loss_context(requires, global_fields(rt, requires, batch), a, b, similarity, step, epoch)
    return loss_fn(logits, rt.targets(a.batch_size), ctx)


def global_fields(rt: Runtime, requires: frozenset[str], batch: dict) -> dict:
    """The global batch's sample indices and meta-data, gathered only when the loss declared them."""
    fields: dict[str, Any] = {}
    if "index" in requires:
        fields["index"] = rt.gather_rows(batch["index"])
    if "meta" in requires:
        fields["meta"] = {key: rt.gather_list(list(values)) for key, values in batch["meta"].items()}
    return fields


def forward_loss(trainer: Trainer, batch: dict | None, compute) -> tuple[torch.Tensor, LossOutput]:
    """Run ``compute(a, b) -> LossOutput`` inside the model's forward, after the towers encode
    ``batch`` under autocast (``batch`` None: no encoding, a = b = None); ``compute`` runs in fp32.

    Returns (the loss tensor to back-propagate — the one the forward returned, which DeepSpeed
    ZeRO-3 has hooked — and the LossOutput for logging)."""
    rt, captured = trainer.runtime, {}

    def then(a, b):
        with rt.full_precision():
            captured["out"] = compute(a, b)
        return captured["out"].loss

    with rt.autocast():  # only the towers run in reduced precision
        loss = trainer.model(batch, then=then)
    return loss, captured["out"]


def train_step(trainer: Trainer, batch: dict, step: int) -> StepOutcome:
    """Forward, loss, backward and optimiser step for one contrastive batch."""
    rt, model = trainer.runtime, trainer.model
    if rt.micro_batches > 1:
        out, finite = accumulate_exactly(trainer, batch, step)
    else:
        loss, out = forward_loss(trainer, batch, lambda a, b: contrastive_loss(trainer, a, b, batch, step))
        finite = loss_is_finite(trainer, out, step)
        if finite:
            rt.backward(loss, model)
    if not finite:
        return StepOutcome(out, False, None)
    result = rt.step(model, trainer.optimizer)
    if not result.applied:
        trainer.skipped_steps += 1
        if rt.scaler is None and not rt.uses_deepspeed:  # loss scaling skips overflow steps by design
            handle_nonfinite(trainer, step, f"the gradient norm is {result.grad_norm}")
    return StepOutcome(out, result.applied, result.grad_norm)


def loss_is_finite(trainer: Trainer, out: LossOutput, step: int) -> bool:
    """All processes agree whether the loss is finite; a non-finite one stops the run or (``train.nonfinite:
    skip``) skips the step."""
    if trainer.runtime.all_true(bool(torch.isfinite(out.loss.detach()))):
        return True
    trainer.runtime.zero_grad(trainer.model, trainer.optimizer)
    trainer.skipped_steps += 1
    handle_nonfinite(trainer, step, f"the loss is {float(out.loss.detach())}")
    return False


def handle_nonfinite(trainer: Trainer, step: int, what: str) -> None:
    """Raise unless the recipe says skip — and always for per-sample-state losses, whose state the
    non-finite batch has already corrupted."""
    train = section(trainer.recipe, "train")
    stateful = "index" in frozenset(getattr(trainer.loss, "requires", frozenset()))
    if train.nonfinite == "skip" and not stateful:
        return
    reason = (
        f"{type(trainer.loss).__name__} updated its per-sample state from this batch"
        if stateful and train.nonfinite == "skip"
        else "train.nonfinite=skip skips such steps instead"
    )
    raise ClipkitError(
        f"step {step + 1}: {what}; stopping ({reason}; lower the learning rate or use fp32/bf16)"
    )


def accumulate_exactly(trainer: Trainer, batch: dict, step: int) -> tuple[LossOutput, bool]:
    """Exact gradient accumulation (open_clip's scheme, METHODS §11): the loss sees the whole
    contrastive batch however small the micro-batches are.

    1. encode every micro-batch without gradient and cache the features [n, M, d];
    2. compute the loss on the cached (gathered) batch and its gradient g w.r.t. the cached features;
    3. re-encode each micro-batch with gradient and back-propagate Σ features · g (its share of
       the full-batch gradient); the last one also back-propagates the loss recomputed on the
       detached cache, which gives the similarity's own parameters (logit scale) their gradient.
    Passes 1 and 3 run inside the model's forward (see :func:`forward_loss`); pass 2 needs no parameter.
    """
    rt, model = trainer.runtime, trainer.model
    micro = split_batch_rows(batch, rt.micro_batch_size)
    with torch.no_grad(), rt.autocast():
        parts = [model(piece) for piece in micro]
    cached_a = leaf_points(PointSet.cat([p[0] for p in parts]))
    cached_b = leaf_points(PointSet.cat([p[1] for p in parts]))
    # Outside the model's forward on purpose: only the cached features' gradient is wanted, and
    # DDP / DeepSpeed hooks must not see a backward that reduces nothing (ZeRO-3 is refused).
    with rt.full_precision():
        out = contrastive_loss(trainer, cached_a, cached_b, batch, step)
    if not loss_is_finite(trainer, out, step):
        return out, False
    leaves = point_tensors(cached_a) + point_tensors(cached_b)
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    rows = rt.micro_batch_size
    for k, piece in enumerate(micro):
        last = k == len(micro) - 1

        def surrogate(part_a, part_b, k=k, last=last):
            tensors = point_tensors(part_a.float()) + point_tensors(part_b.float())
            total = sum(
                (tensor * grad[k * rows : (k + 1) * rows]).sum()
                for tensor, grad in zip(tensors, grads, strict=True)
                if grad is not None
            )
            if last:
                detached_a, detached_b = cached_a.detach(), cached_b.detach()
                total = total + contrastive_loss(trainer, detached_a, detached_b, batch, step).loss
            return LossOutput(loss=total)

        with rt.no_sync(model, last):
            piece_loss, _ = forward_loss(trainer, piece, surrogate)
            rt.backward(piece_loss, model, last=last)
    return out, True


def split_batch_rows(batch: dict, rows: int) -> list[dict]:
    """A batch dict -> micro-batches of ``rows`` samples (tensors and per-sample lists are cut)."""
    size = batch["index"].shape[0]

    def cut(value, start):
        if isinstance(value, (torch.Tensor, list)):
            return value[start : start + rows]
        if isinstance(value, dict):
            return {key: cut(item, start) for key, item in value.items()}
        return value

    return [{key: cut(value, start) for key, value in batch.items()} for start in range(0, size, rows)]


def point_tensors(points: PointSet) -> list[torch.Tensor]:
    """The differentiable tensors of a point set: points, and weights when present."""
    return [points.points] + ([] if points.weights is None else [points.weights])


def leaf_points(points: PointSet) -> PointSet:
    """fp32 copies that are autograd leaves (the cache whose gradient step 2 computes)."""
    leaf = points.detach().float()
    for tensor in point_tensors(leaf):
        tensor.requires_grad_()
    return leaf


def train_loop(trainer: Trainer, *, progress=None) -> dict[str, float]:
    """Run from ``trainer.start_step`` to ``train.steps``; returns the last logged metrics.

    ``progress(done, total, metrics)`` is called after every step (the CLI's progress bar).
    """
    rt = trainer.runtime
    train = section(trainer.recipe, "train")
    similarity = rt.unwrap(trainer.model).similarity
    batches = iter(trainer.stream)
    last: dict[str, float] = {}
    tick, samples = time.perf_counter(), 0
    trainer.model.train()
    for step in range(trainer.start_step, train.steps):
        batch = rt.to_device(next(batches))
        if trainer.augment is not None:  # uint8 in, float out: cast again (DeepSpeed half precision)
            batch = rt.to_device(trainer.augment(batch, step))
        outcome = train_step(trainer, batch, step)
        trainer.schedule.step()

        samples += rt.local_batch_size * rt.world_size
        done = step + 1
        if done % train.log_every == 0 or done == train.steps:
            elapsed, tick = time.perf_counter() - tick, time.perf_counter()
            last = step_metrics(trainer, outcome, similarity, samples / max(elapsed, 1e-9))
            samples = 0
            if rt.is_main:
                trainer.registry.pm.hook.on_metrics(step=done, metrics=last, run=trainer.run)
        if train.eval_every and done % train.eval_every == 0 and done < train.steps:
            evaluate_during_training(trainer, done)
        if done % train.checkpoint_every == 0 or done == train.steps:
            checkpoint(trainer, done)
        if progress is not None and rt.is_main:
            progress(done, train.steps, last)
    return last


def evaluate_during_training(trainer: Trainer, step: int) -> list[dict]:
    """Run the recipe's eval tasks on the in-memory model — the code ``clipkit eval`` runs on an
    export — and log their float metrics as ``eval/<task>/<metric>`` at ``step``.

    Evaluation must not change training: the RNG states are restored afterwards (so a run with
    evaluation takes the same steps as one without), and the model goes back to train mode.
    """
    from clipkit.eval.evaluate import run_evals
    from clipkit.eval.report import metric_rows, task_label

    tasks = trainer.recipe.get("eval") or []
    if not tasks:
        return []
    model = model_for_evaluation(trainer)  # every process: ZeRO shards are gathered
    if not trainer.runtime.is_main:
        return []
    saved = rng_state()
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


def model_for_evaluation(trainer: Trainer):
    """The in-memory model on the main process (None elsewhere). Under DeepSpeed: a fresh fp32 copy
    built from the recipe with the gathered full weights, since the engine's parameters may be
    partitioned (ZeRO-3) or half precision."""
    rt = trainer.runtime
    if not rt.uses_deepspeed:
        return rt.unwrap(trainer.model) if rt.is_main else None
    state = rt.full_state_dict(trainer.model)
    if not rt.is_main:
        return None
    model = build_model(trainer.recipe, trainer.registry)
    model.load_state_dict(state)
    return model.to(rt.device)


def step_metrics(
    trainer: Trainer, outcome: StepOutcome, similarity, samples_per_s: float
) -> dict[str, float]:
    """The logged numbers of a step (every process computes them: reading a ZeRO-3 similarity's
    parameters gathers them)."""
    rt, stream, out = trainer.runtime, trainer.stream, outcome.out
    global_batch = rt.local_batch_size * rt.world_size
    epoch = stream.epoch + stream.batch_in_epoch * global_batch / stream.num_samples
    lr = trainer.optimizer.param_groups[0]["lr"]
    metrics = {"loss": float(out.loss.detach()), "lr": lr, "epoch": epoch}
    metrics.update({k: float(v) for k, v in out.metrics.items()})
    if hasattr(similarity, "metrics"):
        with rt.gathered(similarity):
            metrics.update(similarity.metrics())
    if outcome.grad_norm is not None:
        metrics["grad_norm"] = outcome.grad_norm
    metrics["skipped_steps"] = trainer.skipped_steps
    metrics["samples_per_s"] = samples_per_s
    if rt.device.type == "cuda":  # this process's peak, for memory budgets (docs/benchmarks.md)
        metrics["gpu_peak_gib"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
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
