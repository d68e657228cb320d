"""Framework overhead: seconds per step of clipkit's ``train_loop`` vs a bare PyTorch loop, same model.

For each recipe (default ``clip@tiny`` and ``wpse@tiny``) the script builds clipkit's trainer
(``clipkit.train.build.build_trainer``), reads a few real batches from its loader into memory, and
then times, on those same in-memory batches:

- clipkit: ``train_loop(trainer)``, with ``trainer.stream`` replaced by
  :class:`clipkit.data.memory.InMemoryStream`
  (data loading is excluded, and identical for both loops);
- bare: a plain loop on a deep copy of the same model (same weights, same modules): towers ->
  the model's similarity -> cross-entropy both ways -> ``backward`` -> ``torch.optim.AdamW``
  (the same parameter groups and hyper-parameters) -> a warm-up-cosine ``LambdaLR``; every
  ``train.log_every`` steps it reads the loss as a float (what a loop's logging costs at least);
- clipkit without telemetry: ``train_loop`` with :mod:`clipkit.train.telemetry` replaced by a
  stand-in that measures nothing (no data-wait timer, no phase clock, no FLOP count, no telemetry
  fields), so telemetry on / off in the same round is the telemetry's cost;
- with ``--compile MODE`` also both loops with ``clipkit.train.compile.compile_towers(model, MODE)``:
  the towers' compile time (the first step of the untimed warm-up run) is reported apart from
  the steady step time. The Inductor cache starts empty (a temporary ``TORCHINDUCTOR_CACHE_DIR``
  unless one is set): the first compiled runner of a recipe (clipkit's) compiles cold; the second
  (bare, the same tower classes) re-uses that work, so its first step is not a compile time.

Each run is ``--steps`` steps; the first step of a run (loop set-up) and the last (clipkit
writes its end-of-run checkpoint there) are not timed, the steps in between are. Every runner
does one untimed warm-up run, then ``--repeats`` rounds each run every runner once in a
shuffled order (so drifting load from other processes hits all runners alike). The tables give
the median and best over rounds of the mean step time, as wall clock and as the process's CPU
time (which counts little of the waiting for a core that other processes hold), and the median
over rounds of clipkit / bare in the same round. The learning rate
reaches 0 after the first run of each loop (the schedule keeps counting); AdamW's cost does not
depend on it. One thread (``torch.set_num_threads(1)``). Usage (from the repository root):

    python benchmarks/overhead.py [--recipes clip@tiny wpse@tiny] [--steps 22] [--repeats 10]
        [--batches 8] [--compile default] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from measure import clocks, interleaved, machine_line, markdown_header, ratio_spread, spread
from torch import nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["clip@tiny", "wpse@tiny"])
    parser.add_argument("--steps", type=int, default=22, help="steps per run (the first and last not timed)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (after one warm-up run each)")
    parser.add_argument("--batches", type=int, default=8, help="distinct real batches held in memory")
    parser.add_argument(
        "--compile", nargs="*", default=[], help="also time both loops with compile_towers(model, MODE)"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra recipe overrides")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 = per core)")
    return parser.parse_args()


# --- the two loops: each runner does one run of `steps` steps and returns its clocks() at each step end ---


def clipkit_runner(
    trainer, batches: list[dict], batch_size: int, *, telemetry: bool = True
) -> Callable[[int], list[tuple[float, float]]]:
    """Runs ``train_loop`` from step 0 to ``train.steps`` on in-memory batches (``telemetry``
    False: with :class:`NoTelemetry` instead of the loop's own)."""
    from unittest import mock

    from clipkit.config.recipe import section
    from clipkit.data.memory import InMemoryStream
    from clipkit.train import loop

    def run(steps: int) -> list[tuple[float, float]]:
        assert section(trainer.recipe, "train").steps == steps
        trainer.start_step = 0
        trainer.stream = InMemoryStream(batches)
        ends = [clocks()]
        patch = (
            contextlib.nullcontext() if telemetry else mock.patch.object(loop, "start_telemetry", NoTelemetry)
        )
        with patch:
            loop.train_loop(trainer, progress=lambda done, total, metrics: ends.append(clocks()))
        return ends

    return run


class NoTelemetry:
    """The loop's telemetry, measuring nothing: what ``train_loop`` cost before it had telemetry."""

    flops_per_sample = 0.0  # never counted

    def __init__(self, trainer) -> None:
        from clipkit.train.telemetry import NoClock

        self.clock, self.steps = NoClock(), 0

    def waiting_for_data(self):
        return contextlib.nullcontext()

    def interval_metrics(self, samples: int, elapsed_s: float) -> dict:
        return {}


def bare_runner(
    model: nn.Module, optimizer, batches: list[dict], recipe: dict
) -> Callable[[int], list[tuple[float, float]]]:
    """A plain PyTorch loop: what a user writes for this model without a framework."""
    from clipkit.config.recipe import section

    train = section(recipe, "train")
    seed, log_every, total = int(recipe.get("seed", 0)), int(train.log_every), int(train.steps)
    warmup = int(recipe["schedule"].get("warmup_steps", 0))

    def warmup_cosine(step: int) -> float:
        warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return warm * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, step - warmup) / max(1, total - warmup))))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    fresh_features = bool(getattr(model.similarity, "uses_random_features", False))  # WPSE
    losses: list[float] = []

    def run(steps: int) -> list[tuple[float, float]]:
        model.train()
        ends = [clocks()]
        for step in range(steps):
            batch = batches[step % len(batches)]
            image_points = model.image_encoder(batch["image"])
            text_points = model.text_encoder(batch["text"])
            # WPSE draws fresh random features every step, seeded by the step as clipkit does.
            generator = torch.Generator().manual_seed(seed * 1_000_003 + step) if fresh_features else None
            logits = model.similarity(image_points, text_points, generator=generator)
            targets = torch.arange(logits.i2t.shape[0])
            loss = (
                nn.functional.cross_entropy(logits.i2t, targets)
                + nn.functional.cross_entropy(logits.t2i, targets)
            ) / 2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if (step + 1) % log_every == 0:
                losses.append(loss.detach().item())
            ends.append(clocks())
        return ends

    return run


