"""The ``clipkit`` command line: parse, call one typed function in :mod:`clipkit.app.api`, print.

Nothing heavy is imported at module level, so ``clipkit --help`` starts without torch.
Experiment knobs are recipe overrides (``key=value``), not flags. No ``from __future__ import
annotations`` here: typer reads every command's signature at each start, and evaluating string
annotations doubled that (~55 instead of ~25 ms a start).
"""

import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from clipkit.app.commands import fails_cleanly, registry
from clipkit.errors import ClipkitError

HELP = """clipkit — contrastive multimodal (CLIP-family) pretraining research toolkit.

Start with: clipkit train quickstart"""


NO_VERIFY_HELP = "Skip the sha256 check of the files against the checksums recorded when they were written"
QUICK_GELU_HELP = (
    "The activation a bare .safetensors state dict was trained with (QuickGELU: OpenAI's weights; "
    "--no-quick-gelu: open_clip's own), which its tensors cannot say; needed unless an "
    "open_clip_config.json is beside it"
)
TRUST_HELP = (
    "Allow unpickling the checkpoint's files (can run code the files name): only for checkpoints you "
    "wrote yourself, e.g. with an older clipkit"
)

OVERWRITE_HELP = (
    "Replace OUT even when it holds files clipkit did not write there (they are deleted); without it "
    "such a folder is refused"
)


class ListsChoices(TyperCommand):
    """A command whose ``--help`` shows, as an option's metavar, the names it takes (eval tasks,
    convert layouts), read from the plugins only when that help is shown (so `clipkit --help`
    stays light and a plugin's names appear too). Values are not restricted here: the command
    refuses an unknown one, with its did-you-mean, before writing anything."""

    choices: dict = {}  # option name -> () -> list[str]

    def format_help(self, ctx, formatter):
        for param in self.params:
            if param.name in self.choices:
                with contextlib.suppress(Exception):  # a broken plugin must not break --help
                    param.metavar = "[" + "|".join(self.choices[param.name]()) + "]"
        return super().format_help(ctx, formatter)


def lists_choices(**choices) -> type[ListsChoices]:
    return type("ListsChoices", (ListsChoices,), {"choices": choices})


def eval_task_names() -> list[str]:
    return registry().names("eval")


def convert_layouts() -> list[str]:
    from clipkit.app.api import CONVERT_LAYOUTS

    return [name.strip() for name in CONVERT_LAYOUTS.split(",")]


def show_version(value: bool) -> None:
    if value:
        from clipkit import DISTRIBUTION, __version__

        typer.echo(f"clipkit {__version__} (distribution {DISTRIBUTION})")
        raise typer.Exit()


#: Width of tables written to a pipe or a log file (rich's default there is 80 columns, which
#: wraps and elides the data labels of an eval report); $COLUMNS still wins.
PIPE_WIDTH = 160


def console():
    import os
    import sys

    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPE_WIDTH if piped else None)


def teacher_spec(path, views: int, seed: int, augment: list[str] | None, batch_size: int):
    """``clipkit shard --teacher``'s options as a TeacherSpec (None without --teacher)."""
    from clipkit.data.teacher_shards import TeacherSpec, augment_settings

    if path is None:
        if augment or views != 1:
            raise typer.BadParameter("--teacher-views / --teacher-augment need --teacher MODEL_DIR")
        return None
    if views < 1 or batch_size < 1:
        raise typer.BadParameter("--teacher-views and --teacher-batch-size must be >= 1")
    pairs = dict(parse_pairs(augment or [], typed=True))
    augment_settings(pairs)  # a clear error before the model or the source is opened
    return TeacherSpec(str(path), views, seed, pairs, batch_size)


