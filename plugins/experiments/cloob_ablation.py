"""CLOOB's 2×2 ablation as one command: {InfoNCE, InfoLOOB} × {Hopfield off, on} on your data.

Seed 001 (CLOOB) Table 3 / §4: on Conceptual Captions, InfoLOOB and Hopfield retrieval each help
zero-shot, and together (CLOOB) most; its analyses (§4, Fig. 3 and A1) read the embeddings'
uniformity and effective eigenvalues. This command trains the four arms from the ``cloob``
recipe's ablation variants (``infonce``, ``infoloob``, ``infonce_hopfield``, and the default
``cloob`` = InfoLOOB + Hopfield), each over several seeds, on a table or shard set you name, holds
out a split of it (by key hash, the rule of ``clipkit train --data --holdout``), and evaluates
every run there: retrieval, zero-shot over a label column (if named) and the diagnostics.

What is held fixed, as in the paper: inverse temperature 1/τ = 30 (never learned), Hopfield β
(default 8, the CC recipe's), the warm-up as a *fraction* of the run (the paper's 20 000 of
175 584 steps = 11.4 %), cosine with one hard-restart cycle per run, the batch (default 256).
Only the loss and the Hopfield switch change between arms.

``base`` picks the recipe size: ``tiny`` (the ``+tiny`` variant: rn_tiny + a 2-layer text
Transformer at 64 px, CPU-sized) or ``paper`` (the recipe as published: RN50 + CLIP's text
Transformer at 224 px, fp16 — a GPU setting). ``overrides`` are any further ``key=value``.

Entry point: :func:`run_ablation` (CLI: ``clipkit experiment cloob-ablation``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipkit.errors import ClipkitError
from clipkit.plugins.experiments.cloob_ablation_report import ARMS, summarise, write_report

#: The paper's warm-up fraction: 20 000 warm-up steps of 175 584 (31 epochs of CC at batch 512).
PAPER_WARMUP_FRACTION = 20_000 / 175_584


@dataclass
class AblationSettings:
    """The settings every arm shares (see the module docstring)."""

    data: str
    label: str | None = None
    holdout: float = 0.1
    steps: int = 200
    batch_size: int = 256
    warmup_fraction: float = PAPER_WARMUP_FRACTION
    beta: float = 8.0
    inverse_tau: float = 30.0
    base: str = "tiny"
    arms: Sequence[str] = tuple(ARMS)
    seeds: Sequence[int] = (0, 1, 2)
    overrides: list[str] = field(default_factory=list)

    def check(self) -> None:
        unknown = [arm for arm in self.arms if arm not in ARMS]
        if unknown:
            raise ClipkitError(f"cloob-ablation: unknown arm(s) {unknown}; choose from {list(ARMS)}")
        if self.base not in ("tiny", "paper"):
            raise ClipkitError(f"cloob-ablation: --base must be tiny or paper, got {self.base!r}")
        if self.steps < 1 or self.batch_size < 2 or not self.seeds:
            raise ClipkitError("cloob-ablation: needs --steps >= 1, --batch-size >= 2 and at least one seed")
        if not 0 <= self.warmup_fraction < 1:
            raise ClipkitError(
                f"cloob-ablation: --warmup-fraction must be in [0, 1), got {self.warmup_fraction}"
            )
        if not 0 < self.holdout < 1:
            raise ClipkitError(f"cloob-ablation: --holdout must be in (0, 1), got {self.holdout}")

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_fraction * self.steps)


def arm_recipe(arm: str, settings: AblationSettings) -> tuple[str, list[str]]:
    """(recipe spec, overrides) of one arm: the ablation variant, the shared fixed settings, the
    user's data (sharded once, a held-out split evaluated) and the user's overrides last."""
    from clipkit.app.own_data import holdout_uri, own_data_overrides

    variant = ARMS[arm][0]
    spec = variant if settings.base != "tiny" else f"{variant}+tiny" if "@" in variant else f"{variant}@tiny"
    data_overrides, _ = own_data_overrides(settings.data, holdout=settings.holdout, label=settings.label)
    data_overrides = [item for item in data_overrides if not item.startswith("eval=")]
    shards = json.loads(next(item for item in data_overrides if item.startswith("data.shards="))[12:])
    held_out = holdout_uri(shards, settings.holdout)
    tasks = [{"name": "retrieval", "data": held_out}, {"name": "diagnostics", "data": held_out}]
    if settings.label:
        tasks.insert(0, {"name": "zero_shot", "data": held_out, "label": settings.label})
    fixed = [
        f"data.batch_size={settings.batch_size}",
        f"train.steps={settings.steps}",
        f"schedule.warmup_steps={settings.warmup_steps}",
        f"schedule.cycle_steps={settings.steps}",  # one cosine cycle per run (no restart inside it)
        f"loss.inverse_tau={settings.inverse_tau}" if ARMS[arm][1] == "InfoLOOB" and ARMS[arm][2] else None,
        f"similarity.inverse_tau={settings.inverse_tau}"
        if ARMS[arm][2]
        else f"similarity.init_scale={settings.inverse_tau}",
        f"similarity.beta={settings.beta}" if ARMS[arm][2] else None,
        "train.checkpoint_every=" + str(settings.steps),
        f"eval={json.dumps(tasks)}",
    ]
    return spec, [*data_overrides, *[item for item in fixed if item], *settings.overrides]


def run_ablation(
    settings: AblationSettings, out_dir: Path, *, registry=None, progress=None
) -> dict[str, Any]:
    """Train and evaluate every arm × seed into ``out_dir``/ARM/seed-S; aggregate; write the report."""
    from clipkit.app import api

    settings.check()
    out_dir = Path(out_dir)
    runs = []
    recipes = {arm: arm_recipe(arm, settings) for arm in settings.arms}
    for seed in settings.seeds:  # seed-major: an interrupted study still has every arm of its first seeds
        for arm in settings.arms:
            spec, overrides = recipes[arm]
            started = time.process_time()
            run_dir = out_dir / arm / f"seed-{seed}"
            result = api.train(spec, [*overrides, f"seed={seed}"], run_dir=run_dir, registry=registry)
            run = {
                "arm": arm,
                "seed": seed,
                "run_dir": str(run_dir),
                "cpu_seconds": time.process_time() - started,
                "final_loss": result.metrics.get("loss"),
                "evals": result.evals,
            }
            runs.append(run)
            if progress is not None:
                progress(run)
    report = {
        "config": {
            **{k: v for k, v in settings.__dict__.items() if k != "arms"},
            "arms": list(settings.arms),
            "seeds": list(settings.seeds),
            "warmup_steps": settings.warmup_steps,
            "recipes": {arm: recipes[arm][0] for arm in settings.arms},
        },
        "runs": runs,
        **summarise(runs, list(settings.arms)),
    }
    write_report(report, out_dir)
    return report
