"""One typed function per CLI command; the CLI only parses arguments and prints.

Usable from Python too::

    from clipkit.app import api
    result = api.train("quickstart", ["train.steps=100"])
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipkit.contract.registry import Registry, default_registry
from clipkit.data.teacher_shards import TeacherSpec
from clipkit.errors import ClipkitError

if TYPE_CHECKING:
    from clipkit.app.own_data import OwnData


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict[str, Any]
    export_dir: Path | None = None
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    is_main: bool = True  # False on every process but 0 under `accelerate launch`


def resolve(
    spec: str, overrides: list[str], registry: Registry | None = None, *, own_data: OwnData | None = None
) -> dict:
    """Load and validate ``NAME[@VARIANT]`` + overrides (raises RecipeError listing every problem).

    ``own_data`` (``clipkit train --data ...``) adds its overrides to the resolved recipe — they
    depend on its eval tasks — with the user's ``overrides`` still winning: one resolution.
    """
    from clipkit.config.recipe import amend_resolved, load_recipe, validate_or_raise

    registry = registry or default_registry()
    recipe = load_recipe(spec, overrides, registry=registry)
    if own_data is not None:
        extra = own_data.overrides(recipe.get("eval"))
        recipe = amend_resolved(recipe, extra, kept=list(overrides), where=spec)
    return validate_or_raise(recipe, registry, where=spec)


def check_data(recipe: dict, registry: Registry | None = None) -> None:
    """What ``train`` checks about a resolved recipe's data before it writes anything: the shard
    directory, or the source it would be sharded from (``clipkit validate`` runs it too)."""
    from clipkit.train.build import check_data_location

    check_data_location(recipe, registry or default_registry())


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
    overwrite: bool = False,
    teacher: TeacherSpec | None = None,
) -> dict:
    """Write ``source`` as WebDataset shards + manifest.json in ``out``; returns the manifest.

    An interrupted run leaves ``out.partial``; calling again with the same arguments continues it.
    ``out`` must be absent, empty or a shard set of ``source``; ``overwrite`` replaces any other folder.
    ``teacher``: store that model's embeddings of every sample (:mod:`clipkit.data.teacher_shards`).
    """
    from clipkit.data.download import Downloader
    from clipkit.data.shard import open_source
    from clipkit.data.shard_writer import write_shards

    # Options that change how fast or how patiently samples arrive, not what they are: an
    # interrupted `clipkit shard` may be resumed with other values (e.g. a longer timeout).
    resume_may_change = {"workers", *Downloader.PATIENCE_OPTIONS}

    from clipkit.artifacts.io import check_output_path

    check_output_path(Path(out), "shard directory")  # before the source is read
    registry = registry or default_registry()
    opened = open_source(source, options, pm=registry.pm)
    settings = {key: value for key, value in (options or {}).items() if key not in resume_may_change}
    if teacher is not None:
        import torch

        from clipkit.data.teacher_shards import TeacherAnnotated
        from clipkit.model.teacher import Teacher

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the teacher embeds on the GPU if any
        opened = TeacherAnnotated(opened, Teacher.load(teacher.path, registry, device), teacher)
        settings["teacher"] = teacher.settings()
    return write_shards(
        opened,
        out,
        source=source,
        info=opened.info(),
        samples_per_shard=samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        settings=settings,
        progress=progress,
        overwrite=overwrite,
    )


def shard_split(
    source: str,
    out: Path,
    split: str,
    *,
    options: dict | None = None,
    registry: Registry | None = None,
    **settings: Any,
) -> dict[str, dict]:
    """``split`` = "NAME=FRACTION": write ``out``/train and ``out``/NAME, the samples outside and
    inside the held-out split of ``source`` (the rule of ``clipkit train --data --holdout``, see
    :mod:`clipkit.app.own_data`). ``settings`` as :func:`shard`. Returns {part: manifest}."""
    from clipkit.app.own_data import SplitPart, parse_split
    from clipkit.artifacts.io import check_output_path
    from clipkit.data.shard import open_source
    from clipkit.data.shard_writer import write_shards

    name, fraction = parse_split(split)
    check_output_path(Path(out), "shard directory")
    registry = registry or default_registry()
    manifests = {}
    for part, held_out in (("train", False), (name, True)):
        opened = SplitPart(open_source(source, options, pm=registry.pm), fraction, held_out, part)
        manifests[part] = write_shards(
            opened,
            Path(out) / part,
            source=source,
            info=opened.info(),
            samples_per_shard=settings.get("samples_per_shard", 1000),
            max_shard_bytes=settings.get("max_shard_bytes"),
            settings={**(options or {}), "split": split, "part": part},
            progress=settings.get("progress"),
            overwrite=settings.get("overwrite", False),
        )
    return manifests


def index_shards(directory: Path) -> list[Path]:
    """Write the record index beside every ``.tar`` in ``directory`` (:mod:`clipkit.data.tar_index`);
    the index files written. Tars that cannot be read are :class:`~clipkit.data.tar_index.UnindexedTars`
    (a DataError naming each, with the indexes written for the others), raised once all are done."""
    from clipkit.data.tar_index import index_directory

    return index_directory(Path(directory))


def verify(directory: Path) -> dict:
    """Check a shard set against its manifest: ``{"n", "shards", "problems"}`` (empty = intact)."""
    from clipkit.data.shard import verify_shards

    return verify_shards(directory)


def train(
    spec: str,
    overrides: list[str] | None = None,
    *,
    run_dir: Path | None = None,
    resume: bool = False,
    registry: Registry | None = None,
    progress=None,
    verify: bool | None = None,
    trust_checkpoint: bool | None = None,
    own_data: OwnData | None = None,
) -> TrainResult:
    """Train a recipe; then, if ``train.export``, export to RUN/export and run its eval tasks.

    ``verify`` (default on) checks the resumed checkpoint's checksums; ``trust_checkpoint`` allows
    unpickling it (checkpoints of an older clipkit; see docs/safety.md). ``own_data``: train and
    evaluate on the user's data (``clipkit train --data``; a new run only).
    """
    from clipkit.artifacts.integrity import loading

    if resume and own_data is not None:
        raise ClipkitError("--data/--eval-data/--label start a new run; a resumed run keeps its data")
    epochs = getattr(own_data, "epochs", None)
    if epochs is not None and not 0 < epochs < float("inf"):  # nan fails both comparisons
        raise ClipkitError(f"--epochs must be a positive finite number of passes, got {epochs}")
    with loading(verify=verify, trust_checkpoint=trust_checkpoint):
        return _train(
            spec, overrides, run_dir=run_dir, resume=resume, registry=registry, progress=progress,
            own_data=own_data,
        )  # fmt: skip


def _train(spec, overrides, *, run_dir, resume, registry, progress, own_data=None) -> TrainResult:
    from clipkit.artifacts.export import EXPORT_OUTPUT
    from clipkit.artifacts.io import claim_output_directory
    from clipkit.config.recipe import section, validate_or_raise
    from clipkit.train.build import prepare_run_dir
    from clipkit.train.run_lock import run_directory_lock
    from clipkit.train.runtime import launched_as_main

    registry = registry or default_registry()
    started = time.perf_counter()
    _freeze_imported_objects()
    if resume:
        if run_dir is None:
            raise ClipkitError("--resume needs --run-dir (the run to continue)")
        recipe = validate_or_raise(resume_recipe(Path(run_dir), overrides or [], registry), registry)
        if spec != recipe["name"]:
            raise ClipkitError(f"{run_dir} is a run of recipe {recipe['name']!r}, not {spec!r}")
    else:
        recipe = resolve(spec, overrides or [], registry, own_data=own_data)  # the command's one resolution
        if own_data is not None and own_data.is_own:
            from clipkit.app.run_length import size_run

            recipe, line = size_run(spec, recipe, list(overrides or []), own_data.epochs, registry)
            if launched_as_main():
                print(line, flush=True)
        check_data(recipe, registry)  # before the run directory exists, as `clipkit validate` does
        if own_data is not None and launched_as_main():
            from clipkit.app.preflight import check_eval_data

            check_eval_data(list(recipe.get("eval") or []), recipe, registry)  # label, --eval-data: now
        run_dir = Path(run_dir) if run_dir else default_run_dir(recipe)
    from clipkit.artifacts.io import check_output_path

    check_output_path(Path(run_dir), "run directory", directory=True)  # a file in the way, read-only: now
    with run_directory_lock(run_dir, enabled=launched_as_main()):
        if section(recipe, "train").export and launched_as_main():
            # Refused now, not after training: an export folder holding files clipkit did not write.
            remedy = "move them away, or set train.export=false (and run clipkit export RUN OUT later)"
            claim_output_directory(Path(run_dir) / "export", EXPORT_OUTPUT, remedy=remedy)
        prepare_run_dir(recipe, run_dir, resume=resume)
        result = _train_locked(recipe, run_dir, registry, progress, started, resume=resume)
    _release_launch_objects()
    return result


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _freeze_imported_objects() -> None:
    """In a launched process, move every object that exists before the run (the ~500 000 of the
    imported modules) out of the garbage collector's reach (``gc.freeze``), so that the collection
    at the end (:func:`_release_launch_objects`) and the automatic full collections during the run
    scan the run's own objects only (a 4-step two-process smoke run: ~0.8 CPU-s less per rank).
    They are module-level objects that live as long as the process anyway."""
    if _launched():
        import gc

        gc.freeze()


def _release_launch_objects() -> None:
    """In a launched process, free the trainer's objects now, while the interpreter is whole.

    The DDP wrapper and its reducer keep the (destroyed) process group's gloo worker threads alive
    through reference cycles; left to interpreter shutdown, their teardown was seen to abort a rank
    ("terminate called without an active exception", SIGABRT) after the run had finished and
    committed its last checkpoint, so the launcher reported a failed run. The objects that existed
    before the run were frozen (:func:`_freeze_imported_objects`): they are not scanned, and are
    handed back to the collector afterwards.
    """
    if _launched():
        import gc

        gc.collect()
        gc.unfreeze()


def _train_locked(recipe, run_dir, registry, progress, started, *, resume: bool) -> TrainResult:
    from clipkit.app.watch import watching
    from clipkit.config.recipe import section
    from clipkit.train.build import accept_resumed_recipe, build_trainer
    from clipkit.train.loop import train_loop
    from clipkit.train.stop import after_the_loop, handling_signals

    trainer = build_trainer(recipe, run_dir, registry, resume=resume)
    if resume:
        accept_resumed_recipe(recipe, run_dir)  # only now: a refused resume leaves recipe.yaml as it was
    with watching(trainer) as events:  # on_run_start / on_evals / on_run_end (trackers)
        with handling_signals():  # SIGTERM/SIGINT: checkpoint after the step, then TrainingStopped
            metrics = train_loop(trainer, progress=progress)
        after_the_loop(Path(run_dir), section(recipe, "train").steps)  # a signal in the last step: stop
        result = TrainResult(run_dir=Path(run_dir), metrics=metrics, is_main=trainer.runtime.is_main)
        trainer.runtime.close()
        if section(recipe, "train").export and trainer.runtime.is_main:
            result.export_dir = export(run_dir, Path(run_dir) / "export", registry=registry)
            if recipe.get("eval"):
                from clipkit.app.run_length import short_run_note

                output, note = Path(run_dir) / "eval.json", short_run_note(metrics)
                notes = [note] if note else []
                report = evaluate(result.export_dir, None, registry=registry, output=output, notes=notes)
                result.evals = report["results"]
                events.evals(result.evals)
            plot_run(Path(run_dir))
    result.seconds = time.perf_counter() - started
    return result


def train_in_process(recipe: dict, run_dir: Path, registry: Registry | None = None):
    """Train a recipe given as a dict through the one loop, in this process, without export or
    evaluation; returns the trained plain model (a :class:`clipkit.model.ContrastiveModel`).

    For studies that build their recipes in code (``clipkit experiment pmi-fidelity``): the
    recipe is validated like a file's, and the run directory gets recipe.yaml, metrics.jsonl and
    a checkpoint as any run's does.
    """
    from clipkit.config.recipe import validate_or_raise
    from clipkit.train.build import build_trainer, prepare_run_dir
    from clipkit.train.loop import train_loop
    from clipkit.train.run_lock import run_directory_lock
    from clipkit.train.runtime import launched_as_main

    registry = registry or default_registry()
    recipe = validate_or_raise(recipe, registry)
    with run_directory_lock(run_dir, enabled=launched_as_main()):
        prepare_run_dir(recipe, Path(run_dir), resume=False)
        trainer = build_trainer(recipe, Path(run_dir), registry)
        train_loop(trainer)
    return trainer.model


def plot_run(run_dir: Path) -> Path | None:
    """RUN/loss.png: the run's loss (and, when logged, learning rate) against step."""
    from clipkit.eval.report import plot_loss_curves

    if not (run_dir / "metrics.jsonl").is_file():
        return None
    return plot_loss_curves({run_dir.name: run_dir}, run_dir / "loss.png", ["loss", "lr"])