@fails_cleanly
def shard_command(
    source: Annotated[
        str,
        typer.Argument(
            help="Source URI or path, e.g. captions.jsonl (or, with --verify or --index, the shard directory)"
        ),
    ],
    out: Annotated[Path, typer.Argument(help="Output directory for shard-*.tar + manifest.json")] = None,
    samples_per_shard: Annotated[int, typer.Option(help="Samples per tar shard (at most)")] = 1000,
    max_shard_size: Annotated[
        str, typer.Option(help="Also close a shard once it holds this many bytes, e.g. 500MB, 1GiB")
    ] = None,
    option: Annotated[list[str], typer.Option("--option", "-o", help="Source option key=value")] = None,
    strict: Annotated[
        bool, typer.Option(help="Stop at the first bad row, naming it, instead of skipping and counting it")
    ] = False,
    verify: Annotated[bool, typer.Option(help="Check a shard directory against its manifest")] = False,
    index: Annotated[
        bool,
        typer.Option(
            help="Write the record index (NAME.tar.idx) beside every .tar in a directory (shards "
            "another tool or an older clipkit wrote): loader lanes then read only "
            "their own bytes, also over HTTP and S3 (upload the .idx files beside the tars)"
        ),
    ] = False,
    split: Annotated[
        str,
        typer.Option(
            help="NAME=FRACTION, e.g. val=0.05: write OUT/train and OUT/NAME (by a hash of each "
            "sample's key, the split `clipkit train --data` holds out)"
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
    teacher: Annotated[
        str,
        typer.Option(
            help="Store this model's image and text embeddings of every sample (a clipkit export, open_clip "
            "or Hugging Face CLIP directory) for train.distill.stored (docs/distillation.md)"
        ),
    ] = None,
    teacher_views: Annotated[
        int, typer.Option(help="With --teacher: augmented views embedded per image")
    ] = 1,
    teacher_seed: Annotated[
        int,
        typer.Option(
            help="With --teacher: view k uses the loader's augmentation seed of epoch k for this seed"
        ),
    ] = 0,
    teacher_augment: Annotated[
        list[str],
        typer.Option(
            help="With --teacher: a data.* augmentation key=value the views are drawn with (crop_scale, "
            "crop_ratio, hflip, color_jitter, grayscale, background); none: the centre crop"
        ),
    ] = None,
    teacher_batch_size: Annotated[int, typer.Option(help="With --teacher: samples embedded at a time")] = 64,
):
    """Turn a data source into WebDataset shards with a manifest (global index per sample).

    An interrupted run (even kill -9) leaves OUT.partial; rerun the same command to continue it.
    """
    from clipkit.app import api

    if verify:
        verify_command(out or Path(source))
        return
    if index:
        index_command(out or Path(source))
        return
    if out is None:
        raise typer.BadParameter("missing OUT (the directory to write)")
    options = dict(parse_pairs(option or []))
    if strict:
        options["strict"] = "true"
    spec = teacher_spec(teacher, teacher_views, teacher_seed, teacher_augment, teacher_batch_size)
    if split is not None:
        if spec is not None:
            raise typer.BadParameter("--teacher with --split: shard each part apart (the views' seeds "
                                     "follow each set's own indices)")  # fmt: skip
        with said_on_interrupt(out), step_progress("sharding", total=None) as report:
            manifests = api.shard_split(
                source, out, split, options=options, registry=registry(), samples_per_shard=samples_per_shard,
                max_shard_bytes=max_shard_size, progress=report, overwrite=overwrite,
            )  # fmt: skip
        for part, manifest in manifests.items():
            shards = len(manifest["shards"])
            typer.echo(f"{part}: wrote {manifest['n']} samples in {shards} shard(s) to {out / part}")
            print_uncaptioned(manifest)
        print_image_counts(next(iter(manifests.values())))
        return
    with said_on_interrupt(out), step_progress("sharding", total=None) as report:
        manifest = api.shard(
            source,
            out,
            samples_per_shard=samples_per_shard,
            max_shard_bytes=max_shard_size,
            options=options,
            registry=registry(),
            progress=report,
            overwrite=overwrite,
            teacher=spec,
        )
    typer.echo(f"wrote {manifest['n']} samples in {len(manifest['shards'])} shard(s) to {out}")
    from clipkit.data.shard_writer import skipped_example_lines, skipped_rows_line

    if skipped_rows_line(manifest):
        typer.echo(skipped_rows_line(manifest))
        for line in skipped_example_lines(manifest):
            typer.echo(line)
    print_uncaptioned(manifest)
    print_image_counts(manifest)


def print_uncaptioned(manifest: dict) -> None:
    """One ``warning:`` line on stderr when some samples have captions and others none."""
    from clipkit.data.shard_writer import uncaptioned_line

    line = uncaptioned_line(manifest)
    if line:
        typer.echo(line, err=True)


@contextlib.contextmanager
def said_on_interrupt(out: Path):
    """Ctrl-C during ``clipkit shard``: exit 130 with one line saying the finished shards are kept
    and the same command continues (it exited silently)."""
    try:
        yield
    except KeyboardInterrupt:
        kept = sorted(Path(out).parent.glob(f"{Path(out).name}*.partial"))
        where = f"the finished shards are kept in {', '.join(map(str, kept))}; " if kept else ""
        typer.secho(f"interrupted: {where}run the same command again to continue", fg="red", err=True)
        raise typer.Exit(130) from None


def print_image_counts(manifest: dict) -> None:
    """One line about images with transparency: how many were flattened now (always said under
    ``-o background=...``, none included), or that the loader will composite them."""
    info = manifest.get("info") or {}
    alpha, flattened = info.get("alpha_images", 0), info.get("alpha_flattened", 0)
    if info.get("background") is not None:
        typer.echo(
            f"flattened {flattened} of {manifest.get('n', '?')} image(s) with transparency onto "
            f"{info.get('background')} (stored as PNG)"
        )
    elif alpha:
        typer.echo(f"{alpha} image(s) with transparency: composited onto data.background (default white) "
                   "when loaded; -o background=COLOUR does it now")  # fmt: skip


def index_command(directory: Path) -> None:
    """``clipkit shard DIR --index``: each tar it could not read on its own line (as ``--verify``
    lists its problems), then one error line; the indexes of the readable tars are kept."""
    from clipkit.app import api
    from clipkit.data.tar_index import UnindexedTars

    try:
        written = api.index_shards(directory)
    except UnindexedTars as error:
        for problem in error.problems:
            typer.secho(f"  {problem}", fg="red", err=True)
        raise ClipkitError(
            f"{directory}: {len(error.problems)} of {len(error.problems) + len(error.written)} tar(s) not "
            f"indexed (named above); the other {len(error.written)} are: their indexes were written"
        ) from None
    typer.echo(f"wrote {len(written)} index(es) beside the tars in {directory}")


def verify_command(directory: Path) -> None:
    from clipkit.app import api

    report = api.verify(directory)
    for problem in report["problems"]:
        typer.secho(f"  {problem}", fg="red", err=True)
    if report["problems"]:
        raise ClipkitError(f"{directory}: {len(report['problems'])} problem(s); the shard set is not intact")
    typer.echo(f"{directory}: {report['n']} samples in {report['shards']} shard(s) match the manifest")


@fails_cleanly
def train_command(
    recipe: Annotated[str, typer.Argument(help="Recipe NAME[@VARIANT] or a YAML file")],
    overrides: Annotated[list[str], typer.Argument(help="key=value recipe overrides")] = None,
    run_dir: Annotated[Path, typer.Option(help="Run directory (default runs/<recipe>-<time>)")] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue the run in --run-dir from its newest checkpoint")
    ] = False,
    data: Annotated[
        str, typer.Option(help="Train on these shards or table (sharded first); evaluate on a held-out part")
    ] = None,
    holdout: Annotated[
        float, typer.Option(help="Fraction of --data held out of training for evaluation (by key hash)")
    ] = 0.05,
    holdout_by: Annotated[
        str,
        typer.Option(
            help="Column of --data whose groups are held out whole (all rows of a group on one side); "
            "without it rows are split one by one and the report says how many held-out captions and "
            "labels also occur in training"
        ),
    ] = None,
    label: Annotated[
        str, typer.Option(help="Column of --data with a class: adds zero-shot over its values")
    ] = None,
    eval_data: Annotated[
        list[str], typer.Option(help="More data to evaluate on (retrieval; zero-shot with --label)")
    ] = None,
    epochs: Annotated[
        float,
        typer.Option(
            help="With --data: train this many epochs over your data (tiny variants by default: a budget "
            "of 96 000 pairs seen, at most 200 epochs); train.steps=N still wins"
        ),
    ] = None,
    report_to: Annotated[
        list[str],
        typer.Option(
            help="Experiment tracker (repeatable or comma-separated): tensorboard, wandb, mlflow "
            "or an Accelerate tracker name; sets train.report_to"
        ),
    ] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help=NO_VERIFY_HELP)] = False,
    trust_checkpoint: Annotated[bool, typer.Option("--trust-checkpoint", help=TRUST_HELP)] = False,
):
    """Train a recipe (sharding its data source first if needed), export and evaluate.

    SIGTERM or Ctrl-C finishes the current step, writes a checkpoint, prints the command that
    resumes it and exits with 143 / 130; a second signal stops at once.
    """
    from clipkit.app import api
    from clipkit.train.runtime import launched_as_main

    if epochs is not None and not 0 < epochs < float("inf"):  # nan fails both comparisons
        raise ClipkitError(f"--epochs must be a positive finite number of passes, got {epochs}")
    own_data = None
    if data is not None or eval_data or label is not None or holdout_by is not None:
        if resume:
            raise ClipkitError("--data/--eval-data/--label start a new run; a resumed run keeps its data")
        from clipkit.app.own_data import OwnData

        own_data = OwnData(
            data, holdout=holdout, label=label, eval_data=tuple(eval_data or ()), epochs=epochs,
            holdout_by=holdout_by,
        )  # fmt: skip
        if epochs is not None and not own_data.is_own:
            raise ClipkitError("--epochs counts passes over your own --data; synthetic data: set train.steps")
        notes = own_data.notes()
        if launched_as_main():
            for note in notes:
                typer.echo(note)
    elif epochs is not None:
        raise ClipkitError("--epochs counts passes over your --data; without it, set train.steps=N")
    overrides = list(overrides or [])
    if report_to:
        names = [name.strip() for item in report_to for name in item.split(",") if name.strip()]
        overrides.append(f"train.report_to=[{','.join(names)}]")
    with step_progress("training", total=None, enabled=launched_as_main()) as report:
        result = api.train(
            recipe,
            overrides,
            run_dir=run_dir,
            resume=resume,
            registry=registry(),
            progress=lambda done, total, metrics: report(completed=done, total=total, metrics=metrics),
            verify=not no_verify,
            trust_checkpoint=trust_checkpoint,
            own_data=own_data,
        )
    if result.is_main:  # under `accelerate launch` only process 0 reports
        print_summary(result)


