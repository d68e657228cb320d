"""Experiment trackers: ``train.report_to`` (or ``clipkit train --report-to``).

Each tracker named there gets what ``RUN/metrics.jsonl`` gets (every ``on_metrics`` call: the
training numbers each ``log_every`` steps and ``eval/...`` numbers each ``eval_every``), the end-of-run
eval results (``on_evals``, flattened to ``eval/<task>/<metric>``) and the resolved recipe as its
configuration. Nothing leaves the machine:

* ``tensorboard``: event files in ``RUN/tensorboard/`` (``tensorboard --logdir RUN``); the recipe
  as a text summary ``recipe``;
* ``wandb``: Weights & Biases in offline mode, under ``RUN/wandb/`` (``wandb sync`` uploads later);
* ``mlflow``: an MLflow file store in ``RUN/mlruns/`` (``mlflow ui --backend-store-uri RUN/mlruns``);
  the recipe as flattened parameters and as the artifact ``recipe.yaml``. ``MLFLOW_TRACKING_URI``,
  when set, picks another store (e.g. ``sqlite:///mlflow.db``);
* any other name of an Accelerate tracker (``aim``, ``comet_ml``, ``clearml``, ``dvclive``,
  ``swanlab``, ``trackio``; ``accelerate:NAME`` forces Accelerate's class for the three above too),
  logging into ``RUN/NAME/``. Such a tracker follows its own package's settings (online or not).

The packages are optional: ``pip install 'clipkit-contrastive[trackers]'`` installs the first three. A name
whose package is missing, or no tracker's name, stops the run before its first step. Only the main
process tracks.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from clipkit import install_hint
from clipkit.config.dotted import get_path
from clipkit.config.settings_schema import BUILT_IN_TRACKERS
from clipkit.contract.hookspecs import hookimpl
from clipkit.errors import ClipkitError

BUILT_IN = BUILT_IN_TRACKERS
EXTRA_HINT = install_hint("trackers")
#: Open trackers per run directory (a process may train several runs, e.g. in tests).
_open: dict[str, list[Tracker]] = {}


def report_to(recipe: dict) -> list[str]:
    """``train.report_to`` as a list of names (a string may hold several, comma-separated)."""
    value = get_path(recipe, "train.report_to") or []
    names = value.split(",") if isinstance(value, str) else [str(item) for item in value]
    return [name.strip() for name in names if name.strip()]


@hookimpl
def on_run_start(run, recipe, start_step):
    names = report_to(recipe)
    if not names or not run.is_main:
        return
    trackers: list[Tracker] = []
    try:
        for name in names:
            trackers.append(open_tracker(name, Path(run.directory), recipe, start_step))
    except BaseException:
        for tracker in trackers:
            tracker.finish("failed")
        raise
    _open[str(run.directory)] = trackers


@hookimpl
def on_metrics(step, metrics, run):
    for tracker in _open.get(str(run.directory), []):
        tracker.log(numbers(metrics), step)


@hookimpl
def on_evals(step, results, run):
    trackers = _open.get(str(run.directory), [])
    if trackers:
        flat = eval_numbers(results)
        for tracker in trackers:
            tracker.log(flat, step)


@hookimpl
def on_run_end(run, status):
    for tracker in _open.pop(str(run.directory), []):
        tracker.finish(status)


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics (non-finite ones arrive as strings and are left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and v is not True and v is not False
    }


def eval_numbers(results: list[dict]) -> dict[str, float]:
    """End-of-run eval results as ``eval/<task>/<metric>`` numbers (the keys ``eval_every`` uses)."""
    from clipkit.eval.report import metric_rows, task_label

    return numbers({f"eval/{task_label(r)}/{key}": r[key] for r in results for key, _ in metric_rows(r)})


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested recipe -> ``{"train.steps": 1000, ...}`` with JSON text for lists."""
    if isinstance(config, dict):
        flat: dict[str, Any] = {}
        for key, value in config.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    # Lists as JSON text and None as "null": hyper-parameter tables take scalars only.
    value = json.dumps(config) if isinstance(config, (list, tuple)) or config is None else config
    return {prefix[:-1]: value}


