"""Build everything the training loop touches from a validated recipe (:func:`build_trainer`).

The recipe's sections are read once here (``Trainer.settings`` is the ``train`` section) and the
batch is split once by the runtime (``runtime.plan``). The order of :func:`build_trainer` matters;
each stage says why it comes where it does (docs/architecture.md walks through it). Resuming is three
calls, in this order: :func:`~clipkit.train.checkpoint.open_checkpoint` (verify, check the process
count), :meth:`Runtime.prepare` (the runtime's state around wrapping) and
:func:`~clipkit.train.checkpoint.restore_trainer` (everything else).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from clipkit.app.own_data import recipe_holdout
from clipkit.config.machine import apply as apply_machine_fit
from clipkit.config.machine import fit_to_machine, launch_warning
from clipkit.config.recipe import DataConfig, distributed_config, ema_config, save_recipe, section
from clipkit.contract.registry import Registry
from clipkit.data.loader import BatchStream, ReadPolicy, training_split
from clipkit.data.remote import Patience
from clipkit.data.shard_writer import check_shards, ensure_shards
from clipkit.data.teacher_shards import DistillInputs
from clipkit.data.transforms import ResizedUInt8
from clipkit.errors import ClipkitError, DataError
from clipkit.model import ContrastiveModel, batched_input_size, build_model, build_slot, build_transform
from clipkit.model.init_weights import prepare_model
from clipkit.model.lora import add_adapters
from clipkit.train.checkpoint import latest_checkpoint, open_checkpoint, restore_trainer
from clipkit.train.distill import (
    Distillation,
    build_distillation,
    check_stored_teacher,
    check_teacher,
    teacher_tokenizer,
)
from clipkit.train.ema import build_ema
from clipkit.train.memory_fit import check_memory
from clipkit.train.objective import build_objective
from clipkit.train.runtime import Runtime
from clipkit.train.step import TrainingStep
from clipkit.train.trainer import RunInfo, Trainer, TrainingStream

__all__ = ["RunInfo", "Trainer", "TrainingStream", "build_trainer", "prepare_run_dir"]


def default_shard_dir(source: str) -> Path:
    """Where shards made from ``source`` go when the recipe names no directory: ./data/<slug>."""
    slug = hashlib.sha1(source.encode()).hexdigest()[:12]
    return Path(os.environ.get("CLIPKIT_DATA_DIR", "data")) / f"shards-{slug}"


def build_trainer(recipe: dict, run_dir: Path, registry: Registry, *, resume: bool = False) -> Trainer:
    """The recipe's run, built in the order its pieces depend on each other (validated recipe in)."""
    data, settings = section(recipe, "data"), section(recipe, "train")
    # 1. The runtime first: it starts the processes, picks the device and splits data.batch_size
    #    into the batch plan every later stage reads (the world size comes from the launcher).
    runtime = Runtime(
        precision=settings.precision,
        seed=int(recipe.get("seed", 0)),
        distributed=distributed_config(recipe),
        global_batch_size=data.batch_size,
        micro_batch_size=settings.micro_batch_size,
        grad_clip=settings.grad_clip,
    )
    if settings.compile != "none" and runtime.compile_refusal:  # before anything is built
        raise ClipkitError(f"train.compile={settings.compile}: {runtime.compile_refusal}")
    # 2. The model, with its initial weights (model.init), locked towers (model.frozen) and LoRA
    #    adapters (model.lora).
    model = build_model(recipe, registry, adapters=False)
    prepare_model(model, recipe, registry, resume=resume)
    add_adapters(model, recipe, announce=runtime.is_main)  # model.lora: over the initial weights
    if settings.grad_checkpointing:
        enable_grad_checkpointing(model)
    # 3. Before the data, optimiser and runtime take memory: refuse a run the machine cannot hold.
    workers = fit_to_machine(data.num_workers, settings.threads, accelerator=runtime.device.type != "cpu")
    check_memory(recipe, model, runtime, workers=workers.workers if data.stream is None else 0,
                 announce=runtime.is_main, registry=registry)  # fmt: skip
    # 4. The data before the loss: data.fit_batch may lower the batch to what the training split
    #    holds (runtime.refit_batch, before prepare: DeepSpeed's configuration carries the split),
    #    and per-sample-state losses size their tables by the stream's sample count.
    distill = build_distillation(recipe, registry, runtime, model.transform, distill_shards(recipe))
    stream = build_stream(recipe, runtime, registry, model, distill)
    # 5. The objective: the loss over the model's similarity, checked against the runtime, and
    #    whether it runs tiled (train.tiled), decided once for the run's contrastive batch; with
    #    train.distill, the frozen teacher's terms beside it (loaded before the data, which may
    #    need the teacher's tokenizer).
    objective = build_objective(
        recipe, registry, model, runtime, num_samples=stream.num_samples, distill=distill
    )
    # 6. Optimiser and schedule over the model's parameters (before wrapping: names are the model's).
    optimizer = build_slot(
        registry, "optimizer", recipe["optimizer"], "optimizer", list(model.named_parameters())
    )
    schedule = build_slot(
        registry, "schedule", recipe["schedule"], "schedule", optimizer=optimizer, total_steps=settings.steps
    )
    # The weight EMA (train.ema) over the same trainable parameters, in fp32.
    ema = build_ema(model, ema_config(recipe), announce=runtime.is_main)
    if settings.compile != "none":
        model = compile_model(model, settings.compile, settings.compile_unit)
        if settings.compile_scope == "step":  # the similarity + loss too, where they trace whole
            compile_objective(objective, settings.compile, announce=runtime.is_main)
    # 7. Wrap the step (DDP / DeepSpeed), loading a checkpoint's weights and optimiser around it.
    checkpoint = open_checkpoint(run_dir, runtime.world_size) if resume else None
    resumed = {"checkpoint": checkpoint.path, "state": checkpoint.state} if checkpoint else {}
    prepared_step, prepared_optimizer = runtime.prepare(TrainingStep(model, objective), optimizer, **resumed)
    trainer = Trainer(
        recipe=recipe,
        settings=settings,
        registry=registry,
        runtime=runtime,
        model=model,
        step=prepared_step,
        objective=objective,
        optimizer=prepared_optimizer,
        schedule=schedule,
        stream=stream,
        run=RunInfo(Path(run_dir), recipe.get("name", "?"), runtime.is_main),
        ema=ema,
    )
    if data.augment == "batched":  # crops on the training device, seeded per (step, rank)
        two_view = model.pair == "two_view"
        trainer.augment = BatchedDeviceAugment(build_transform(recipe, train=True), runtime, two_view)
    # 8. Everything else a checkpoint holds: schedule, loss state, EMA, data position, RNGs, the step.
    if checkpoint is not None:
        restore_trainer(trainer, checkpoint)
    return trainer


