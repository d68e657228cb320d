"""A ViT-B/16 CLIP training step in bf16: clipkit vs open_clip, same model, same batches.

Both sides train CLIP's recipe (recipes/clip.yaml): ViT-B/16 image tower + 12x512 causal text
Transformer, embed 512, 224 px, context 77, exact GELU (open_clip's ``ViT-B-16`` config: no
QuickGELU, as clipkit's default), symmetric InfoNCE with a learnable logit scale (init 1/0.07,
at most 100), AdamW (lr 5e-4, wd 0.2 on matrices only, betas 0.9/0.98, eps 1e-6), a warm-up
cosine schedule, bf16 autocast around the towers:

- clipkit: the trainer ``clipkit.train.build.build_trainer`` builds from ``clip`` (Runtime,
  model, loss, optimizer, schedule) with ``data.stream`` set to a stream of the batches already on
  the device (registered by a plugin here, so no shard is read); one step is the training loop's
  body: ``runtime.to_device`` + ``clipkit.train.loop.train_step`` (encode, loss in fp32, the
  finite check, backward, grad norm, AdamW step, zero_grad) + ``schedule.step()``;
- open_clip: ``open_clip.model.CLIP(**get_model_config("ViT-B-16"), output_dict=True)`` and the
  step of open_clip's ``train_one_epoch``: forward and ``ClipLoss`` under autocast, backward,
  AdamW step (the same parameter groups), zero_grad, logit scale clamped to ln 100, LR schedule.

The batches: random normal 224x224 images and CLIP-BPE-shaped token rows (start id, random ids,
end id 49407, zero padding; random lengths), made on the GPU once; both sides cycle over the same
two. Per configuration (gradient checkpointing off, then on: clipkit's
``train.grad_checkpointing`` switch, open_clip's ``set_grad_checkpointing()``) each side does 2
untimed warm-up steps, then 3 interleaved rounds of 5 steps timed with CUDA events; samples/s is
the median over rounds. Peak memory: torch's allocator peak during one more step, above what it
held before the step (weights and optimizer state excluded, gradients and activations included).
Then, while the budget (80 s for the part) lasts, the largest batch that fits, per side and
setting: doubling from 256 until ``torch.cuda.OutOfMemoryError`` (one step per size; both models
and their AdamW state stay resident, ~3.6 GiB; clipkit's trainer keeps its batch plan of 256,
which matters only for gradient accumulation, off here).
``torch.compile`` only with ``CLIPKIT_GPU_VIT_COMPILE=block`` (or ``tower``; cold compiles do not
fit the default budget: give the part more, ``BUDGET_VIT_STEP=300``): both sides compiled the same
way, by default regionally (each transformer layer, clipkit's ``train.compile_unit: block``); the
first step (the cold compile) is reported apart from the steady samples/s.

Issue 38's memory goal: per configuration (checkpointing off and on) and clipkit side, the ratio of
its step peak memory to open_clip's, goal <= 1.0 (clipkit's ViT keeps its residual stream in bf16
under autocast, as open_clip's LayerNorm does; benchmarks/checkpoint_memory.py makes the same
comparison on the CPU).

Issue 38's configurations: a third side, clipkit with ``train.similarity_precision=half`` (the
features enter the similarity in bf16, fp32 logits and loss); per side and configuration the MFU
(model FLOPs per sample from ``torch.utils.flop_counter`` on clipkit's model — 3x the towers'
forward; open_clip's model has the same architecture and count — over the device's peak: the bf16
ceiling part_ceilings.py measured when it ran, else the data sheet by device name); for the clipkit
sides, the training loop's own telemetry over a few steps of ``train_loop`` (data-wait share, MFU,
forward / backward / optimizer milliseconds, as the log line reports them); and samples/s with MFU
at the largest batch that fits.

Rehearsal (``CLIPKIT_GPU_REHEARSAL=1``, CPU): ``clip@tiny``'s encoders (vit_tiny,
text_transformer_tiny, 48 px, context 16) at batch 8 in fp32 (CPU bf16 is slow and proves
nothing), one torch thread, 1 warm-up step and 2 rounds of 1 step, batches up to 16; open_clip
with the same tiny dimensions when importable, else recorded in ``skipped``. Usage (from the repository root):

    python benchmarks/gpu/part_vit_step.py --out DIR      # writes DIR/vit_step.json
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import math
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    device,
    figure,
    free_memory,
    interleaved_ms,
    median,
    parse_out,
    peak_memory,
    pick,
    read_ceilings,
    rehearsal,
    write_part,
)

#: The part's 80 s, less the interpreter's start and torch's import (before this clock starts).
BUDGET_S = 75.0
STARTED = time.perf_counter()
STREAM = "gpu_bench_batches"
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND = pick(2, 1), pick(3, 2), pick(5, 1)
BATCH = pick(256, 8)
#: bf16 autocast on the GPU; fp32 in a rehearsal (CPU bf16 kernels would make it slow, and prove nothing)
PRECISION = pick("bf16", "no")
#: How figures name the model and precision (a rehearsal's tiny fp32 model is not ViT-B/16 in bf16).
MODEL = pick("ViT-B/16 bf16", "tiny ViT fp32 (rehearsal)")
GOAL = ">= 1.3x open_clip samples/s at <= its peak memory"
MFU_GOAL = ">= 45 % MFU"
MEMORY_GOAL = "<= 1.0x open_clip's step peak memory at equal batch"
#: Steps of clipkit's train_loop whose telemetry (data wait, MFU, step split) is recorded per configuration.
LOOP_STEPS = pick(4, 2)
#: Filled in main(): model FLOPs of one training sample and the device's peak TFLOP/s with its source.
MFU_BASIS: dict = {}


def left() -> float:
    """Seconds of the part's budget left."""
    return BUDGET_S - (time.perf_counter() - STARTED)