@fails_cleanly
def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (recipe.yaml + checkpoints/)")],
    out: Annotated[Path, typer.Argument(help="Export directory to write")],
    checkpoint: Annotated[Path, typer.Option(help="A specific checkpoint (default: the newest)")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help=NO_VERIFY_HELP)] = False,
    trust_checkpoint: Annotated[bool, typer.Option("--trust-checkpoint", help=TRUST_HELP)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
    ema: Annotated[
        bool, typer.Option("--ema", help="Export the weight EMA (train.ema) instead of the live weights")
    ] = False,
    keep_adapters: Annotated[
        bool,
        typer.Option("--keep-adapters", help="Keep LoRA adapters (model.lora) apart instead of merging them"),
    ] = False,
):
    """Write model.safetensors + clipkit.json from a run's checkpoint.

    OUT must be new, empty or an earlier export; --overwrite replaces any other folder (never the run).
    """
    from clipkit.app import api

    path = api.export(
        run_dir,
        out,
        checkpoint=checkpoint,
        registry=registry(),
        verify=not no_verify,
        trust_checkpoint=trust_checkpoint,
        overwrite=overwrite,
        ema=ema,
        keep_adapters=keep_adapters,
    )
    typer.echo(f"exported {run_dir}{' (EMA weights)' if ema else ''} to {path}")