def same_optimizer_for(model: nn.Module, source_model: nn.Module, source_optimizer) -> torch.optim.AdamW:
    """A fresh ``torch.optim.AdamW`` over ``model`` (a copy of ``source_model``) with the source
    optimizer's parameter groups and hyper-parameters."""
    index = {id(p): i for i, p in enumerate(source_model.parameters())}
    params = list(model.parameters())
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [params[index[id(p)]] for p in group["params"]],
        }
        for group in source_optimizer.param_groups
    ]
    return torch.optim.AdamW(groups)


# --- setting up one recipe ---


def build(spec: str, overrides: list[str], steps: int, root: Path, name: str):
    """(trainer, unwrapped model) of ``spec`` on a small temporary shard set; nothing trained yet."""
    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry
    from clipkit.train.build import build_trainer, prepare_run_dir

    registry = default_registry()
    recipe = resolve(spec, [], registry)
    batch_size = int(recipe["data"]["batch_size"])
    source = f"synthetic://shapes?n={batch_size * 8}&split=train&image_size={recipe['model']['image_size']}"
    recipe = resolve(
        spec,
        [
            f"data.shards={root / ('shards-' + name)}",
            f"data.source={source}",
            "data.num_workers=0",
            f"train.threads={torch.get_num_threads()}",  # keep --threads (train.threads would pick the CPUs)
            f"train.steps={steps}",
            f"train.checkpoint_every={steps}",  # the checkpoint is written in the last (untimed) step
            "train.export=false",
            "train.eval_every=0",
            *overrides,
        ],
        registry,
    )
    run_dir = root / f"run-{name}"
    prepare_run_dir(recipe, run_dir, resume=False)
    trainer = build_trainer(recipe, run_dir, registry)
    return trainer, trainer.model


def runners_for(spec: str, args: argparse.Namespace, root: Path) -> tuple[dict[str, Callable], dict, str]:
    """{label: runner} for one recipe (eager, and compiled per --compile mode), the recipe, a summary."""
    from clipkit.config.recipe import section
    from clipkit.train.compile import compile_towers

    slug = spec.replace("@", "-").replace("+", "-")
    trainer, model = build(spec, args.set, args.steps, root, slug)
    if model.pair != "image_text":
        raise SystemExit(
            f"{spec}: the bare loop is written for image-text recipes, not model.pair {model.pair}"
        )
    recipe, batch_size = trainer.recipe, int(trainer.recipe["data"]["batch_size"])
    batches = list(itertools.islice(iter(trainer.stream), args.batches))
    initial = copy.deepcopy(model)
    bare_model = copy.deepcopy(initial)
    runners = {
        "clipkit train_loop": clipkit_runner(trainer, batches, batch_size),
        "clipkit train_loop, telemetry off": clipkit_runner(trainer, batches, batch_size, telemetry=False),
        "bare PyTorch loop": bare_runner(
            bare_model, same_optimizer_for(bare_model, model, trainer.optimizer), batches, recipe
        ),
    }
    for mode in args.compile:
        compiled_trainer, compiled_model = build(spec, args.set, args.steps, root, f"{slug}-{mode}")
        compiled_model.load_state_dict(initial.state_dict())
        compile_towers(compiled_model, mode)
        runners[f"clipkit train_loop, compile_towers({mode})"] = clipkit_runner(
            compiled_trainer, batches, batch_size
        )
        bare_compiled = compile_towers(copy.deepcopy(initial), mode)
        runners[f"bare PyTorch loop, compile_towers({mode})"] = bare_runner(
            bare_compiled, same_optimizer_for(bare_compiled, model, trainer.optimizer), batches, recipe
        )
    parameters = sum(p.numel() for p in model.parameters())
    train = section(recipe, "train")
    summary = (
        f"{spec}: {type(model.image_encoder).__name__} + {type(model.text_encoder).__name__}, "
        f"similarity {recipe['similarity']['name']}, {parameters / 1e3:.0f} k parameters, "
        f"batch {batch_size}, "
        f"{recipe['model']['image_size']} px, precision {train.precision}, "
        f"log_every {train.log_every}"
    )
    return runners, recipe, summary