def log(message: str) -> None:
    print(f"[vit_step {time.perf_counter() - STARTED:5.1f}s] {message}", flush=True)


def failure(skipped: list[str], what: str, error: BaseException) -> None:
    """Record a failed measurement in ``skipped`` and print its traceback (the log is for debugging)."""
    skipped.append(f"{what}: {type(error).__name__}: {error}"[:500])
    log(f"{what}: {type(error).__name__}: {error}"[:500])
    traceback.print_exc()


def gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


# --- batches ---


def make_batch(size: int, image_size: int, context: int, vocab: int, seed: int, dev: torch.device) -> dict:
    """Random normal images [size, 3, S, S] (what the loader hands over: normalised floats) and
    token rows [start, ids..., end, 0...] with the end id the vocabulary's largest (open_clip pools
    at the argmax id, clipkit at the last non-zero one: the same position)."""
    generator = torch.Generator(device=dev).manual_seed(seed)
    images = torch.randn(size, 3, image_size, image_size, device=dev, generator=generator)
    lengths = torch.randint(3, context + 1, (size, 1), device=dev, generator=generator)
    body = torch.randint(1, vocab - 2, (size, context), device=dev, generator=generator)
    positions = torch.arange(context, device=dev).expand(size, context)
    text = torch.where(positions < lengths - 1, body, 0)
    text = torch.where(positions == lengths - 1, vocab - 1, text)
    text[:, 0] = vocab - 2
    return {"image": images, "text": text, "index": torch.arange(size, device=dev)}


# --- the two sides: each has name, summary, step(batch), set_grad_checkpointing(bool), zero_grad() ---


