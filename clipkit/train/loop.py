"""The one training loop. Papers differ in plugins and YAML, never here.

Read :func:`train_step` top to bottom — the step module (encode, gather, compare, score:
:class:`clipkit.train.step.TrainingStep`), back-propagate, step — and :func:`train_loop` around it.
Everything distributed or precision-related (DDP or DeepSpeed, autocast, loss scaling, gathers) is
the runtime's (:mod:`clipkit.train.runtime`); building the pieces from a recipe is
:mod:`clipkit.train.build`'s; checkpoints are :mod:`clipkit.train.checkpoint`'s. This module owns
the run's counters (``trainer.skipped_steps``; a checkpoint restores it).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from clipkit.contract.types import LossOutput, optional_member, similarity_metrics
from clipkit.errors import ClipkitError
from clipkit.train import stop
from clipkit.train.accumulate import accumulate_exactly
from clipkit.train.build import build_trainer, prepare_run_dir
from clipkit.train.checkpoint import save_trainer
from clipkit.train.ema import update_ema, weights_to_evaluate
from clipkit.train.runtime import rng_state, set_rng_state
from clipkit.train.telemetry import NoClock, PhaseClock, Telemetry, peak_tflops, training_flops_per_sample
from clipkit.train.trainer import RunInfo, Trainer

__all__ = [
    "RunInfo",
    "Trainer",
    "accumulate_exactly",
    "build_trainer",
    "prepare_run_dir",
    "train_loop",
    "train_step",
]


@dataclass
class StepOutcome:
    """One optimiser step: the loss output, whether the update was applied, the gradient norm."""

    out: LossOutput
    applied: bool
    grad_norm: float | None


def train_step(
    trainer: Trainer, batch: dict, step: int, clock: PhaseClock | NoClock | None = None
) -> StepOutcome:
    """Forward, loss, backward and optimiser step for one contrastive batch; ``clock`` times the
    phases (:mod:`clipkit.train.telemetry`)."""
    rt, training_step = trainer.runtime, trainer.step
    epoch = trainer.epoch()  # the fractional epoch of this batch (scheduled losses read it)
    clock = clock or NoClock()
    clock.start()

    def is_finite(out: LossOutput) -> bool:
        return loss_is_finite(trainer, out, step)

    if rt.plan.micro_batches > 1:
        # Exact accumulation (train.micro_batch_size): the loss still sees the whole batch.
        out, finite = accumulate_exactly(training_step, trainer.objective, batch, step, epoch, is_finite)
        clock.mark("forward_backward")  # its passes interleave forwards and backwards
    else:
        # 1-4. The step module (clipkit.train.step, wrapped by DDP / DeepSpeed): the towers encode
        # this process's batch in the recipe's precision, the point sets are gathered into the
        # global batch (fp32), the similarity compares them, the loss scores the logits.
        loss, out = training_step(batch, step, epoch)
        # Every process must agree before anyone back-propagates a NaN into shared weights.
        finite = is_finite(out)
        clock.mark("forward")  # with the finiteness agreement
        if finite:
            rt.backward(loss, training_step)  # 5. gradients (loss-scaled under fp16)
            clock.mark("backward")
    if not finite:
        trainer.skipped_steps += 1
        return StepOutcome(out, False, None)
    # 6. Clip, step, zero the gradients. Loss scaling may skip a step whose gradients overflowed.
    result = rt.step(training_step, trainer.optimizer)
    if result.applied:
        # 7. Bounded parameters back into bounds (CLIP's logit scale ≤ 100), as open_clip clamps
        # after its optimiser step: the forward keeps the gradient (clipkit.train.bounds).
        rt.clamp_parameters(trainer.objective.bounds)
    else:
        trainer.skipped_steps += 1
        if result.bad_gradient:  # not loss scaling at work: a non-finite gradient
            handle_nonfinite(trainer, step, f"the gradient norm is {result.grad_norm}")
    clock.mark("optimizer")
    return StepOutcome(out, result.applied, result.grad_norm)


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


def train_loop(trainer: Trainer, *, progress=None) -> dict[str, float]:
    """Run from ``trainer.start_step`` to ``train.steps``; returns the last logged metrics.

    ``progress(done, total, metrics)`` is called after every step (the CLI's progress bar).
    """
    rt, settings = trainer.runtime, trainer.settings
    batches = iter(trainer.stream)
    last: dict[str, float] = {}
    telemetry = start_telemetry(trainer)
    tick, samples = time.perf_counter(), 0
    compiles = settings.compile != "none"  # the first step compiles: timed apart (telemetry)
    trainer.step.train()
    for step in range(trainer.start_step, settings.steps):
        with telemetry.waiting_for_data():  # the data-wait share: time blocked on the loader
            batch = next(batches)
        batch = rt.to_device(batch)
        if trainer.augment is not None:  # uint8 in, float out: cast again (DeepSpeed half precision)
            batch = rt.to_device(trainer.augment(batch, step))
        if telemetry.flops_per_sample is None:  # MFU's numerator: counted once, on the first batch
            telemetry.flops_per_sample = count_flops(trainer, batch)
        outcome = train_step(trainer, batch, step, telemetry.clock)
        lr = trainer.optimizer.param_groups[0]["lr"]  # the lr this step used, before the schedule moves it
        update_ema(trainer.ema, outcome.applied)  # train.ema: after each applied optimiser step
        trainer.schedule.step()

        samples += rt.plan.global_size
        telemetry.steps += 1
        done = step + 1
        if compiles and step == trainer.start_step:  # the warm compile, apart from the steady speed
            tick, samples = warm_compile(telemetry, time.perf_counter() - tick, rt.is_main), 0
        if done % settings.log_every == 0 or done == settings.steps:
            elapsed, tick = time.perf_counter() - tick, time.perf_counter()
            last = step_metrics(trainer, outcome, samples / max(elapsed, 1e-9), lr)
            if telemetry.compile_warmup_s is not None and not telemetry.steps:  # only the warm compile
                del last["samples_per_s"]  # since the last line: no steady speed to report
            last.update(telemetry.interval_metrics(samples, elapsed))
            samples = 0
            if rt.is_main:
                trainer.registry.pm.hook.on_metrics(step=done, metrics=last, run=trainer.run)
        if settings.eval_every and done % settings.eval_every == 0 and done < settings.steps:
            evaluate_during_training(trainer, done)
        if done % settings.checkpoint_every == 0 or done == settings.steps:
            save_trainer(trainer, done)
        if stop.requested(rt):  # SIGTERM/SIGINT (clipkit.train.stop): checkpoint this step, then exit
            stop.stop(trainer, done, save_trainer)
        if progress is not None and rt.is_main:
            progress(done, settings.steps, last)
    return last


def step_metrics(trainer: Trainer, outcome: StepOutcome, samples_per_s: float, lr: float) -> dict[str, float]:
    """The logged numbers of a step (every process computes them: reading a ZeRO-3 similarity's
    parameters gathers them); ``lr`` is the learning rate the step used."""
    rt, stream, out = trainer.runtime, trainer.stream, outcome.out
    metrics = {"loss": float(out.loss.detach()), "lr": lr, "epoch": trainer.epoch()}
    metrics.update({k: float(v) for k, v in out.metrics.items()})
    with rt.gathered(trainer.model.similarity):
        metrics.update(similarity_metrics(trainer.model.similarity))
    if outcome.grad_norm is not None:
        metrics["grad_norm"] = outcome.grad_norm
    metrics["skipped_steps"] = trainer.skipped_steps
    if hasattr(stream, "metrics"):  # samples per source, shards skipped by reason (streamed data)
        metrics.update(stream.metrics())
    metrics["samples_per_s"] = samples_per_s
    return {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}


def warm_compile(telemetry: Telemetry, seconds: float, announce: bool) -> float:
    """Report the first step's wall time (TorchDynamo traces, Inductor compiles) apart and restart
    the interval after it; returns the new interval's start."""
    telemetry.warm_compile(seconds)
    if announce:
        print(
            f"train.compile: the first step took {seconds:.1f} s (warm compile: tracing and compiling the "
            "graphs); samples/s and the step split leave it out",
            file=sys.stderr,
        )
    return time.perf_counter()


def start_telemetry(trainer: Trainer) -> Telemetry:
    """The run's :class:`Telemetry`, with the device's peak resolved once (printed where MFU is
    omitted or the peak measured)."""
    rt = trainer.runtime
    peak, source = peak_tflops(trainer.settings.peak_tflops, rt.device, trainer.settings.precision)
    if rt.is_main and (peak is None or source.startswith("measured")):
        print(f"telemetry: {source}" + (f": {peak:.3g} TFLOP/s" if peak else ""), file=sys.stderr)
    return Telemetry(rt.device, rt.world_size, peak)


def count_flops(trainer: Trainer, batch: dict) -> float:
    """Model FLOPs of one training sample (:func:`training_flops_per_sample`); 0.0, with the reason
    printed, where they cannot be counted (then no MFU is logged)."""
    rt = trainer.runtime
    try:
        if rt.partitions_weights:
            raise RuntimeError("the strategy shards the weights (ZeRO-3, FSDP2): no forward outside the step")
        return training_flops_per_sample(trainer.model, batch, rt.plan.local_size, rt.autocast())
    except Exception as error:  # noqa: BLE001 - telemetry must never stop a run
        if rt.is_main:
            print(
                f"telemetry: model FLOPs not counted, no MFU ({type(error).__name__}: {error})",
                file=sys.stderr,
            )
        return 0.0


def evaluate_during_training(trainer: Trainer, step: int) -> list[dict]:
    """Run the recipe's eval tasks on the in-memory model — the code ``clipkit eval`` runs on an
    export — and log their float metrics as ``eval/<task>/<metric>`` at ``step``.

    Evaluation must not change training: the RNG states are restored afterwards (so a run with
    evaluation takes the same steps as one without), and the model goes back to train mode.
    """
    from clipkit.eval.evaluate import run_evals
    from clipkit.eval.report import metric_rows, task_label
    from clipkit.model import build_model

    tasks = trainer.recipe.get("eval") or []
    if not tasks:
        return []
    rebuild = lambda: build_model(trainer.recipe, trainer.registry)  # noqa: E731
    model = trainer.runtime.model_for_evaluation(
        trainer.step, trainer.model, rebuild
    )  # every process (ZeRO gathers)
    if model is None:
        return []
    results, metrics = [], {}
    for prefix, weights in weights_to_evaluate(trainer.ema, model, rebuild):  # live and/or EMA
        saved = rng_state()
        try:
            scored = run_evals(weights, tasks, trainer.registry)
        finally:
            model.train()
            set_rng_state(saved)
        results += scored
        metrics.update(
            {f"{prefix}/{task_label(r)}/{key}": r[key] for r in scored for key, _ in metric_rows(r)}
        )
    trainer.registry.pm.hook.on_metrics(step=step, metrics=metrics, run=trainer.run)
    return results