def resume_recipe(run_dir: Path, overrides: list[str], registry: Registry) -> dict:
    """The run's saved recipe with extra overrides (e.g. more ``train.steps``)."""
    from omegaconf import OmegaConf

    from clipkit.artifacts.files import read_yaml_mapping
    from clipkit.config.recipe import apply_overrides, resolve_interpolations

    path = run_dir / "recipe.yaml"
    if not path.is_file():
        raise ClipkitError(f"{run_dir}: cannot resume, recipe.yaml is missing")
    config = OmegaConf.create(read_yaml_mapping(path, "the run's recipe", "restore it from a backup"))
    apply_overrides(config, overrides, str(path))
    recipe = resolve_interpolations(config, str(path))
    recipe["overrides"] = list(recipe.get("overrides") or []) + list(overrides)
    return recipe


def export(
    run_dir: Path,
    out: Path,
    *,
    checkpoint: Path | None = None,
    registry: Registry | None = None,
    verify: bool | None = None,
    trust_checkpoint: bool | None = None,
    overwrite: bool = False,
    ema: bool = False,
    keep_adapters: bool = False,
) -> Path:
    """Export a run's newest (or a given) checkpoint; ``verify``/``trust_checkpoint`` as in :func:`train`;
    ``ema``: its weight EMA (``train.ema``) instead of the live weights; LoRA adapters (``model.lora``)
    are merged into plain weights unless ``keep_adapters``.

    ``out`` must be absent, empty or an earlier export; ``overwrite`` replaces any other folder
    (never the run itself or its checkpoints)."""
    from clipkit.artifacts.export import export_run
    from clipkit.artifacts.integrity import loading
    from clipkit.artifacts.io import check_output_path

    check_output_path(Path(out), "export")  # before the checkpoint is read
    with loading(verify=verify, trust_checkpoint=trust_checkpoint):
        return export_run(
            Path(run_dir),
            Path(out),
            registry or default_registry(),
            checkpoint,
            overwrite=overwrite,
            ema=ema,
            keep_adapters=keep_adapters,
        )