def open_tracker(name: str, run_dir: Path, recipe: dict, start_step: int) -> Tracker:
    """The tracker ``name`` started for this run, its configuration stored."""
    if name.startswith("accelerate:"):
        tracker: Tracker = AccelerateTracker(name.split(":", 1)[1], run_dir, recipe)
    elif name == "tensorboard":
        tracker = TensorBoard(run_dir, recipe)
    elif name == "wandb":
        tracker = WandB(run_dir, recipe, start_step)
    elif name == "mlflow":
        tracker = MLflow(run_dir, recipe, start_step)
    else:
        tracker = AccelerateTracker(name, run_dir, recipe)
    return tracker


def need(module: str, tracker: str):
    """Import ``module`` for ``tracker``, or a ClipkitError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ClipkitError(
            f"train.report_to: {tracker} needs the {module.split('.')[0]} package ({error}); {EXTRA_HINT}"
        ) from None


class Tracker(Protocol):
    """One open tracker: ``log(numbers, step)`` and ``finish(status)``."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


def recipe_yaml(recipe: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(recipe))


class TensorBoard(Tracker):
    """Event files in ``RUN/tensorboard`` (a resumed run adds a new event file there)."""

    def __init__(self, run_dir: Path, recipe: dict) -> None:
        need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        # Four-space indent: TensorBoard renders text summaries as Markdown (a code block here).
        self.writer.add_text("recipe", "    " + recipe_yaml(recipe).replace("\n", "\n    "))
        self.writer.flush()

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed run keeps what was logged

    def finish(self, status: str) -> None:
        self.writer.close()


class WandB(Tracker):
    """Weights & Biases, offline: ``RUN/wandb/offline-run-*``; ``wandb sync`` uploads it later."""

    def __init__(self, run_dir: Path, recipe: dict, start_step: int) -> None:
        wandb = need("wandb", "wandb")
        self.run = wandb.init(
            dir=str(run_dir),
            mode="offline",
            project=os.environ.get("WANDB_PROJECT", "clipkit"),
            name=run_dir.name,
            config=recipe,
            reinit="create_new",  # several runs in one process (sweeps, tests) stay apart
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.run.summary["start_step"] = start_step

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class MLflow(Tracker):
    """An MLflow run in the file store ``RUN/mlruns`` (experiment = the recipe's name)."""

    STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
    #: MLflow keys allow letters, digits and ``_-. /``; eval task labels may hold others.
    BAD_KEY_CHARACTERS = re.compile(r"[^\w\-. /]")

    def __init__(self, run_dir: Path, recipe: dict, start_step: int) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses file stores unless told; a store inside the run needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracking = need("mlflow.tracking", "mlflow")
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        self.client = tracking.MlflowClient(tracking_uri=uri)
        name = str(recipe.get("name") or "clipkit")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        tags = {"clipkit.run_dir": str(run_dir), "clipkit.start_step": str(start_step)}
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten(recipe).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_text(self.run_id, recipe_yaml(recipe), "recipe.yaml")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(self.BAD_KEY_CHARACTERS.sub("_", k), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, self.STATUS.get(status, "FAILED"))


class AccelerateTracker(Tracker):
    """Any tracker class Accelerate knows (``accelerate.tracking.LOGGER_TYPE_TO_CLASS``), logging
    into ``RUN/<name>`` where it takes a directory."""

    def __init__(self, name: str, run_dir: Path, recipe: dict) -> None:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if name not in LOGGER_TYPE_TO_CLASS:
            known = sorted({*BUILT_IN, *LOGGER_TYPE_TO_CLASS})
            raise ClipkitError(f"train.report_to: unknown tracker {name!r}; known: {', '.join(known)}")
        cls = LOGGER_TYPE_TO_CLASS[name]
        wanted = inspect.signature(cls.__init__).parameters
        offered = {"run_name": run_dir.name, "logging_dir": str(run_dir / name)}
        try:
            self.tracker = cls(**{k: v for k, v in offered.items() if k in wanted})
            self.tracker.start()
            self.tracker.store_init_configuration(flatten(recipe))
        except ImportError as error:
            message = f"train.report_to: {name} needs its package ({error}); pip install {name}"
            raise ClipkitError(message) from None

    def log(self, values: dict[str, float], step: int) -> None:
        self.tracker.log(values, step=step)

    def finish(self, status: str) -> None:
        self.tracker.finish()
