"""Evaluation helpers shared by eval plugins, and the runner behind ``clipkit eval``.

Scores always go through the model's own similarity (never a hard-coded cosine × 100),
so every similarity clipkit has — including ones that do not factorise into embeddings —
can be evaluated. Random-feature similarities get a generator re-seeded with the export's
``eval_seed`` on every call, so images and texts see the same features.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from clipkit.contract.registry import Registry
from clipkit.contract.types import PointSet, Sample, optional_member
from clipkit.data.shard import open_source
from clipkit.data.transforms import decode_for_eval
from clipkit.errors import ClipkitError, DataError
from clipkit.eval.metrics import topk_accuracy  # noqa: F401 — re-exported: eval plugins import it from here
from clipkit.model import ContrastiveModel, build_slot


def eval_generator(model: ContrastiveModel, seed: int | None = None) -> torch.Generator:
    """A generator seeded with ``seed`` (default: the export's ``eval_seed``)."""
    generator = torch.Generator()
    generator.manual_seed(int(getattr(model, "eval_seed", 0) if seed is None else seed))
    return generator


def uses_random_features(model: ContrastiveModel) -> bool:
    """Whether the model's similarity draws random features (WPSE): its scores depend on the seed."""
    return bool(optional_member(model.similarity, "uses_random_features"))


def feature_seeds(model: ContrastiveModel, repeats: int | None) -> list[int]:
    """The random-feature seeds an eval repeats over: ``eval_seed, eval_seed + 1, ...``.

    ``repeats`` None means 5 for random-feature similarities (mean ± std over feature draws, as
    the WPSE paper reports) and 1 otherwise; a deterministic similarity never needs more than one.
    """
    count = (5 if uses_random_features(model) else 1) if repeats is None else int(repeats)
    if count < 1:
        raise ClipkitError(f"feature_seeds must be >= 1, got {count}")
    if not uses_random_features(model):
        count = 1
    base = int(getattr(model, "eval_seed", 0))
    return [base + i for i in range(count)]


def mean_and_std(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over repeated evals; with several runs also ``<key>_std`` (sample std)."""
    summary: dict[str, float] = {}
    for key in runs[0]:
        values = torch.tensor([run[key] for run in runs], dtype=torch.float64)
        summary[key] = float(values.mean())
        if len(runs) > 1:
            summary[f"{key}_std"] = float(values.std())
    return summary


@torch.no_grad()
def encode_images(model: ContrastiveModel, samples: Sequence[Sample], batch_size: int = 256) -> PointSet:
    """Decode, preprocess (eval transform) and encode -> PointSet [len(samples), M_x, d] (fp32).

    Preprocessing is :func:`~clipkit.data.transforms.decode_for_eval`: pixel-identical to
    torchvision's / open_clip's eval transform on the PIL image (full-size decode, PIL bicubic)."""
    parts = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        images = torch.stack([decode_for_eval(s.image, model.transform, f"sample {s.key}") for s in chunk])
        parts.append(model.encode_image(images).float())
    return PointSet.cat(parts)


@torch.no_grad()
def encode_texts(model: ContrastiveModel, texts: Sequence[str], batch_size: int = 256) -> PointSet:
    """Tokenize and encode -> PointSet [len(texts), M_y, d] (fp32)."""
    parts = []
    for start in range(0, len(texts), batch_size):
        parts.append(model.encode_text(model.tokenizer(list(texts[start : start + batch_size]))).float())
    return PointSet.cat(parts)


@torch.no_grad()
def image_text_logits(
    model: ContrastiveModel, images: PointSet, texts: PointSet, chunk: int = 1024, seed: int | None = None
) -> torch.Tensor:
    """[N_images, N_texts] similarity logits, computed in image chunks (memory: chunk × N_texts
    logits; a similarity may recompute the texts' side once per chunk, e.g. WPSE's features).

    Every chunk gets a generator seeded identically (``seed``, default the export's eval_seed), so
    a random-feature similarity uses one feature draw for the whole matrix.
    """
    rows = []
    for start in range(0, images.batch_size, chunk):
        part = images.rows(start, start + chunk)
        rows.append(model.similarity(part, texts, generator=eval_generator(model, seed)).i2t)
    return torch.cat(rows)


@torch.no_grad()
def embed_points(model: ContrastiveModel, points: PointSet) -> tuple[torch.Tensor, bool]:
    """[B, M, d] -> (the similarity's ``embed`` vector [B, D] with the export's eval features, True),
    or (the weighted point mean [B, d], False) when the similarity has no finite embedding (KME).

    The generator is re-seeded on every call, so every chunk of a data set (and the texts) sees
    the same random features, exactly as :func:`image_text_logits` scores them.
    """
    vector = model.similarity.embed(points, generator=eval_generator(model))
    return (points.mean(), False) if vector is None else (vector, True)


def require_counts(task: str, **values) -> None:
    """ClipkitError naming the task's argument unless each value given (not None) is an integer
    >= 1 (``limit``, ``batch_size``, ``feature_seeds``): checked when the task is built, before a
    model loads, instead of a ``range()`` error or "no samples" later."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ClipkitError(f"{task}: {name} must be an integer >= 1, got {value!r}")


#: Warnings about the data the running task read (rows skipped while reading it), gathered by
#: :func:`load_samples` and added to the task's result by :func:`run_evals`: a task plugin need not
#: pass them on for a score computed on fewer rows than its source holds to say so.
DATA_WARNINGS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "data_warnings", default=None
)


def load_samples(data: str, limit: int | None = None, *, registry: Registry) -> tuple[list[Sample], dict]:
    """All samples (up to ``limit``) and the info of the source at ``data``. Rows the source skips
    (an undecodable image, an empty caption: a raw table or folder is read here, not sharded) are
    one warning of the task's result (:func:`skipped_rows_warning`)."""
    source = open_source(data, pm=registry.pm)
    samples: list[Sample] = []
    for sample in source:
        if limit is not None and len(samples) >= limit:
            break
        samples.append(sample)
    warning = skipped_rows_warning(data, source, len(samples))
    gathered = DATA_WARNINGS.get()
    if warning and gathered is not None:  # in run_evals: one of the result's warnings
        gathered.append(warning)
    elif warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if not samples:
        raise DataError(f"{data}: no samples to evaluate" + (f" ({warning})" if warning else ""))
    return samples, dict(source.info())


def skipped_rows_warning(data: str, source: Any, read: int) -> str | None:
    """``DATA: N bad row(s) skipped (reason n, ...; e.g. FILE: line 7: ...): scored on the M read``
    for a source that skipped rows while being read (file sources count them in ``skipped``), else
    None. A shard directory skips nothing here: its rows were counted when it was written."""
    skipped = dict(getattr(source, "skipped", None) or {})
    if not skipped:
        return None
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(skipped.items()))
    examples = list((getattr(source, "skipped_examples", None) or {}).values())
    example = f"; e.g. {examples[0][:200]}" if examples else ""
    total = sum(skipped.values())
    return f"{data}: {total} bad row(s) skipped ({reasons}{example}): scored on the {read} read"


def run_evals(model: ContrastiveModel, tasks: Iterable[dict[str, Any]], registry: Registry) -> list[dict]:
    """Build each eval task by registered name and run it on ``model``.

    A task that fails (bad data, an unknown label, ...) does not stop the others: its result is
    ``{"name", "data", "label", "failed": message}`` (see :func:`failed_tasks`).
    """
    from clipkit.eval.suite import ABOUT, task_arguments

    results = []
    model.eval()
    for i, config in enumerate(tasks):
        data_warnings = DATA_WARNINGS.set([])
        try:
            task = build_slot(registry, "eval", task_arguments(config), f"eval.{i}")
            result = {"name": config["name"], **task(model, registry)}
            if isinstance(config, dict) and config.get(ABOUT):
                result[ABOUT] = config[ABOUT]  # a suite's title and main metric for the task
            result["warnings"] = [*DATA_WARNINGS.get(), *(result.get("warnings") or [])]
            add_warnings(result)
        except Exception as error:  # noqa: BLE001 — reported in the suite's results, never lost
            message = str(error) if isinstance(error, ClipkitError) else f"{type(error).__name__}: {error}"
            described = {k: config[k] for k in ("data", "label", "dataset") if config.get(k) is not None}
            result = {"name": config.get("name", "?"), **described, "failed": message}
        finally:
            DATA_WARNINGS.reset(data_warnings)
        results.append(result)
    return results


#: Fewer evaluated samples than this get a ``warning`` in their result: one sample then moves a
#: score by more than 5 points, so such a score cannot tell two runs apart.
MIN_EVAL_SAMPLES = 20
#: The sample counts the built-in tasks report, by key.
SAMPLE_COUNT_KEYS = ("n_images", "n", "n_test")


def small_set_warning(result: dict) -> str | None:
    """A warning when ``result`` was computed on fewer than :data:`MIN_EVAL_SAMPLES` samples."""
    counts = [result[key] for key in SAMPLE_COUNT_KEYS if isinstance(result.get(key), int)]
    if not counts or min(counts) >= MIN_EVAL_SAMPLES:
        return None
    n = min(counts)
    return (
        f"only {n} sample(s): each moves a score by {1 / n:.0%}, too few to compare runs "
        f"(hold out more with --holdout, or add --eval-data)"
    )


def add_warnings(result: dict) -> None:
    """Gather a result's warnings (its task's ``warnings`` and :func:`small_set_warning`) in
    ``warnings``, one per line in the report, and ``warning``: all of them in one string."""
    warnings = [small_set_warning(result)] + list(result.pop("warnings", None) or [])
    warnings = [text for text in warnings if text]
    if warnings:
        result["warnings"], result["warning"] = warnings, "; ".join(warnings)


def result_warnings(result: dict) -> list[str]:
    """A result's warnings, one per item (reports written before ``warnings`` have ``warning``)."""
    return list(result.get("warnings") or ([result["warning"]] if result.get("warning") else []))


def failed_tasks(results: Iterable[dict]) -> list[dict]:
    """The results of tasks that failed (they carry ``failed``: the error message)."""
    return [result for result in results if result.get("failed")]


#: Task arguments that hold a data source URI by convention (zero_shot, retrieval, diagnostics:
#: ``data``; linear_probe: ``train`` and ``test``), checked by :func:`check_tasks` before anything runs.
DATA_KEYS = ("data", "train", "test")


def check_tasks(tasks: list[dict], registry: Registry) -> None:
    """Refuse tasks that would fail before running anything (so no report is written): each named
    task's arguments against its factory (as recipe validation does), its constructor's own checks,
    and that a data source plugin accepts each URI in :data:`DATA_KEYS`. Every problem is listed."""
    from clipkit.config.recipe import EVAL_INJECTED, check_slot
    from clipkit.eval.suite import task_arguments

    errors = []
    for i, config in enumerate(tasks):
        path = f"eval[{i}]"
        config = task_arguments(config)
        problems = check_slot(config, path, "eval", EVAL_INJECTED, registry)
        if not problems:
            try:
                build_slot(registry, "eval", config, path)
            except (ClipkitError, ValueError, TypeError) as error:
                problems.append(f"{path}: {error}")
        for key in DATA_KEYS if isinstance(config, dict) else ():
            if isinstance(config.get(key), str):
                try:
                    open_source(config[key], pm=registry.pm)
                except ClipkitError as error:
                    problems.append(f"{path}.{key}: {error}")
        errors += problems
    if errors:
        problems = "; ".join(errors)
        raise ClipkitError(f"{len(errors)} problem(s) with the eval task(s), nothing evaluated: {problems}")


#: Eval tasks that check their data against the training data (:mod:`clipkit.eval.data_checks`).
CHECKED_TASKS = ("zero_shot", "retrieval")


def with_training_data(tasks: list[dict], recipe: dict, registry: Registry) -> list[dict]:
    """``tasks`` given to ``clipkit eval`` with the ``training_data`` of the export's own run (a
    ``clipkit train --data`` run records it in its eval tasks) where they name none, so a zero-shot
    on more data still says which class names training never showed; unchanged when the run's
    training data is not readable here."""
    recorded = [t.get("training_data") for t in recipe.get("eval") or [] if isinstance(t, dict)]
    known = next((uri for uri in recorded if uri), None)
    if not known:
        return tasks
    try:
        open_source(known, pm=registry.pm)
    except ClipkitError:
        return tasks  # the shards moved or another machine: evaluate without the checks
    return [
        {**t, "training_data": known}
        if isinstance(t, dict) and t.get("name") in CHECKED_TASKS and "training_data" not in t
        else t
        for t in tasks
    ]


def evaluate_export(
    export_dir: Path,
    tasks: list[dict] | None,
    registry: Registry,
    *,
    options: dict | None = None,
    skip_missing: bool = False,
) -> dict[str, Any]:
    """Load an export (or any layout a ``read_model`` plugin reads with ``options``, converted in
    memory) and run ``tasks`` (default: the eval section of its recipe); given ``tasks`` are checked
    first (:func:`check_tasks`). ``skip_missing`` (a suite's ``missing: skip``): tasks whose local
    data does not exist, or that the suite marks unsupported, are listed in the results
    (``missing`` / ``not_run``) instead of run (:mod:`clipkit.eval.suite`)."""
    from clipkit.artifacts.reader import load_model
    from clipkit.eval.suite import split_suite

    skipped: list[dict] = []
    if tasks is not None and skip_missing:
        tasks, skipped = split_suite(tasks)
        if not tasks:
            where = "; ".join(row.get("missing") or row.get("not_run", "") for row in skipped[:3])
            raise ClipkitError(f"none of the suite's {len(skipped)} tasks can run here ({where}, ...)")
    if tasks is not None:
        check_tasks(tasks, registry)
    model, metadata = load_model(export_dir, registry, options=options)
    if tasks is not None:
        tasks = with_training_data(tasks, metadata.get("recipe") or {}, registry)
    tasks = tasks if tasks is not None else metadata["recipe"].get("eval") or []
    if not tasks:
        raise ClipkitError(f"{export_dir}: no eval tasks given and its recipe has no `eval:` section")
    name = (metadata.get("recipe") or {}).get("name")  # CLIP_benchmark's `model` in its result files
    return {"export": str(export_dir), "model": name, "results": run_evals(model, tasks, registry) + skipped}