class ClipkitSide:
    """clipkit's trainer on the ``clip`` recipe (``clip@tiny`` in a rehearsal), fed in-memory batches."""

    def __init__(self, run_dir: Path, name: str = "clipkit", overrides: tuple[str, ...] = ()) -> None:
        from clipkit.app.api import resolve
        from clipkit.contract.hookspecs import hookimpl
        from clipkit.contract.manager import make_plugin_manager
        from clipkit.contract.registry import Registry
        from clipkit.data.memory import InMemoryStream
        from clipkit.train.build import build_trainer, prepare_run_dir

        self.name = name
        self.batches: list[dict] = []
        batches = self.batches

        class BenchStreams:
            @hookimpl
            def register_streams(self, register):
                def stream(batch_size, seed, rank, world_size):
                    return InMemoryStream(batches)

                register(STREAM, stream)

        registry = Registry(make_plugin_manager(extra_plugins=[BenchStreams()]))
        overrides = [
            f"data.stream={{name: {STREAM}}}",
            f"data.batch_size={BATCH}",
            "data.num_workers=0",
            f"train.precision={PRECISION}",
            "train.steps=100000",
            "train.eval_every=0",
            "train.export=false",
            *pick([], ["train.threads=1"]),  # tiny ops: more threads only wait for each other on a busy CI
            *overrides,
        ]
        recipe = resolve(pick("clip", "clip@tiny"), overrides, registry)
        prepare_run_dir(recipe, run_dir, resume=False)
        self.trainer = build_trainer(recipe, run_dir, registry)
        self.model = self.trainer.model
        tokenizer = self.model.tokenizer
        self.image_size = int(recipe["model"]["image_size"])
        self.context, self.vocab = int(tokenizer.context_length), int(tokenizer.vocab_size)
        self.embed_dim = int(recipe["model"]["embed_dim"])
        self.step_index = 0
        self.summary = (
            f"{type(self.model.image_encoder).__name__} + {type(self.model.text_encoder).__name__}, "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f} M parameters"
        )

    def set_grad_checkpointing(self, enabled: bool) -> None:
        from clipkit.train.build import enable_grad_checkpointing

        if enabled:
            enable_grad_checkpointing(self.model)  # what train.grad_checkpointing=true does
        else:
            for tower in (self.model.image_encoder, self.model.text_encoder):
                for module in tower.modules():
                    if hasattr(module, "grad_checkpointing"):
                        module.grad_checkpointing = False

    def step(self, batch: dict) -> None:
        from clipkit.train.loop import train_step

        trainer = self.trainer
        outcome = train_step(trainer, trainer.runtime.to_device(batch), self.step_index)
        trainer.schedule.step()
        self.step_index += 1
        if not outcome.applied:
            raise RuntimeError(f"clipkit skipped step {self.step_index}: loss {outcome.out.loss}")

    def zero_grad(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def loop_telemetry(self, steps: int, peak: float | None) -> dict:
        """The last metrics of ``steps`` steps of clipkit's own ``train_loop`` from where this side
        is (its log line: samples/s per device, data-wait share, MFU against ``peak``, the step
        split); no checkpoint is written."""
        import dataclasses
        from unittest import mock

        from clipkit.train import loop

        trainer = self.trainer
        trainer.start_step = self.step_index
        trainer.settings = dataclasses.replace(
            trainer.settings,
            steps=self.step_index + steps,
            log_every=steps,
            peak_tflops=peak if peak else "auto",
        )
        with mock.patch.object(loop, "save_trainer", lambda trainer, step: None):
            metrics = loop.train_loop(trainer)
        self.step_index += steps
        return metrics


def torchvision_ops_fail_to_load() -> bool:
    """torchvision is installed but its compiled ops library does not load into this torch (then
    ``import torchvision`` fails): loaded as torchvision's own import loads it, not by importing
    torchvision (a failed import leaves the process half set up)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    folder = Path(spec.origin).parent
    compiled = [folder / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    library = next((path for path in compiled if path.is_file()), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return True
    return False


def import_open_clip():
    """open_clip, defining torchvision's two op schemas first where torchvision is installed but
    cannot import by itself (tests/interop_support.py: a CUDA torchvision on CPU torch)."""
    if torchvision_ops_fail_to_load():
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
        import_open_clip.library = library  # keep the registration alive
    import open_clip

    return open_clip


class OpenClipSide:
    """open_clip's CLIP with clipkit's dimensions and the step of open_clip's ``train_one_epoch``."""

    name = "open_clip"

    def __init__(self, dev: torch.device, clipkit: ClipkitSide) -> None:
        open_clip = import_open_clip()
        from clipkit.plugins.optim import adamw, warmup_cosine_factor

        if rehearsal():  # clip@tiny's towers: vit_tiny (patch 8, 64 wide, 2 heads) + a 64-wide text tower
            config = {
                "embed_dim": clipkit.embed_dim,
                "vision_cfg": {
                    "image_size": clipkit.image_size,
                    "layers": 2,
                    "width": 64,
                    "patch_size": 8,
                    "head_width": 32,
                },
                "text_cfg": {
                    "context_length": clipkit.context,
                    "vocab_size": clipkit.vocab,
                    "width": 64,
                    "heads": 2,
                    "layers": 2,
                },
            }
        else:
            config = open_clip.get_model_config("ViT-B-16")
            expected = {
                "embed_dim": clipkit.embed_dim,
                "vision_cfg": {
                    "image_size": clipkit.image_size,
                    "layers": 12,
                    "width": 768,
                    "patch_size": 16,
                },
                "text_cfg": {
                    "context_length": clipkit.context,
                    "vocab_size": clipkit.vocab,
                    "width": 512,
                    "heads": 8,
                    "layers": 12,
                },
            }
            if config != expected:
                raise RuntimeError(f"open_clip's ViT-B-16 config {config} is not clipkit's {expected}")
        self.version = open_clip.__version__
        torch.manual_seed(0)
        # quick_gelu False (ViT-B-16's own setting): exact GELU, as clipkit's encoders by default.
        self.model = open_clip.model.CLIP(**config, quick_gelu=False, output_dict=True).to(dev).train()
        self.loss = open_clip.loss.ClipLoss()
        self.optimizer = adamw(
            list(self.model.named_parameters()), lr=5e-4, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_cosine_factor(step, 100000, 2000, 0.0)
        )
        self.device_type = dev.type
        parameters = sum(p.numel() for p in self.model.parameters())
        self.summary = f"open_clip {self.version} CLIP, {parameters / 1e6:.1f} M parameters"

    def set_grad_checkpointing(self, enabled: bool) -> None:
        self.model.set_grad_checkpointing(enabled)

    def step(self, batch: dict) -> None:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=PRECISION == "bf16"):
            out = self.model(batch["image"], batch["text"])
            loss = self.loss(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        self.schedule.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# --- measuring ---


def runner(side, batches: list[dict], steps: int) -> Callable[[], None]:
    cycle = itertools.cycle(batches)

    def run() -> None:
        for _ in range(steps):
            side.step(next(cycle))

    return run


def measure_config(
    sides: dict, batches: list[dict], checkpointing: bool, figures: list, skipped: list
) -> None:
    """Throughput (interleaved rounds) and peak memory of every side at one checkpointing setting."""
    label = checkpointing_label(checkpointing)
    ready = {}
    for name, side in sides.items():
        try:
            side.set_grad_checkpointing(checkpointing)
            runner(side, batches, WARMUP_STEPS)()
            ready[name] = side
        except Exception as error:  # noqa: BLE001 - one side's failure must not lose the other's
            failure(skipped, f"{name}, {label}: warm-up failed", error)
            side.zero_grad()
            free_memory()
    if not ready:
        return
    try:
        times = interleaved_ms(
            {name: runner(side, batches, STEPS_PER_ROUND) for name, side in ready.items()},
            warmup=0,
            rounds=ROUNDS,
        )
    except Exception as error:  # noqa: BLE001
        failure(skipped, f"{label}: timed rounds failed", error)
        return
    rates, memory = {}, {}
    for name, side in ready.items():
        per_round = [BATCH * STEPS_PER_ROUND / (ms * 1e-3) for ms in times[name]]
        rates[name] = median(per_round)
        try:
            memory[name] = peak_memory(runner(side, batches, 1))
        except Exception as error:  # noqa: BLE001
            memory[name] = None
            failure(skipped, f"{name}, {label}: peak memory step failed", error)
        step_ms = median(times[name]) / STEPS_PER_ROUND
        peak = f", peak {gib(memory[name]):.2f} GiB" if memory[name] is not None else ""
        log(f"{name}, {label}, batch {BATCH}: {rates[name]:.0f} samples/s ({step_ms:.1f} ms/step){peak}")
        note = (
            f"{side.summary}; {step_ms:.1f} ms/step median, rounds {min(per_round):.0f}-{max(per_round):.0f} "
            f"samples/s ({ROUNDS} rounds of {STEPS_PER_ROUND} steps after {WARMUP_STEPS} warm-up)"
        )
        if name == "clipkit":
            note += "; clipkit's real step: runtime.to_device + train_step + schedule.step"
        entry = figure(f"{name} {MODEL} step, batch {BATCH}, {label}", rates[name], "samples/s", note=note)
        if name == "clipkit" and not checkpointing:
            entry["key"] = "clipkit_samples_per_s"
        figures.append(entry)
        mfu_figure(figures, f"{name} {MODEL} MFU, batch {BATCH}, {label}", rates[name])
        if isinstance(side, ClipkitSide):
            telemetry_figures(side, label, figures, skipped)
        if memory[name] is not None:
            figures.append(
                figure(
                    f"{name} {MODEL} step peak memory, batch {BATCH}, {label}",
                    gib(memory[name]),
                    "GiB",
                    note="allocator peak during one step above what it held before (weights and AdamW "
                    "state excluded; gradients and activations included)",
                )
            )
    for name in [side for side in rates if side.startswith("clipkit")]:
        if "open_clip" not in rates:
            break
        ratio = rates[name] / rates["open_clip"]
        per_round = [o / c for c, o in zip(times[name], times["open_clip"], strict=True)]
        memory_ok = None
        if memory[name] is not None and memory["open_clip"] is not None:
            memory_ok = memory[name] <= memory["open_clip"]
        met = None if memory_ok is None else (ratio >= 1.3 and memory_ok)
        memory_note = "; memory not measured (CPU)"
        if memory_ok is not None:
            mine, theirs = gib(memory[name]), gib(memory["open_clip"])
            memory_note = f"; peak memory {name} {mine:.2f} GiB vs open_clip {theirs:.2f} GiB"
        log(f"{name} / open_clip, {label}: {ratio:.3f}x{memory_note[1:]}")
        if memory_ok is not None:  # issue 38: at equal batch, no more memory than open_clip's
            figures.append(
                figure(
                    f"{name} / open_clip step peak memory, {MODEL}, batch {BATCH}, {label}",
                    memory[name] / memory["open_clip"],
                    "x",
                    goal=MEMORY_GOAL,
                    met=memory_ok,
                    note=f"{gib(memory[name]):.2f} GiB vs {gib(memory['open_clip']):.2f} GiB, allocator peak "
                    "during one step above what each held before (the CPU comparison: "
                    "benchmarks/checkpoint_memory.py)",
                )
            )
        figures.append(
            figure(
                f"{name} / open_clip samples/s, {MODEL}, batch {BATCH}, {label}",
                ratio,
                "x",
                goal=GOAL,
                met=met,
                note=f"per-round ratios {min(per_round):.3f}-{max(per_round):.3f}{memory_note}",
            )
        )


def mfu_figure(figures: list, name: str, samples_per_s: float) -> None:
    """MFU of a measured rate: model FLOPs per sample x samples/s over the device's peak."""
    flops, peak = MFU_BASIS.get("flops_per_sample"), MFU_BASIS.get("peak_tflops")
    if not flops or not peak:
        return
    value = 100 * flops * samples_per_s / (peak * 1e12)
    figures.append(
        figure(
            name,
            value,
            "%",
            goal=MFU_GOAL,
            met=value >= 45,
            note=f"{flops / 1e9:.1f} GFLOP per training sample (3x the towers' forward, torch.utils."
            f"flop_counter) over {peak:.0f} TFLOP/s ({MFU_BASIS['peak_source']})",
        )
    )


def telemetry_figures(side: ClipkitSide, label: str, figures: list, skipped: list) -> None:
    """What clipkit's own log line says over a few steps of ``train_loop`` in this configuration."""
    if left() < 10:
        skipped.append(f"{side.name}, {label}: train_loop telemetry not run (budget)")
        return
    try:
        metrics = side.loop_telemetry(LOOP_STEPS, MFU_BASIS.get("peak_tflops"))
    except Exception as error:  # noqa: BLE001
        failure(skipped, f"{side.name}, {label}: train_loop telemetry failed", error)
        return
    split = ", ".join(
        f"{key.removesuffix('_ms')} {metrics[key]:.1f} ms"
        for key in ("forward_ms", "backward_ms", "optimizer_ms")
        if isinstance(metrics.get(key), float)
    )
    note = f"train_loop's log line over {LOOP_STEPS} steps, in-memory batches on the device; {split}"
    log(f"{side.name}, {label}, train_loop telemetry: " + ", ".join(
        f"{k} {v:.3g}" for k, v in metrics.items() if isinstance(v, float) and not k.startswith("acc")
    ))  # fmt: skip
    figures.append(
        figure(
            f"{side.name} data-wait share (log line), {label}", metrics["data_wait_share"], "share", note=note
        )
    )
    if isinstance(metrics.get("mfu"), float):
        figures.append(figure(f"{side.name} MFU (log line), {label}", 100 * metrics["mfu"], "%", note=note))


def largest_batch(side, clipkit: ClipkitSide, dev: torch.device, step_ms: float | None) -> dict | None:
    """The largest of BATCH·2^k that trains one step without running out of memory, while the
    budget lasts; {"fits": n, "failed": n or None, "stopped": reason or None}."""
    if dev.type != "cuda" and not rehearsal():
        return None
    fits, failed, stopped, size = BATCH, None, None, BATCH * 2
    limit = pick(BATCH * 64, BATCH * 2)  # a rehearsal has no out-of-memory to find: one doubling
    while size <= limit:
        estimate = 3.0 + 3 * (step_ms or 500.0) * 1e-3 * size / BATCH
        if left() < estimate:
            stopped = f"budget: {left():.0f} s left, batch {size} might take ~{estimate:.0f} s"
            break
        error_text = None
        try:
            batch = make_batch(size, clipkit.image_size, clipkit.context, clipkit.vocab, 7, dev)
            side.step(batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as error:
            error_text = str(error).splitlines()[0][:200]
        except RuntimeError as error:  # cuBLAS/cuDNN report a failed allocation as their own error
            if not any(sign in str(error) for sign in ("out of memory", "ALLOC_FAILED")):
                raise
            error_text = str(error).splitlines()[0][:200]
        batch = None
        side.zero_grad()
        free_memory()
        if error_text is not None:
            failed = size
            log(f"{side.name}: batch {size} is out of memory ({error_text})")
            break
        log(f"{side.name}: batch {size} fits")
        fits, size = size, size * 2
    else:
        stopped = f"stopped at the cap {limit}"
    return {"fits": fits, "failed": failed, "stopped": stopped}


def checkpointing_label(checkpointing: bool) -> str:
    return f"grad checkpointing {'on' if checkpointing else 'off'}"


def largest_batch_figures(
    sides: dict, clipkit: ClipkitSide, dev: torch.device, checkpointing: bool, figures, skipped, save
) -> None:
    """The largest batch of every side at one checkpointing setting, as figures."""
    label = checkpointing_label(checkpointing)
    for name, side in sides.items():
        try:
            side.set_grad_checkpointing(checkpointing)
            prefix = f"{name} {MODEL} step, batch {BATCH}, {label}"
            rate = next((f["value"] for f in figures if f["name"] == prefix), None)
            found = largest_batch(side, clipkit, dev, BATCH / rate * 1e3 if rate else None)
        except Exception as error:  # noqa: BLE001
            failure(skipped, f"{name}, {label}: largest batch failed", error)
            side.zero_grad()
            free_memory()
            continue
        if found is None:
            continue
        if found["stopped"]:
            skipped.append(f"{name}, {label}: largest batch search stopped: {found['stopped']}")
        if found["failed"] is None and found["fits"] == BATCH:
            continue  # nothing beyond the measured batch was tried
        bound = (
            f"batch {found['failed']} runs out of memory" if found["failed"] else "no out-of-memory reached"
        )
        figures.append(
            figure(
                f"{name} largest batch (powers of 2 from {BATCH}), {MODEL}, {label}",
                found["fits"],
                "samples",
                note=f"{bound}; one step per size; every side's model and AdamW state resident",
            )
        )
        largest_batch_rate(side, clipkit, dev, found["fits"], label, figures, skipped)
        save()


def largest_batch_rate(side, clipkit, dev, size: int, label: str, figures: list, skipped: list) -> None:
    """samples/s and MFU at the largest batch that fits: 2 timed steps after one warm-up."""
    if left() < 15:
        skipped.append(f"{side.name}, {label}: samples/s at batch {size} not measured (budget)")
        return
    try:
        batches = [make_batch(size, clipkit.image_size, clipkit.context, clipkit.vocab, 11, dev)]
        times = interleaved_ms({side.name: runner(side, batches, 1)}, warmup=1, rounds=2)[side.name]
    except Exception as error:  # noqa: BLE001
        failure(skipped, f"{side.name}, {label}: batch {size} timing failed", error)
        side.zero_grad()
        free_memory()
        return
    batches = None
    side.zero_grad()
    free_memory()
    rate = median([size / (ms * 1e-3) for ms in times])
    figures.append(
        figure(
            f"{side.name} {MODEL} step, batch {size} (largest), {label}",
            rate,
            "samples/s",
            note=f"{len(times)} rounds of 1 step after 1 warm-up",
        )  # fmt: skip
    )
    mfu_figure(figures, f"{side.name} {MODEL} MFU, batch {size} (largest), {label}", rate)


def main() -> None:
    out = parse_out()
    dev = device()
    figures: list[dict] = []
    skipped: list[str] = []
    extra: dict = {"budget_s": BUDGET_S}

    def save() -> None:
        write_part(out, "vit_step", figures, skipped=skipped, extra=extra)

    torch.manual_seed(0)
    run_root = Path(tempfile.mkdtemp(prefix="clipkit-vit-step-"))
    sides: dict = {}
    try:
        clipkit = ClipkitSide(run_root / "run")
        sides["clipkit"] = clipkit
        log(f"clipkit trainer built: {clipkit.summary}")
    except Exception as error:  # noqa: BLE001
        failure(skipped, "clipkit: building the trainer failed", error)
        save()
        raise
    batches = [
        make_batch(BATCH, clipkit.image_size, clipkit.context, clipkit.vocab, seed, dev) for seed in (1, 2)
    ]
    clipkit.batches.extend(batches)
    try:
        half = ClipkitSide(
            run_root / "run-half", "clipkit bf16 similarity", ("train.similarity_precision=half",)
        )
        half.model.load_state_dict(clipkit.model.state_dict())
        half.batches.extend(batches)
        sides[half.name] = half
    except Exception as error:  # noqa: BLE001
        failure(skipped, "clipkit bf16 similarity: building the trainer failed", error)
    mfu_basis(clipkit, batches[0], out, dev, skipped)
    extra["mfu_basis"] = dict(MFU_BASIS)
    try:
        sides["open_clip"] = OpenClipSide(dev, clipkit)
        log(f"open_clip model built: {sides['open_clip'].summary}")
        extra["open_clip"] = sides["open_clip"].version
    except Exception as error:  # noqa: BLE001
        failure(skipped, "open_clip: not measured", error)
    save()

    for checkpointing in (False, True):
        if left() < 10:
            skipped.append(f"{checkpointing_label(checkpointing)}: budget spent ({left():.0f} s left)")
            break
        measure_config(sides, batches, checkpointing, figures, skipped)
        save()

    for checkpointing in (False, True):
        largest_batch_figures(sides, clipkit, dev, checkpointing, figures, skipped, save)
    for side in sides.values():
        side.set_grad_checkpointing(False)

    unit = compile_unit_asked()
    if unit is not None:
        compiled_step(sides, batches, figures, skipped, unit)
    else:
        skipped.append(
            "torch.compile: not run (cold compiles do not fit the part's budget; "
            "CLIPKIT_GPU_VIT_COMPILE=block BUDGET_VIT_STEP=300 runs it, each layer compiled)"
        )
    extra["wall_s"] = round(time.perf_counter() - STARTED, 1)
    save()
    shutil.rmtree(run_root, ignore_errors=True)
    log(f"done in {extra['wall_s']} s")


def mfu_basis(clipkit: ClipkitSide, batch: dict, out: Path, dev: torch.device, skipped: list) -> None:
    """MFU_BASIS: model FLOPs per training sample (clipkit's count) and the device's peak."""
    from clipkit.train.telemetry import peak_tflops, training_flops_per_sample

    try:
        runtime = clipkit.trainer.runtime
        MFU_BASIS["flops_per_sample"] = training_flops_per_sample(
            clipkit.model, batch, BATCH, runtime.autocast()
        )
        measured = read_ceilings(out).get("bf16_tflops" if PRECISION == "bf16" else "fp32_tflops")
        if measured:
            MFU_BASIS.update(peak_tflops=measured, peak_source="measured by part_ceilings.py")
        else:
            setting = "auto" if dev.type == "cuda" else "measure"
            peak, source = peak_tflops(setting, dev, PRECISION)
            MFU_BASIS.update(peak_tflops=peak, peak_source=source)
    except Exception as error:  # noqa: BLE001
        failure(skipped, "MFU basis (FLOP count or peak) failed", error)


def compile_unit_asked() -> str | None:
    """``CLIPKIT_GPU_VIT_COMPILE``: unset or 0 = no compiled step; ``tower`` = each side's towers
    compiled whole; ``block`` or 1 = regional (each transformer layer), the cold compile that fits a
    lease (one layer traced per tower instead of twelve; benchmarks/compile_units.py on the CPU)."""
    asked = os.environ.get("CLIPKIT_GPU_VIT_COMPILE", "").strip().lower()
    if asked in ("", "0"):
        return None
    return "tower" if asked == "tower" else "block"


def compile_open_clip(model: torch.nn.Module, unit: str) -> None:
    """open_clip's model compiled as clipkit's: whole (``model.compile()``, in place), or each
    residual block of its two transformers (``resblocks``, nn.ModuleLists)."""
    if unit == "tower":
        model.compile()
        return
    for transformer in (model.visual.transformer, model.transformer):
        for block in transformer.resblocks:
            block.compile()


def compiled_step(sides: dict, batches: list[dict], figures: list, skipped: list, unit: str) -> None:
    """Optional: both sides with their towers compiled the same way (``unit``: clipkit's
    ``compile_towers``, open_clip's :func:`compile_open_clip`), first step (compile) and steady
    samples/s."""
    from clipkit.train.compile import compile_towers

    for name, side in sides.items():
        try:
            began = time.perf_counter()
            if isinstance(side, OpenClipSide):
                compile_open_clip(side.model, unit)
            else:  # clipkit, also its bf16-similarity side
                compile_towers(side.model, "default", unit)
            runner(side, batches, 1)()
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            first = time.perf_counter() - began
            run = runner(side, batches, STEPS_PER_ROUND)
            times = interleaved_ms({name: run}, warmup=1, rounds=ROUNDS)[name]
            rate = median([BATCH * STEPS_PER_ROUND / (ms * 1e-3) for ms in times])
            log(f"{name}, torch.compile ({unit}): {rate:.0f} samples/s (first step {first:.1f} s)")
            label = f"torch.compile by {unit}"
            figures.append(
                figure(
                    f"{name} {MODEL} step, batch {BATCH}, {label}",
                    rate,
                    "samples/s",
                    note="steady state; the warm compile is the figure below, apart",
                )
            )
            figures.append(
                figure(f"{name} {label}: first step (compile)", first, "s", note="cold Inductor cache")
            )
            mfu_figure(figures, f"{name} {MODEL} MFU, batch {BATCH}, {label}", rate)
        except Exception as error:  # noqa: BLE001
            failure(skipped, f"{name}, torch.compile ({unit}) failed", error)


if __name__ == "__main__":
    main()