def build_stream(
    recipe: dict,
    runtime: Runtime,
    registry: Registry,
    model: ContrastiveModel,
    distill: Distillation | None = None,
) -> TrainingStream:
    """This process's batches: a registered stream (``data.stream``) or the recipe's shards (made
    from ``data.source`` first when missing); with ``distill``, the teacher's inputs or stored
    embeddings in each batch."""
    data, settings = section(recipe, "data"), section(recipe, "train")
    place = {"seed": int(recipe.get("seed", 0)), "rank": runtime.rank, "world_size": runtime.world_size}
    # auto: from the CPUs this process may use, most of them decoding when a GPU trains
    machine = fit_to_machine(
        data.num_workers,
        settings.threads,
        accelerator=runtime.device.type != "cpu",
        processes=runtime.world_size,
    )
    apply_machine_fit(machine, announce=runtime.is_main)
    warning = launch_warning(runtime.world_size)
    if warning and runtime.is_main:
        print(warning, file=sys.stderr)
    if data.stream is not None:
        batch_size = runtime.plan.local_size
        return build_slot(registry, "stream", data.stream, "data.stream", batch_size=batch_size, **place)
    streamed = is_streamed_data(data)  # read where it lives: nothing is written locally
    shards = shard_target(data) if streamed else ensure_shards_once(runtime, data, registry)
    split = None if streamed else training_split(shards, recipe_holdout(data))
    if split is not None and data.holdout > 0:
        check_held_out(split, data.holdout, shards, announce=runtime.is_main)
    if split is not None and data.fit_batch:
        fit_batch_to_data(runtime, split.num_samples, shards)
    two_view, batched = model.pair == "two_view", data.augment == "batched"
    transform = build_transform(recipe, train=True)
    transform = ResizedUInt8(batched_input_size(recipe), transform.background) if batched else transform
    return BatchStream(
        shards,
        batch_size=runtime.plan.local_size,
        transform=transform,
        tokenizer=model.tokenizer,
        num_workers=machine.workers,
        shuffle_buffer=data.shuffle_buffer,
        resampled=data.resampled,
        views=2 if two_view and not batched else 1,  # batched: both views are made on the device
        meta_keys=dict(data.meta_keys),
        holdout=recipe_holdout(data),  # train --data: the held-out split is evaluated, never trained on
        split=split,
        mixture=data.mixture,
        num_samples=data.num_samples,
        policy=ReadPolicy(Patience(timeout=data.timeout, retries=data.retries), data.on_error),
        require_index=loss_needs_sample_count(recipe, registry),
        distill=distill_inputs(distill),
        **place,
    )