@fails_cleanly
def convert_command(
    source: Annotated[
        Path,
        typer.Argument(
            help="A clipkit export, open_clip or Hugging Face CLIP directory, "
            "or an OpenAI-layout .safetensors state dict"
        ),
    ],
    out: Annotated[
        Path, typer.Argument(help="Where to write (a directory; a .safetensors file for state_dict)")
    ],
    to: Annotated[
        str,
        typer.Option(
            help="Target layout (or one an installed plugin writes)", autocompletion=convert_layouts
        ),
    ] = "clipkit",
    quick_gelu: Annotated[bool, typer.Option(help=QUICK_GELU_HELP)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
):
    """Convert plain CLIP weights between clipkit, open_clip, OpenAI and Hugging Face layouts.

    OUT must be new, empty or an earlier output of the same layout; --overwrite replaces any other
    (never SOURCE)."""
    from clipkit.app import api

    path = api.convert(source, out, to, quick_gelu=quick_gelu, overwrite=overwrite, registry=registry())
    typer.echo(f"converted {source} to {path} ({to})")


@fails_cleanly
def eval_command(
    export_dirs: Annotated[
        list[str],
        typer.Argument(
            metavar="EXPORT...",
            help="Export directories (clipkit.json + model.safetensors), run directories (their export/), "
            "`latest` (the run under runs/ exported last), or open_clip / Hugging Face CLIP directories "
            "or OpenAI-layout .safetensors files (converted on the fly); each gets its own report",
        ),
    ],
    task: Annotated[
        str,
        typer.Option(
            help="Eval task, one of the registered evals (default: the export's recipe's eval list)",
            autocompletion=eval_task_names,
        ),
    ] = None,
    data: Annotated[
        str, typer.Option(help="Data URI or shard directory for --task; with --tasks alone, the suite's root")
    ] = None,
    label: Annotated[str, typer.Option(help="Meta-data key with the class (zero_shot)")] = None,
    dataset: Annotated[
        str, typer.Option(help="Standard dataset whose class names and prompts zero_shot uses (e.g. cifar10)")
    ] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Extra task argument key=value")] = None,
    tasks_file: Annotated[
        Path,
        typer.Option(
            "--tasks", help="YAML file with a list of eval tasks (a benchmark suite, e.g. docs/datacomp.yaml)"
        ),
    ] = None,
    output: Annotated[
        Path,
        typer.Option(help="JSON report path (default: a new EXPORT/eval-<tasks>-<data>-<time>.json)"),
    ] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots next to the JSON report")] = True,
    no_verify: Annotated[bool, typer.Option("--no-verify", help=NO_VERIFY_HELP)] = False,
    quick_gelu: Annotated[bool, typer.Option(help=QUICK_GELU_HELP)] = None,
):
    """Evaluate exports: zero-shot, retrieval, linear probe, diagnostics (table, JSON, Markdown, PNG).

    Several exports (a glob over runs) are evaluated in turn, each with its own report."""
    tasks, skip_missing = None, False
    if tasks_file is not None:
        suite_root = data if task is None else None  # --data with --tasks alone: the suite's root
        tasks, skip_missing = read_tasks_file(tasks_file, suite_root)
    if task is not None:
        config = {"name": task, **dict(parse_pairs(set_ or [], typed=True))}
        given = (("data", data), ("label", label), ("dataset", dataset))
        config.update({k: v for k, v in given if v is not None})
        tasks = (tasks or []) + [config]
    from clipkit.eval.targets import resolve_targets

    exports, failures = resolve_targets(export_dirs, output), []
    for export_dir in exports:
        if len(exports) > 1:
            typer.echo(f"== {export_dir}")
        try:
            evaluate_one(export_dir, tasks, output, plots=plots, no_verify=no_verify, quick_gelu=quick_gelu,
                         skip_missing=skip_missing)  # fmt: skip
        except ClipkitError as error:
            if len(exports) == 1:
                raise
            failures.append(f"{export_dir}: {error}")  # the other exports are still evaluated
    if failures:
        raise ClipkitError(f"{len(failures)} of {len(exports)} exports failed: {'; '.join(failures)}")


def evaluate_one(export_dir: Path, tasks, output, *, plots, no_verify, quick_gelu, skip_missing) -> None:
    """Evaluate one export, print its table and write its report (``clipkit eval``)."""
    from clipkit.app import api
    from clipkit.artifacts.io import check_output_path
    from clipkit.eval.report_index import next_report_path, release_claim, report_home

    claimed = output is None and Path(export_dir).exists()  # a missing export is named by evaluate
    if claimed:
        check_output_path(report_home(export_dir) / "eval.json", "eval report")
        output = next_report_path(export_dir, tasks)  # created exclusively: no other eval gets the name
    try:
        report = api.evaluate(
            export_dir,
            tasks,
            registry=registry(),
            output=output,
            plots=plots,
            verify=not no_verify,
            quick_gelu=quick_gelu,
            skip_missing=skip_missing,
        )
    except BaseException:
        if claimed:
            release_claim(output)  # no report written: the claimed name goes
        raise
    print_evals(report["results"], report.get("summary"))
    from clipkit.eval.suite import skipped_summary

    skipped = skipped_summary(report["results"], len(tasks or []))
    if skipped:
        typer.echo(skipped)
    typer.echo(f"report written to {output} (+ {output.with_suffix('.md').name}{', plots' if plots else ''})")
    raise_if_failed(report["results"])


def raise_if_failed(results: list[dict]) -> None:
    """A non-zero exit (after the report is written) when any eval task failed, naming each."""
    from clipkit.eval.evaluate import failed_tasks
    from clipkit.eval.report import task_label

    failed = failed_tasks(results)
    if failed:
        reasons = "; ".join(f"{task_label(r)}: {r['failed']}" for r in failed)
        raise ClipkitError(f"{len(failed)} of {len(results)} eval task(s) failed: {reasons}")


def read_tasks_file(path: Path, root: str | None = None) -> tuple[list[dict], bool]:
    """(tasks, skip missing) of a YAML list of eval tasks, or a mapping with an ``eval:`` list (a
    recipe works too; a suite may set ``root:`` — replaced by ``root`` here — and ``missing: skip``,
    see :mod:`clipkit.eval.suite`)."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from clipkit.artifacts.files import one_line, read_text, yaml_problem
    from clipkit.config.recipe import resolve_interpolations

    text = read_text(path, "tasks file")
    try:
        config = OmegaConf.create(text or "[]")
        if root is not None:
            if not isinstance(config, DictConfig) or "root" not in config:
                raise ClipkitError(
                    f"{path}: --data with --tasks sets the suite's `root:`, which this file has not"
                )
            config.root = str(root)
        loaded = resolve_interpolations(config, str(path))
    except yaml.MarkedYAMLError as error:
        raise ClipkitError(f"{path}: tasks file is not valid YAML ({yaml_problem(error)})") from error
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ClipkitError(f"{path}: tasks file cannot be read ({one_line(error)})") from error
    tasks = loaded.get("eval") if isinstance(loaded, dict) else loaded
    if not isinstance(tasks, list) or not all(isinstance(t, dict) and "name" in t for t in tasks):
        raise ClipkitError(f"{path}: expected a list of tasks like `- {{name: zero_shot, data: ...}}`")
    if not tasks:  # an empty suite evaluated nothing, after loading the model, under another message
        raise ClipkitError(f"{path}: the tasks file lists no tasks; add `- {{name: zero_shot, data: ...}}`")
    missing = loaded.get("missing", "refuse") if isinstance(loaded, dict) else "refuse"
    if missing not in ("skip", "refuse"):
        raise ClipkitError(f"{path}: missing: must be skip or refuse, got {missing!r}")
    return tasks, missing == "skip"


@fails_cleanly
def report_command(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="Run or export directories, eval reports, or CLIP_benchmark result JSONs to compare"
        ),
    ],
    out: Annotated[Path, typer.Option(help="Directory for loss.png, eval.json/.md and plots")] = Path(
        "report"
    ),
    metric: Annotated[
        list[str], typer.Option(help="Logged metric to plot against step (repeatable; default loss)")
    ] = None,
):
    """Compare runs: loss curves overlaid, and their eval results side by side."""
    from clipkit.app import api

    written = api.report(runs, out, metrics=metric or None)
    for path in written:
        typer.echo(f"wrote {path}")


@fails_cleanly
def plugins_command(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False):
    """List plugins with their distribution, version and registered names."""
    from clipkit.contract.manager import plugin_distribution

    reg = registry()
    rows = []
    owned = reg.by_plugin()
    for name, plugin in sorted(reg.pm.list_name_plugin(), key=lambda item: item[0]):
        distribution, version = plugin_distribution(reg.pm, plugin)
        hooks = sorted(h.name for h in reg.pm.get_hookcallers(plugin) or [])
        rows.append(
            {
                "plugin": name,
                "distribution": distribution,
                "version": version,
                "registers": owned.get(name, {}),
                "hooks": hooks,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table("plugin", "distribution", "registers")
    for row in rows:
        registers = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in row["registers"].items())
        other = [h for h in row["hooks"] if not h.startswith("register_")]
        table.add_row(row["plugin"], f"{row['distribution']} {row['version']}", registers or ", ".join(other))
    console().print(table)
    typer.echo(convertible_note())


def convertible_note() -> str:
    """Which plugins `clipkit convert` can hand to open_clip / Hugging Face (docs/interop.md): the
    interop plugin's own description (its module docstring), read through the plugin manager."""
    return (
        "clipkit convert (open_clip / Hugging Face / OpenAI layouts) handles plain CLIP models only: "
        "encoders vit*, text_transformer*, clip_text (output cls/eos, no weight head), clip_resnet, rn*; "
        "tokenizer clip_bpe; similarity dot (no bias). "
        "Other towers, tokenizers and similarities (point sets, weight heads, WPSE, SigLIP's bias, BERT, "
        "conv nets...) have no plain-CLIP counterpart; Hugging Face CLIPModel has no ResNet image tower."
    )


@fails_cleanly
def recipes_command():
    """List recipes and their variants."""
    from rich.table import Table

    from clipkit.config.recipe import read_base, variants_of

    reg = registry()
    table = Table("recipe", "variants", "description")
    for entry in reg.entries("recipe"):
        recipe = read_base(entry.name, reg)
        variants = ", ".join(variants_of(entry.name, reg))
        table.add_row(entry.name, variants, first_sentence(str(recipe.get("description", ""))))
    console().print(table)


SENTENCE_END = re.compile(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z])")