CONVERT_LAYOUTS = "clipkit, open_clip, state_dict, hf"


def convert(
    source: Path,
    out: Path,
    to: str,
    *,
    quick_gelu: bool | None = None,
    overwrite: bool = False,
    registry: Registry | None = None,
) -> Path:
    """Convert a plain CLIP model between layouts; returns ``out``.

    ``source``: a clipkit export, an open_clip directory (``open_clip_config.json`` +
    ``open_clip_model.safetensors``), an OpenAI/open_clip-layout ``.safetensors`` state dict, or a
    Hugging Face ``CLIPModel`` directory. ``to``: "clipkit", "open_clip", "state_dict" (a
    ``.safetensors`` file) or "hf". ``quick_gelu`` says which activation a bare state dict was
    trained with (None: from a ``open_clip_config.json`` beside it or the header clipkit writes,
    else refused: the tensors cannot say). Only safetensors are read, never pickles. ``out`` must be
    new, empty or an earlier output of the same layout (``overwrite``: whatever it holds), and is
    never ``source`` or a folder holding it.
    """
    from clipkit.artifacts.io import check_output_path

    check_output_path(Path(out), "convert output")  # before the source is read
    registry = registry or default_registry()
    options = {"quick_gelu": quick_gelu, "overwrite": overwrite}
    written = registry.pm.hook.convert_model(
        source=Path(source), out=Path(out), layout=to, registry=registry, options=options
    )
    if written is None:
        raise ClipkitError(
            f"--to {to!r}: no installed plugin writes that layout (built in: {CONVERT_LAYOUTS})"
        )
    return written


