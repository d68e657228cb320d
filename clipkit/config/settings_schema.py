"""Host settings — ``data.*``, ``model.*``, ``train.*``, ``seed`` — declared once, here.

Each section of a recipe is a dataclass; each field declares a setting's type, default and (as
:data:`typing.Annotated` metadata, the same way plugin factories declare their parameters) its
allowed values. Everything else is derived from these classes, so they cannot disagree:

* ``clipkit.config.recipe.section(recipe, "train")`` — the typed view the code reads (defaults filled in);
* ``validate``'s unknown-key and type checks (:func:`clipkit.config.recipe.validate`);
* :data:`HOST`, the range and choice of every constrained setting (:func:`check_host`), so anything
  ``validate`` accepts cannot fail in ``train`` on a settings error.

To add a host setting, add a field to its section's class below (``Annotated[type, constraint]``
when its values are bounded) with a comment saying what it does; nothing else needs listing.
The constraint vocabulary lives in :mod:`clipkit.config.constraints` (re-exported here, where plugin
authors have always imported it from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from clipkit.config.constraints import (  # noqa: F401 — re-exported: plugins import Range/OneOf from here
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Integer,
    Interval,
    Numbers,
    OneOf,
    Range,
    annotated_constraints,
    parameter_constraints,
)
from clipkit.config.dotted import lookup

#: ``torch.compile`` modes, plus "none" (eager). "reduce-overhead" adds CUDA graphs on GPUs;
#: on a CPU it behaves like "default". "max-autotune" benchmarks kernel choices while compiling.
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
#: What ``train.compile`` covers: the two towers, or the step (the towers and the similarity + loss).
COMPILE_SCOPES = ("towers", "step")
#: How each tower is compiled: whole ("tower"), or block by block ("block": regional compilation,
#: the tower's repeated blocks compiled and the rest left eager; identical blocks share one graph,
#: so a cold compile traces one transformer layer instead of all of them).
COMPILE_UNITS = ("tower", "block")

#: ``train.report_to`` names with a tracker of clipkit's own (clipkit.plugins.loggers.trackers);
#: any other must be an Accelerate tracker's.
BUILT_IN_TRACKERS = ("tensorboard", "wandb", "mlflow")
#: Accelerate's tracker names (``accelerate.tracking.LOGGER_TYPE_TO_CLASS`` of the pinned version;
#: tests/test_settings_without_effect.py checks each is one): validation accepts them without
#: importing Accelerate's tracking module (~0.7 s), which it asks only about a name in neither list.
ACCELERATE_TRACKERS = (
    "aim",
    "clearml",
    "comet_ml",
    "dvclive",
    "mlflow",
    "swanlab",
    "tensorboard",
    "trackio",
    "wandb",
)

#: Longest data.timeout (seconds; a day): sockets and select() overflow far above it.
MAX_TIMEOUT = 86400.0
#: Most data.retries: the back-off doubles per attempt (capped), so more only stalls a dead shard.
MAX_RETRIES = 100


@dataclass
class RootConfig:
    """The host settings at the top level of a recipe, beside its sections."""

    seed: Annotated[int, Integer(NON_NEGATIVE)] = 0  # training's randomness (init, data order, augmentation)
    eval_seed: Annotated[int, Integer(NON_NEGATIVE)] = 0  # fixes random features (WPSE) at evaluation


@dataclass
class DataConfig:
    """``data:`` — where training samples come from."""

    shards: str = ""  # directory with manifest.json; created from `source` when missing
    source: str = ""  # a URI any open_source plugin accepts (e.g. synthetic://shapes?n=8192)
    # Streamed sources (docs/data.md): the samples in an epoch when no manifest.json / sizes.json
    # beside the shards counts them (0: from the counts); a weighted list of shard sets instead of
    # `shards` ([{shards, weight}], or "W*SHARDS :: W*SHARDS"); what an unreadable shard does
    # (skip: counted by reason; raise: stop); seconds per connect/read and extra attempts.
    num_samples: Annotated[int, NON_NEGATIVE] = 0
    mixture: Any = None
    on_error: Annotated[str, OneOf(("skip", "raise"))] = "skip"
    timeout: Annotated[float, Range(gt=0, le=MAX_TIMEOUT)] = 30.0
    retries: Annotated[int, Range(ge=0, le=MAX_RETRIES)] = 3
    stream: Any = None  # a registered batch stream ({name: ..., ...}) instead of shards (synthetic studies)
    batch_size: Annotated[int, POSITIVE] = 128
    # Lower batch_size to what the training split holds when it holds less than one batch (with a
    # notice) instead of refusing: the tiny variants set it so they run on a small table as given.
    fit_batch: bool = False
    # loader processes; auto: from the usable CPUs (clipkit.config.machine)
    num_workers: Annotated[int | str, NON_NEGATIVE] = "auto"
    shuffle_buffer: Annotated[int, NON_NEGATIVE] = 1000
    resampled: bool = False  # draw each epoch's shards with replacement (seeded), as WebDataset's resampling
    # random-resized-crop area range for training images
    crop_scale: Annotated[tuple, Interval(Range(gt=0, le=1))] = (1.0, 1.0)
    crop_ratio: Annotated[tuple, Interval(POSITIVE)] = (3 / 4, 4 / 3)  # random-resized-crop aspect ratios
    hflip: bool = False  # random horizontal flips (off: captions may say left/right)
    # SimCLR colour-distortion strength (two-view recipes: 0.5 or 1.0)
    color_jitter: Annotated[float, NON_NEGATIVE] = 0.0
    grayscale: Annotated[float, PROBABILITY] = 0.0  # probability of a grey image (SimCLR: 0.2)
    # Meta-data names the loss reads -> the shard's meta-data keys they come from, e.g.
    # {age: extent} lets a recipe's kernel on `age` run on data whose column is `extent`.
    meta_keys: dict = field(default_factory=dict)
    # Where training augmentation runs: "sample" = per image in the loader (PIL, every option),
    # "batched" = loader emits uint8 images of `batched_input_size` (0: image_size·8/7) and the
    # crop/flip/normalise run as one tensor op per batch on the training device (no colour ops).
    augment: Annotated[str, OneOf(("sample", "batched"))] = "sample"
    batched_input_size: Annotated[int, NON_NEGATIVE] = 0
    # Colour transparent pixels are composited onto when images are decoded: white, black, grey,
    # "#rrggbb" or [r, g, b] (clipkit.data.image_modes; docs/data.md "Colour modes").
    background: str | list = "white"
    # Fraction of samples (by a hash of their key) left out of training for evaluation; set by
    # `clipkit train --data` (--holdout), see clipkit.app.own_data.
    holdout: float = 0.0
    # A meta-data column whose value is hashed instead of the key (`clipkit train --holdout-by`):
    # all rows of a group on one side of the split; null: row by row.
    holdout_by: str | None = None


@dataclass
class ModelConfig:
    """``model:`` — shared settings of the towers (the slots are checked separately)."""

    embed_dim: Annotated[int, POSITIVE] = 512
    image_size: Annotated[int, POSITIVE] = 224
    mean: Annotated[tuple, Numbers(3)] = (0.48145466, 0.4578275, 0.40821073)  # CLIP's normalisation
    std: Annotated[tuple, Numbers(3, POSITIVE)] = (0.26862954, 0.26130258, 0.27577711)
    # "image_text"; "two_view": one image encoder, two augmented views; "vectors": two towers over
    # the stream's vectors batch["x"] [B, dx] and batch["y"] [B, dy], no tokenizer (synthetic studies)
    pair: Annotated[str, OneOf(("image_text", "two_view", "vectors"))] = "image_text"
    image_encoder: Any = None
    text_encoder: Any = None
    tokenizer: Any = None
    # Start training from existing weights: a path (clipkit export, open_clip / Hugging Face CLIP
    # directory, OpenAI-layout .safetensors) or {path, include, exclude, strict}
    # (clipkit/model/init_weights.py).
    init: Any = None
    frozen: tuple = ()  # towers to lock while training: image_encoder and/or text_encoder (LiT)
    # LoRA adapters on the towers through peft (LoraConfig, clipkit.model.lora), on when this
    # mapping is non-empty (e.g. model.lora.rank=8)
    lora: dict = field(default_factory=dict)


#: The towers a recipe may name (model.frozen, model.lora.towers).
TOWER_NAMES = ("image_encoder", "text_encoder")


@dataclass
class LoraConfig:
    """``model.lora:`` — low-rank adapters (peft's LoRA) on the towers' matching modules; the towers'
    own weights are locked, the adapters and the similarity train (clipkit.model.lora)."""

    # a regular expression that must fully match a module's name within its tower (peft's rule)
    target: str = r".*attn\.(in_proj|out_proj)"
    rank: Annotated[int, POSITIVE] = 8
    alpha: Annotated[float, POSITIVE] = 16.0  # the update is scaled by alpha / rank
    dropout: Annotated[float, PROBABILITY] = 0.0  # on the adapter's input
    towers: tuple = TOWER_NAMES  # which towers get adapters (checked by clipkit.config.recipe)


@dataclass
class TrainConfig:
    """``train:`` — the loop's knobs."""

    steps: Annotated[int, POSITIVE] = 1000
    log_every: Annotated[int, POSITIVE] = 10
    checkpoint_every: Annotated[int, POSITIVE] = 500
    keep_checkpoints: Annotated[int, NON_NEGATIVE] = 2  # the newest N checkpoints are kept; 0 keeps all
    precision: Annotated[str, OneOf(("no", "bf16", "fp16"))] = "no"  # "no" (fp32), "bf16", "fp16"
    # The features entering the similarity: "fp32" (upcast; exact, the default) or "half" (under
    # bf16/fp16 on CUDA, the towers' dtype: the logits GEMM on tensor cores with fp32 accumulation,
    # the logits then upcast so the loss reduces in fp32; similarities that declare half_features)
    similarity_precision: Annotated[str, OneOf(("fp32", "half"))] = "fp32"
    # One device's peak TFLOP/s for the logged MFU: auto (looked up by GPU name; none on a CPU),
    # measure (a matmul timed at start) or a number (clipkit.train.telemetry)
    peak_tflops: float | str = "auto"
    grad_clip: Annotated[float, NON_NEGATIVE] = 0.0  # max global grad norm; 0 = off
    export: bool = True  # export RUN/export at the end (and run the recipe's eval tasks)
    # run the recipe's eval tasks on the in-memory model every N steps; 0 = off
    eval_every: Annotated[int, NON_NEGATIVE] = 0
    # Exact gradient accumulation: each process encodes its share of data.batch_size in micro-batches
    # of this many samples (0 = all at once); the loss still sees the whole contrastive batch.
    micro_batch_size: Annotated[int, NON_NEGATIVE] = 0
    grad_checkpointing: bool = False  # recompute encoder activations in backward (every encoder's switch)
    # a NaN/inf loss or gradient: "stop" with a message, or "skip" the step
    nonfinite: Annotated[str, OneOf(("stop", "skip"))] = "stop"
    # torch.compile the towers: none | default | reduce-overhead | max-autotune
    compile: Annotated[str, OneOf(COMPILE_MODES)] = "none"
    # what train.compile covers: towers | step (the towers and the similarity + loss, where both
    # plugins declare `compiles`; clipkit.train.compile)
    compile_scope: Annotated[str, OneOf(COMPILE_SCOPES)] = "towers"
    # how each tower is compiled: tower (whole) | block (each repeated block; the cold compile
    # traces one layer, not all; clipkit.train.compile)
    compile_unit: Annotated[str, OneOf(COMPILE_UNITS)] = "tower"
    threads: int | str = "auto"  # torch intra-op threads; auto: the usable CPUs the loader leaves
    # Estimate the run's memory before training; refuse it when it exceeds what the machine has
    # (clipkit.train.memory_fit); false: run anyway
    memory_check: bool = True
    # The loss tile by tile, exact at bounded memory (clipkit.tiled.settings): auto (above a batch of
    # 8192, when the similarity and loss have a tiled form) | true | false; rows and columns per tile
    tiled: bool | str = "auto"
    tile_size: int = 1024
    distributed: dict = field(default_factory=dict)  # DistributedConfig: strategy, ZeRO, gather semantics
    # Experiment trackers fed the metrics.jsonl numbers, eval results and this recipe (offline/local):
    # tensorboard, wandb, mlflow or an Accelerate tracker name (clipkit.plugins.loggers.trackers)
    report_to: list = field(default_factory=list)
    # Weight EMA (EmaConfig, clipkit.train.ema): an fp32 moving average of the trainable weights,
    # on when this mapping is non-empty (e.g. train.ema.decay=0.999)
    ema: dict = field(default_factory=dict)
    # Distillation from a frozen teacher (DistillConfig, docs/distillation.md): on when this mapping
    # is non-empty (e.g. train.distill.teacher=runs/big/export)
    distill: dict = field(default_factory=dict)


@dataclass
class DistillConfig:
    """``train.distill:`` — learn from a frozen teacher beside the contrastive loss (clipkit.train.distill).

    The loss is ``contrastive + Σ weight_k · distill_k(student, teacher)`` over ``losses``, each a
    registered distillation loss (``register_distill_losses``: kl, feature_cosine, feature_mse) with
    its ``weight`` and arguments. The teacher is a model directory run in the same step (``teacher``:
    a clipkit export, an open_clip or Hugging Face CLIP directory), or the embeddings
    ``clipkit shard --teacher`` stored in the shards (``stored: true``; no teacher is loaded).
    """

    teacher: str | None = None  # the teacher model's directory (live teacher); null with stored: true
    stored: bool = False  # read the teacher's embeddings from the shards instead of running it
    losses: list = field(default_factory=lambda: [{"name": "kl", "weight": 1.0}])


@dataclass
class EmaConfig:
    """``train.ema:`` — an exponential moving average of the trainable weights (clipkit.train.ema).

    After every ``every``-th applied optimiser step t: ema <- d·ema + (1 - d)·w, with
    d = (decay · min(1, t / warmup))^every (warmup 0: no ramp). Kept in fp32 on the training
    device (4 bytes per trainable parameter), checkpointed, exported with ``clipkit export --ema``.
    """

    decay: Annotated[float, Range(ge=0, lt=1)] = 0.9999
    warmup: Annotated[int, NON_NEGATIVE] = 0  # optimiser steps over which the decay ramps up from 0
    every: Annotated[int, POSITIVE] = 1  # update after every N-th applied optimiser step
    # what train.eval_every scores: the live weights, the EMA weights (eval_ema/...), or both
    eval: Annotated[str, OneOf(("live", "ema", "both"))] = "both"


@dataclass
class DistributedConfig:
    """``train.distributed:`` — how several processes (``accelerate launch``) share the work.

    gather_with_grad / local_loss choose the gather semantics of METHODS §11 (open_clip's flag names):
      with grad + local loss   (open_clip, WPSE)  exact: each process scores its own anchors
      with grad + global loss  (NUCLR; default)   exact: every process scores the whole batch
      no grad  + local loss    (SLIP)             other processes' features are constants
      no grad  + global loss   (CLOOB, CyCLIP)    towers get 1/world_size of the full-batch gradient
    """

    # "ddp" (DistributedDataParallel; one process: plain), "deepspeed" (ZeRO) or "fsdp2" (torch's
    # fully_shard: parameters, gradients and optimiser state sharded over the processes)
    strategy: Annotated[str, OneOf(("ddp", "deepspeed", "fsdp2"))] = "ddp"
    zero_stage: Annotated[int, OneOf((0, 1, 2, 3))] = 2  # DeepSpeed ZeRO stage 0-3 (strategy: deepspeed)
    # "none" or "cpu" (ZeRO-Offload; DeepSpeed builds CPUAdam on first use)
    offload_optimizer: Annotated[str, OneOf(("none", "cpu"))] = "none"
    offload_params: Annotated[str, OneOf(("none", "cpu"))] = "none"  # "none" or "cpu" (ZeRO-3 only)
    gather_with_grad: bool = True
    local_loss: bool = False


#: The typed sections of a recipe: ``section(recipe, name)`` builds these.
SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig}
#: Where each settings class sits in a recipe ("" = the top level).
SCHEMA = {
    "": RootConfig,
    **SECTIONS,
    "train.distributed": DistributedConfig,
    "train.ema": EmaConfig,
    "train.distill": DistillConfig,
    "model.lora": LoraConfig,
}


def _host_constraints() -> dict[str, Any]:
    return {
        f"{prefix}.{name}" if prefix else name: constraint
        for prefix, settings in SCHEMA.items()
        for name, constraint in annotated_constraints(settings).items()
    }


#: Every constrained host setting: dotted key path -> constraint (checked when the key is set);
#: derived from the classes above.
HOST: dict[str, Any] = _host_constraints()


def check_host(recipe: dict) -> list[str]:
    """'key.path: message' for every host setting outside its declared values."""
    errors = []
    for path, constraint in HOST.items():
        found, value, _ = lookup(recipe, path)
        if not found:
            continue
        problem = constraint.problem(value)
        if problem:
            errors.append(f"{path}: {problem}")
    return errors