def first_sentence(text: str) -> str:
    """A description's first sentence ('et al.', 'e.g.' and 'i.e.' do not end one)."""
    text = " ".join(text.split())
    match = SENTENCE_END.search(text)
    return text if match is None else text[: match.start() + 1]


@fails_cleanly
def validate_command(
    recipe: Annotated[str, typer.Argument(help="Recipe NAME[@VARIANT] or a YAML file")],
    overrides: Annotated[list[str], typer.Argument(help="key=value recipe overrides")] = None,
    show: Annotated[bool, typer.Option(help="Print the resolved recipe")] = False,
):
    """Check every plugin slot of a recipe against its factory's signature, and its data location
    as `train` would (builds nothing, writes nothing)."""
    from clipkit.app import api

    resolved = api.resolve(recipe, overrides or [], registry())
    if show:
        from omegaconf import OmegaConf

        from clipkit.app.own_data import knob_lines

        typer.echo(OmegaConf.to_yaml(OmegaConf.create(resolved)))
        typer.echo("\n".join(knob_lines(resolved)))
    api.check_data(resolved, registry())
    from clipkit.config.recipe import distributed_config, section
    from clipkit.tiled.settings import explain
    from clipkit.train.runtime import sharding

    typer.echo(explain(resolved, registry(), section(resolved, "data").batch_size))
    typer.echo(sharding.explain(distributed_config(resolved), section(resolved, "train").precision))
    typer.echo(f"{resolved['name']}: ok")