def evaluate(
    export_dir: Path,
    tasks: list[dict] | None,
    *,
    registry: Registry | None = None,
    output: Path | None = None,
    plots: bool = True,
    verify: bool | None = None,
    quick_gelu: bool | None = None,
    notes: list[str] | None = None,
    skip_missing: bool = False,
) -> dict:
    """Run eval tasks (default: the export's recipe's) on an export, or on an open_clip / Hugging
    Face CLIP directory or OpenAI-layout ``.safetensors`` file (converted in memory).

    With ``output`` (a .json path) the report is written there, with a Markdown table beside it
    (.md) and PNG plots (``-accuracy.png``, ``-recall.png``) unless ``plots`` is False, and listed
    in the export's ``eval-index.json`` (:mod:`clipkit.eval.report_index`).
    ``quick_gelu``: a bare state dict's activation, as for :func:`convert`. ``notes``: lines the
    report carries above its table (e.g. that the run trained under one epoch). ``skip_missing``:
    list a suite's tasks whose data is not here instead of refusing (:mod:`clipkit.eval.suite`).
    """
    from clipkit.artifacts.integrity import loading
    from clipkit.artifacts.io import check_output_path
    from clipkit.eval.evaluate import evaluate_export
    from clipkit.eval.report import summarize
    from clipkit.eval.report_index import check_report_target, weights_sha256

    if output is not None:
        check_output_path(Path(output), "eval report", file=True)  # before the long work, not after it
        check_report_target(Path(output))  # an earlier report may be replaced, nothing else
    scored = weights_sha256(Path(export_dir)) if Path(export_dir).exists() else None
    with loading(verify=verify):  # verify=False: skip the weights' checksum (--no-verify)
        options = {"quick_gelu": quick_gelu}
        report = evaluate_export(
            Path(export_dir),
            tasks,
            registry or default_registry(),
            options=options,
            skip_missing=skip_missing,
        )
    report["summary"] = summarize(report["results"])
    if scored is not None:
        report["weights_sha256"] = scored  # what was scored: a report is filed only with these weights
    if notes:
        report["notes"] = list(notes)
    if output is not None:
        file_report(Path(export_dir), Path(output), report, scored, plots=plots)
    return report


