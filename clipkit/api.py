"""One typed function per CLI command; the CLI only parses arguments and prints.

Usable from Python too::

    from clipkit import api
    result = api.train("quickstart", ["train.steps=100"])
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipkit.errors import ClipkitError
from clipkit.registry import Registry, default_registry


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict[str, Any]
    export_dir: Path | None = None
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def resolve(spec: str, overrides: list[str], registry: Registry | None = None) -> dict:
    """Load and validate ``NAME[@VARIANT]`` + overrides (raises RecipeError listing every problem)."""
    from clipkit.recipe import load_recipe, validate_or_raise

    registry = registry or default_registry()
    return validate_or_raise(load_recipe(spec, overrides, registry=registry), registry)


def default_run_dir(recipe: dict) -> Path:
    slug = recipe["name"].replace("@", "-").replace("/", "-")
    return Path("runs") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def shard(
    source: str,
    out: Path,
    *,
    samples_per_shard: int = 1000,
    max_shard_bytes: int | str | None = None,
    options: dict | None = None,
    registry: Registry | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Write ``source`` as WebDataset shards + manifest.json in ``out``; returns the manifest.

    An interrupted run leaves ``out.partial``; calling again with the same arguments continues it.
    """
    from clipkit.download import Downloader
    from clipkit.shard import open_source
    from clipkit.shard_writer import write_shards

    # Options that change how fast or how patiently samples arrive, not what they are: an
    # interrupted `clipkit shard` may be resumed with other values (e.g. a longer timeout).
    resume_may_change = {"workers", *Downloader.PATIENCE_OPTIONS}

    registry = registry or default_registry()
    opened = open_source(source, options, pm=registry.pm)
    return write_shards(
        opened,
        out,
        source=source,
        info=opened.info(),
        samples_per_shard=samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        settings={key: value for key, value in (options or {}).items() if key not in resume_may_change},
        progress=progress,
    )


def verify(directory: Path) -> dict:
    """Check a shard set against its manifest: ``{"n", "shards", "problems"}`` (empty = intact)."""
    from clipkit.shard import verify_shards

    return verify_shards(directory)


def train(
    spec: str,
    overrides: list[str] | None = None,
    *,
    run_dir: Path | None = None,
    resume: bool = False,
    registry: Registry | None = None,
    progress=None,
) -> TrainResult:
    """Train a recipe; then, if ``train.export``, export to RUN/export and run its eval tasks."""
    from clipkit.recipe import section, validate_or_raise
    from clipkit.train import build_trainer, prepare_run_dir, train_loop

    registry = registry or default_registry()
    started = time.perf_counter()
    if resume:
        if run_dir is None:
            raise ClipkitError("--resume needs --run-dir (the run to continue)")
        recipe = validate_or_raise(resume_recipe(Path(run_dir), overrides or [], registry), registry)
        if spec != recipe["name"]:
            raise ClipkitError(f"{run_dir} is a run of recipe {recipe['name']!r}, not {spec!r}")
    else:
        recipe = resolve(spec, overrides or [], registry)
        run_dir = Path(run_dir) if run_dir else default_run_dir(recipe)
    prepare_run_dir(recipe, run_dir, resume=resume)
    trainer = build_trainer(recipe, run_dir, registry, resume=resume)
    metrics = train_loop(trainer, progress=progress)
    result = TrainResult(run_dir=Path(run_dir), metrics=metrics)
    if section(recipe, "train").export and trainer.runtime.is_main:
        result.export_dir = export(run_dir, Path(run_dir) / "export", registry=registry)
        if recipe.get("eval"):
            report = evaluate(result.export_dir, None, registry=registry, output=Path(run_dir) / "eval.json")
            result.evals = report["results"]
    result.seconds = time.perf_counter() - started
    return result


def resume_recipe(run_dir: Path, overrides: list[str], registry: Registry) -> dict:
    """The run's saved recipe with extra overrides (e.g. more ``train.steps``)."""
    from omegaconf import OmegaConf

    from clipkit.recipe import apply_overrides

    path = run_dir / "recipe.yaml"
    if not path.is_file():
        raise ClipkitError(f"{run_dir}: cannot resume, recipe.yaml is missing")
    config = OmegaConf.load(path)
    apply_overrides(config, overrides, str(path))
    recipe = OmegaConf.to_container(config, resolve=True)
    recipe["overrides"] = list(recipe.get("overrides") or []) + list(overrides)
    return recipe


def export(
    run_dir: Path, out: Path, *, checkpoint: Path | None = None, registry: Registry | None = None
) -> Path:
    from clipkit.export import export_run

    return export_run(Path(run_dir), Path(out), registry or default_registry(), checkpoint)


def evaluate(
    export_dir: Path,
    tasks: list[dict] | None,
    *,
    registry: Registry | None = None,
    output: Path | None = None,
) -> dict:
    """Run eval tasks (default: the export's recipe's) on an export; writes JSON to ``output``."""
    from clipkit.evaluate import evaluate_export
    from clipkit.io import atomic_write_text

    report = evaluate_export(Path(export_dir), tasks, registry or default_registry())
    if output is not None:
        atomic_write_text(output, json.dumps(report, indent=2) + "\n")
    return report