def parse_pairs(items: list[str], typed: bool = False) -> list[tuple[str, object]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ClipkitError(f"expected key=value, got {item!r}")
        if typed:
            from clipkit.config.recipe import parse_value

            value = parse_value(value)
        pairs.append((key, value))
    return pairs


#: Telemetry on the progress bar: (metrics key, label, scale; 100 = a percentage).
PROGRESS_TELEMETRY = (
    ("samples_per_s_per_device", "samples/s/device", 1),
    ("mfu", "MFU", 100),
    ("data_wait_share", "data wait", 100),
)


class step_progress:
    """A rich progress bar on stderr, hidden when stderr is not a terminal.

    Yields ``report(advance=0, *, completed=None, total=None, metrics=None)``.
    """

    def __init__(self, description: str, total: int | None, enabled: bool = True) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(stderr=True),
            transient=False,
            disable=not (enabled and sys.stderr.isatty()),
        )
        self.task = self.progress.add_task(description, total=total, status="")

    def __enter__(self):
        self.progress.__enter__()

        def report(advance: int = 0, *, completed=None, total=None, metrics: dict | None = None) -> None:
            """Advance by ``advance`` or jump to ``completed`` (resumed runs start mid-way)."""
            loss, metrics = (metrics or {}).get("loss"), metrics or {}
            status = f"loss {loss:.4f}" if isinstance(loss, float) else ""
            for key, label, scale in PROGRESS_TELEMETRY:  # samples/s per device, MFU, data wait
                if isinstance(metrics.get(key), float):
                    unit = "%" if scale == 100 else ""
                    status += f"  {label} {metrics[key] * scale:.3g}{unit}"
            self.progress.update(self.task, advance=advance, completed=completed, total=total, status=status)

        return report

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)