def file_report(export_dir: Path, output: Path, report: dict, scored: str | None, *, plots: bool) -> None:
    """Write the report and list it in the export's index, under the index lock, only while the
    export still holds the weights that were scored (:func:`~clipkit.eval.report_index.check_same_weights`).
    An index that cannot be written (a read-only baseline folder, a full disk) leaves the report
    standing, with a warning; the next evaluation adds it to the index."""
    from clipkit.eval.report import write_eval_report
    from clipkit.eval.report_index import (
        check_same_weights,
        index_lock,
        record_report,
        release_claim,
        report_home,
    )

    home = report_home(export_dir)
    inside = home.resolve() in output.resolve().parents
    with index_lock(home) if home.is_dir() else contextlib.nullcontext():
        try:
            check_same_weights(export_dir, scored, output if inside else None)
        except ClipkitError:
            if inside:
                release_claim(output)
                raise
            write_eval_report(report, output, plots=plots)  # written where asked, never indexed
            raise
        write_eval_report(report, output, plots=plots)
        try:
            record_report(export_dir, output, report, locked=True)  # EXPORT/eval-index.json lists it
        except (OSError, ClipkitError) as error:  # a read-only baseline folder: the report stands
            logging.getLogger("clipkit.eval").warning(
                "the report index beside %s was not updated: %s", export_dir, error
            )