# --- timing ---


def mean_step(ends: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean (wall, CPU) seconds per step of one run, without its first and last step."""
    (wall_start, cpu_start), (wall_stop, cpu_stop) = ends[1], ends[-2]
    steps = len(ends) - 3
    return (wall_stop - wall_start) / steps, (cpu_stop - cpu_start) / steps


def time_runners(runners: dict[str, Callable], steps: int, repeats: int) -> tuple[dict, dict]:
    """({label: [(wall, CPU) mean step seconds of each round]}, {label: first-step wall seconds of
    the warm-up run, where compilation happens})."""
    first_steps = {}
    for label, run in runners.items():
        ends = run(steps)
        first_steps[label] = ends[1][0] - ends[0][0]
    rounds = {label: (lambda run=run: mean_step(run(steps))) for label, run in runners.items()}
    return interleaved(rounds, repeats), first_steps


def bare_label_of(label: str) -> str:
    """The bare loop a row compares with: the same compile setting."""
    return "bare PyTorch loop" + label.partition("loop")[2].replace(", telemetry off", "")


def telemetry_cpu_us(log_every: int, steps: int = 20000) -> float:
    """CPU microseconds per step of the loop's telemetry calls alone (the data-wait timer, the
    phase clock's start and three marks, and every ``log_every`` steps the log line's fields): a
    figure without the noise of timing two whole loops against each other."""
    from clipkit.train.telemetry import Telemetry

    measured = Telemetry(torch.device("cpu"), 1, peak=1.0, flops_per_sample=1e9)
    began = time.process_time()
    for step in range(steps):
        with measured.waiting_for_data():
            pass
        measured.clock.start()
        for phase in ("forward", "backward", "optimizer"):
            measured.clock.mark(phase)
        measured.steps += 1
        if (step + 1) % log_every == 0:
            measured.interval_metrics(64, 1.0)
    return (time.process_time() - began) / steps * 1e6


def print_table(
    summary: str, means: dict[str, list], first_steps: dict[str, float], log_every: int = 10
) -> None:
    print()
    print(summary)
    print()
    print(
        markdown_header(
            "loop", "wall ms/step (median)", "wall ms/step (best)", "CPU ms/step (median)",
            "CPU ms/step (best)", "× bare, wall", "× bare, CPU", "first step, s",
        )
    )  # fmt: skip
    for label, values in means.items():
        wall, cpu = zip(*values, strict=True)
        bare_wall, bare_cpu = zip(*means[bare_label_of(label)], strict=True)
        print(
            f"| {label} | {statistics.median(wall) * 1e3:.2f} | {min(wall) * 1e3:.2f} | "
            f"{statistics.median(cpu) * 1e3:.2f} | {min(cpu) * 1e3:.2f} | "
            f"{ratio_spread(wall, bare_wall)} | {ratio_spread(cpu, bare_cpu)} | {first_steps[label]:.2f} |"
        )
    if "clipkit train_loop, telemetry off" in means:
        on, off = means["clipkit train_loop"], means["clipkit train_loop, telemetry off"]
        print(
            f"telemetry on / off, CPU time per round: {ratio_spread([a[1] for a in on], [b[1] for b in off])}"
        )
        alone = telemetry_cpu_us(log_every)
        step_us = statistics.median(cpu for _, cpu in on) * 1e6
        print(f"telemetry alone: {alone:.1f} µs CPU per step = {100 * alone / step_us:.3f} % of the step")
    for label in means:
        if "compile_towers" in label:
            eager = label.partition(", compile_towers")[0]
            ratios = [a[1] / b[1] for a, b in zip(means[label], means[eager], strict=True)]
            print(f"{label} / {eager}, CPU time per round: {spread(ratios)}")
    print()
    print(
        "× bare: the median over rounds of (this loop's step time / the bare loop's in the same round), "
        "with the lowest and highest round in brackets."
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import accelerate

    import clipkit

    print(machine_line(("accelerate", accelerate.__version__), ("clipkit", clipkit.__version__)))
    print(
        f"{args.steps} steps per run ({args.steps - 2} timed), {args.repeats} rounds after a warm-up run, "
        f"{args.batches} in-memory batches"
    )
    with tempfile.TemporaryDirectory(prefix="clipkit-overhead-") as folder:
        root = Path(folder)
        if args.compile and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            # An empty Inductor cache, so the first compiled runner's first step is a cold compile.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor-cache")
        for spec in args.recipes:
            runners, recipe, summary = runners_for(spec, args, root)
            means, first_steps = time_runners(runners, args.steps, args.repeats)
            print_table(summary, means, first_steps, int(recipe["train"]["log_every"]))


if __name__ == "__main__":
    main()