def print_summary(result) -> None:
    typer.echo(f"run: {result.run_dir}  ({result.seconds:.0f} s)")
    shown = {
        k: v for k, v in result.metrics.items() if k in ("loss", "acc_i2t", "logit_scale", "lr", "epoch")
    }
    typer.echo(
        "final: "
        + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
    )
    if result.export_dir:
        typer.echo(f"export: {result.export_dir}")
    if result.evals:
        from clipkit.eval.report import summarize

        print_evals(result.evals, summarize(result.evals))
        typer.echo(f"eval report: {result.run_dir / 'eval.json'}")
    from clipkit.app.run_length import short_run_note

    note = short_run_note(result.metrics)
    if note:  # the last line, where it is read
        typer.echo(f"note: {note}")
    if result.evals:
        raise_if_failed(result.evals)


def print_evals(results: list[dict], summary: dict | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from clipkit.eval.evaluate import result_warnings
    from clipkit.eval.report import metric_rows, task_label

    table = Table("task", "metric", "value")  # the task label names its data; the JSON has the full URI
    for result in results:
        task = escape(task_label(result))  # labels hold [split]s, which rich would read as markup
        if result.get("failed"):
            table.add_row(task, "[red]failed[/red]", escape(result["failed"]))
        for key in ("missing", "not_run"):
            if result.get(key):
                table.add_row(task, f"[yellow]{key.replace('_', ' ')}[/yellow]", escape(result[key]))
        for key, value in metric_rows(result):
            table.add_row(task, key, value)
            task = ""  # name each task once
        for warning in result_warnings(result):
            table.add_row(task, "[yellow]warning[/yellow]", escape(warning))
    for key, value in (summary or {}).items():
        table.add_row("average" if key == next(iter(summary)) else "", key, f"{value:.4g}")
    console().print(table)


def global_options(
    log_level: Annotated[
        str, typer.Option(help="Logging level of clipkit's messages: debug, info, warning, error")
    ] = "info",
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of errors (damaged files, bad settings)")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=show_version, is_eager=True, help="Print the version and distribution name"
        ),
    ] = False,
):
    """clipkit — contrastive multimodal (CLIP-family) pretraining research toolkit.

    Options before the command: logging goes to stderr (step lines when stderr is no terminal);
    --debug also prints the traceback of user-facing errors."""
    from clipkit.app.commands import DEBUG
    from clipkit.app.watch import configure_logging

    DEBUG["on"] = debug
    try:
        configure_logging(log_level)
    except ClipkitError as error:
        raise typer.BadParameter(str(error), param_hint="--log-level") from None