#: What ``clipkit report`` writes into its folder: an earlier comparison may be replaced, nothing else.
REPORT_FILES = ("loss.png", "telemetry.png", "eval.json", "eval.md", "eval-accuracy.png")


def claim_report_folder(out: Path, runs: list[Path]) -> None:
    """ClipkitError unless ``out`` may take a comparison: absent, empty or an earlier one (only
    :data:`REPORT_FILES`, its eval.json a comparison); never a compared run or a folder holding
    one, never a run or export (their eval.json, loss.png are the run's own)."""
    from clipkit.artifacts.files import read_json
    from clipkit.artifacts.io import Kept, OutputKind, claim_output_directory

    protect = [Kept(run, "a compared run", inside=False) for run in runs]
    remedy = "pick another folder: a new or empty one, or one an earlier `clipkit report` wrote"
    claim_output_directory(out, OutputKind("comparison report", REPORT_FILES), protect=protect, remedy=remedy)
    earlier = out / "eval.json"
    if earlier.is_file():
        kept = read_json(earlier, "comparison report", remedy)
        if not (isinstance(kept, dict) and set(kept) == {"runs"}):
            raise ClipkitError(f"{earlier} is not a comparison `clipkit report` wrote; {remedy}")


def report(runs: list[Path], out: Path, *, metrics: list[str] | None = None) -> list[Path]:
    """Compare runs: their loss curves overlaid (``out``/loss.png), their step telemetry (samples/s
    per device, MFU, data-wait share, step split, peak memory: ``out``/telemetry.png) and, for runs
    with an eval report
    (``eval.json``, else the newest in ``eval-index.json``), every eval result side by side
    (``out``/eval.json, .md, plots). A directory with a report but no ``metrics.jsonl`` (an evaluated
    baseline) joins only the eval table; so does a CLIP_benchmark result JSON file."""
    from clipkit.artifacts.io import check_output_path
    from clipkit.eval.report import (
        check_metrics_logged,
        plot_loss_curves,
        telemetry_metrics,
        write_comparison,
    )
    from clipkit.eval.report_index import read_eval_report, read_eval_reports

    runs = [Path(run) for run in runs]
    labels = unique_labels(runs)
    out = Path(out)
    claim_report_folder(out, runs)
    check_output_path(out, "report folder")
    # A baseline evaluated without training (`clipkit eval` on an open_clip/HF directory) has an
    # eval.json but no metrics.jsonl: it joins the eval table, not the loss curves.
    curves = {
        label: run
        for label, run in zip(labels, runs, strict=True)
        if (run / "metrics.jsonl").is_file() or read_eval_report(run) is None
    }
    if metrics and curves:
        check_metrics_logged(curves, metrics)  # before anything is written
    written = [plot_loss_curves(curves, out / "loss.png", metrics or ["loss"])] if curves else []
    telemetry = telemetry_metrics(curves)  # samples/s per device, MFU, data wait, step split, memory
    if telemetry:
        written.append(plot_loss_curves(curves, out / "telemetry.png", telemetry))
    evals = read_eval_reports(dict(zip(labels, runs, strict=True)))
    if evals:
        written += write_comparison(evals, out / "eval.json")
    return written


def unique_labels(runs: list[Path]) -> list[str]:
    """Run directory names, with parents added where two names collide."""
    names = [run.name for run in runs]
    if len(set(names)) == len(names):
        return names
    return [str(run) for run in runs]