def distill_shards(recipe: dict) -> str | None:
    """The shard directory a stored teacher's manifest is read from (None: not a local set)."""
    data = section(recipe, "data")
    return None if data.stream is not None or is_streamed_data(data) else shard_target(data)


def distill_inputs(distill: Distillation | None) -> DistillInputs | None:
    """What the loader adds to each batch for ``train.distill`` (None: nothing)."""
    if distill is None:
        return None
    return DistillInputs(stored=distill.teacher is None, tokenizer=teacher_tokenizer(distill))


def is_streamed_data(data) -> bool:
    """Whether the recipe trains on shards read where they live (a mixture, a URL, a brace list,
    a folder of tars without a manifest) rather than a clipkit shard directory made from
    ``data.source``."""
    from clipkit.data.shard_sets import is_streamed

    if data.mixture is not None or is_streamed(data.shards):
        return True  # a URL or a pattern is never a place to shard data.source into
    if data.source:
        return False
    return not (Path(data.shards) / "manifest.json").is_file()


def loss_needs_sample_count(recipe: dict, registry: Registry) -> bool:
    """Whether the loss keeps per-sample state (its factory takes ``num_samples``: NUCLR, SogCLR)."""
    import inspect

    entry = registry.get("loss", recipe["loss"]["name"], where="loss")
    return "num_samples" in inspect.signature(entry.factory).parameters


def check_held_out(split, fraction: float, shards, *, announce: bool) -> None:
    """Refuse a held-out split with no sample before training (its evaluation would fail after it),
    else say how many samples each side has."""
    held, total = len(split.held_out), len(split.held_out) + split.num_samples
    if not held:
        raise DataError(
            f"{shards}: data.holdout {fraction:g} holds out none of its {total} samples, so the "
            f"held-out evaluation would score nothing; raise --holdout, or give --eval-data with --holdout 0"
        )
    if announce:
        print(f"data: {held} of {total} samples held out for evaluation, {split.num_samples} to train on")


def fit_batch_to_data(runtime: Runtime, num_samples: int, shards) -> None:
    """``data.fit_batch``: when each process's share of the ``num_samples`` training samples is less
    than its batch, lower ``data.batch_size`` to the most that fits (a multiple of the processes and
    of ``train.micro_batch_size``) and say so once; a batch that already fits is left alone."""
    plan = runtime.plan
    per_process = num_samples // plan.world_size
    if per_process >= plan.local_size:
        return
    step = plan.micro_size if plan.micro_size != plan.local_size else 1
    local = per_process - per_process % step
    if local < 2:  # a contrastive batch needs a negative; BatchStream's check explains the rest
        return
    runtime.refit_batch(local * plan.world_size)
    if runtime.is_main:
        print(
            f"data: {shards} gives training {num_samples} samples, fewer than one batch of "
            f"{plan.global_size}; data.batch_size -> {runtime.plan.global_size} (data.fit_batch; set "
            f"data.batch_size yourself, or data.fit_batch=false to refuse instead)",
            flush=True,
        )