def make_app(pm=None) -> typer.Typer:
    """A fresh Typer app with the built-in commands and every plugin's ``register_commands``."""
    # add_completion: --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)
    app.callback(help=HELP)(global_options)
    app.command("shard")(shard_command)
    app.command("train")(train_command)
    app.command("export")(export_command)
    app.command("convert", cls=lists_choices(to=convert_layouts))(convert_command)
    app.command("eval", cls=lists_choices(task=eval_task_names))(eval_command)
    app.command("report")(report_command)
    app.command("plugins")(plugins_command)
    app.command("recipes")(recipes_command)
    app.command("validate")(validate_command)
    from clipkit.contract.registry import use_plugin_manager

    if pm is None:
        from clipkit.contract.manager import make_plugin_manager

        pm = make_plugin_manager()
    use_plugin_manager(pm)
    from clipkit.contract.registry import call_registration

    for impl in reversed(pm.hook.register_commands.get_hookimpls()):  # pluggy's call order
        call_registration(pm, impl, "register_commands", app=app)  # a plugin's bug: one line, not a traceback
    return app


def main() -> None:
    from clipkit.app.quiet import route_third_party_warnings

    route_third_party_warnings()  # third-party warnings go to the debug log (CLIPKIT_DEBUG=1 shows them)
    try:
        app = make_app()
    except ClipkitError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