def compile_model(model: ContrastiveModel, mode: str, unit: str) -> ContrastiveModel:
    """``train.compile``: the towers (whole, or block by block: ``train.compile_unit``) through
    ``torch.compile`` (refused where it cannot run)."""
    from clipkit.train.compile import compile_towers, compile_unavailable

    reason = compile_unavailable()
    if reason:
        raise ClipkitError(f"train.compile={mode}: {reason}; use train.compile=none")
    return compile_towers(model, mode, unit)


def compile_objective(objective, mode: str, *, announce: bool) -> None:
    """``train.compile_scope: step``: the objective's similarity + loss compiled, or left eager with
    one line saying why (:func:`clipkit.train.compile.scoring_refusal`)."""
    from clipkit.train.compile import compile_scoring, scoring_refusal

    reason = scoring_refusal(objective)
    if reason is None:
        objective.compiled_scoring = compile_scoring(objective, mode)
    elif announce:
        print(f"train.compile_scope=step: similarity and loss stay eager: {reason}", file=sys.stderr)


def shard_target(data: DataConfig) -> str:
    """The shard directory a recipe's ``data`` trains on: ``data.shards``, or where ``data.source``'s go."""
    return data.shards or str(default_shard_dir(data.source))


def check_data_location(recipe: dict, registry: Registry) -> None:
    """What training checks about the recipe's data before it writes anything (``clipkit validate``):
    a live distillation teacher's directory, the shard directory or the source it would be made
    from (see :func:`ensure_shards`), and stored teacher embeddings in those shards' manifest."""
    from clipkit.data.shard_sets import parse_mixture, resolve, resolve_entry

    check_teacher(recipe, registry)  # the teacher is loaded before the data; say it before a shard is written
    data = section(recipe, "data")
    if data.stream is not None:
        return
    patience = Patience(timeout=data.timeout, retries=data.retries)
    if data.mixture is not None:
        for i, entry in enumerate(parse_mixture(data.mixture)):
            resolve_entry(
                i, entry.shards, patience
            )  # a DataError naming the entry, before anything is written
    elif is_streamed_data(data):
        resolve(data.shards, patience)
    else:
        check_shards(shard_target(data), data.source, pm=registry.pm)
    # Shards made from data.source carry no teacher embeddings: say so before sharding, not after.
    check_stored_teacher(recipe, distill_shards(recipe))


def ensure_shards_once(runtime: Runtime, data: DataConfig, registry: Registry) -> str:
    """Shard the recipe's source on the main process only; the others wait and read the result."""
    target = shard_target(data)
    if runtime.is_main:
        target = ensure_shards(target, data.source, pm=registry.pm)
    runtime.wait()
    if not runtime.is_main:
        target = ensure_shards(target, data.source, pm=registry.pm)
    return target


def enable_grad_checkpointing(model: ContrastiveModel) -> None:
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
        generator = self.runtime.rank_generator(step)
        raw = batch["image"]
        batch = {**batch, "image": self.augment(raw, generator)}
        if self.two_view:
            batch["image2"] = self.augment(raw, generator)
        return batch


def prepare_run_dir(recipe: dict, run_dir: Path, *, resume: bool) -> None:
    """Create the run directory and save the resolved recipe (refuses to overwrite a run). A
    resumed run's recipe (with this launch's overrides) is saved only once its checkpoint has loaded
    (:func:`accept_resumed_recipe`): a refused resume leaves the run's recipe.yaml as it was."""
    run_dir = Path(run_dir)
    if not resume and latest_checkpoint(run_dir) is not None:
        raise ClipkitError(
            f"{run_dir} already holds a run; pass --resume to continue it or pick another --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        save_recipe(recipe, run_dir / "recipe.yaml")


def accept_resumed_recipe(recipe: dict, run_dir: Path) -> None:
    """Save a resumed run's recipe, overrides included, after its checkpoint loaded into the
    trainer this recipe built (:func:`build_trainer`)."""
    save_recipe(recipe, Path(run_dir) / "recipe.yaml")
