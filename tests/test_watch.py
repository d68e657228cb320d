"""Watching a run: trackers (train.report_to) read back from what they wrote, plain-text step
lines, the run-level hooks, --log-level and warnings routed through logging."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clipkit.app import api
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.errors import ClipkitError
from clipkit.eval.report import metric_rows, task_label
from clipkit.plugins.loggers import progress_log, trackers

pytestmark = pytest.mark.timeout(900)
SMOKE = "quickstart@smoke"
SOURCE = "synthetic://shapes?n=512&split=train&image_size=48"
INSTALLED = [name for name in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(name)]


def registry(*extra) -> Registry:
    return Registry(make_plugin_manager(autoload=False, extra_plugins=list(extra)))


class Events:
    """Records the run-level hooks in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def on_run_start(self, run, recipe, start_step):
        self.calls.append(("start", recipe["name"], start_step))

    @hookimpl
    def on_evals(self, step, results, run):
        self.calls.append(("evals", step, len(results)))

    @hookimpl
    def on_run_end(self, run, status):
        self.calls.append(("end", status))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """One 4-step run with every installed tracker, export and the recipe's evals, step lines
    captured; the recipe has two eval tasks."""
    root = tmp_path_factory.mktemp("watched")
    shards = root / "shards"
    api.shard(SOURCE, shards, registry=registry())
    run_dir = root / "run"
    lines, events, logger = Lines(), Events(), logging.getLogger("clipkit.progress")
    logger.addHandler(lines)
    previous, logger.level = logger.level, logging.INFO
    overrides = [f"data.shards={shards}", "train.steps=4", "train.log_every=2",
                 f"train.report_to=[{','.join(INSTALLED)}]"]  # fmt: skip
    try:
        result = api.train(SMOKE, overrides, run_dir=run_dir, registry=registry(events))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(previous)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "run_dir": run_dir,
        "result": result,
        "lines": lines.lines,
        "events": events.calls,
        "logged": logged,
    }


def expected_scalars(watched) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of metrics.jsonl plus the final eval results."""
    expected: dict[str, dict[int, float]] = {}
    for row in watched["logged"]:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                expected.setdefault(key, {})[row["step"]] = float(value)
    for result in watched["result"].evals:
        for key, _ in metric_rows(result):
            expected.setdefault(f"eval/{task_label(result)}/{key}", {})[4] = float(result[key])
    return expected


@pytest.mark.slow  # one 4-step run with export and evals (the module fixture)
def test_the_run_hooks_come_in_order(watched):
    assert watched["events"] == [("start", SMOKE, 0), ("evals", 4, 2), ("end", "finished")]


@pytest.mark.slow  # one 4-step run with export and evals (the module fixture)
def test_step_lines_every_log_every_with_loss_lr_speed_and_eta(watched):
    lines = watched["lines"]
    assert len(lines) == 2 and lines[0].startswith("step 2/4  loss ") and lines[1].startswith("step 4/4  ")
    for line, row in zip(lines, watched["logged"], strict=True):
        assert f"loss {row['loss']:.4g}" in line and f"lr {row['lr']:.4g}" in line
        assert "samples/s " in line and " ETA 0:" in line
    assert lines[1].endswith("ETA 0:00:00")


@pytest.mark.slow  # one 4-step run with export and evals (the module fixture)
def test_tensorboard_event_files_hold_the_metrics_the_evals_and_the_recipe(watched):
    if "tensorboard" not in INSTALLED:
        pytest.skip("tensorboard is not installed (pip install -e '.[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(watched["run_dir"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    expected = expected_scalars(watched)
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        got = {event.step: event.value for event in events.Scalars(key)}
        assert got == pytest.approx(by_step, rel=1e-6), key  # TensorBoard stores float32
    assert "recipe/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "steps: 4" in text and "report_to" in text


@pytest.mark.slow  # one 4-step run with export and evals (the module fixture)
def test_mlflow_store_holds_the_metrics_params_and_recipe(watched, monkeypatch):
    if "mlflow" not in INSTALLED:
        pytest.skip("mlflow is not installed (pip install -e '.[trackers]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(watched["run_dir"] / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(SMOKE).experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.steps"] == "4" and run.data.params["data.batch_size"] == "32"
    expected = expected_scalars(watched)
    clean = {trackers.MLflow.BAD_KEY_CHARACTERS.sub("_", key): by_step for key, by_step in expected.items()}
    assert set(run.data.metrics) == set(clean)
    for key, by_step in clean.items():
        got = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx(by_step, rel=1e-12), key
    recipe = Path(client.download_artifacts(run.info.run_id, "recipe.yaml", str(watched["run_dir"] / "dl")))
    assert "steps: 4" in recipe.read_text()


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file: a 7-byte header (``:W&B``, magic, version),
    then LevelDB's log format (32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, position = path.read_bytes(), 32768, 7
    raws, pending = [], b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            raws.append(pending)
    records = []
    for raw in raws:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


@pytest.mark.slow  # one 4-step run with export and evals (the module fixture)
def test_wandb_offline_run_holds_the_metrics_the_evals_and_the_config(watched):
    if "wandb" not in INSTALLED:
        pytest.skip("wandb is not installed (pip install -e '.[trackers]')")
    (path,) = (watched["run_dir"] / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads
    records = wandb_records(path)
    history: dict[str, dict[int, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # _step, _runtime, _timestamp: W&B's own
                    history.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    expected = expected_scalars(watched)
    assert set(history) == set(expected)
    for key, by_step in expected.items():
        assert history[key] == pytest.approx(by_step, rel=1e-12), key
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update
    }
    assert config["train"]["steps"] == 4 and config["name"] == SMOKE
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]


def test_an_accelerate_tracker_logs_through_accelerate(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = trackers.open_tracker(
        "accelerate:tensorboard", tmp_path, {"name": "x", "train": {"steps": 3}}, 0
    )
    tracker.log({"loss": 1.5}, 3)
    tracker.log({"loss": 0.5}, 6)
    tracker.finish("finished")
    events = EventAccumulator(str(tmp_path / "tensorboard" / tmp_path.name))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 1.5), (6, 0.5)]


def test_an_unknown_tracker_is_named_with_the_known_ones(tmp_path):
    with pytest.raises(ClipkitError, match=r"unknown tracker 'tensorbored'; known: .*mlflow.*tensorboard"):
        trackers.open_tracker("tensorbored", tmp_path, {"name": "x"}, 0)


@pytest.mark.parametrize(
    "name, module", [("wandb", "wandb"), ("mlflow", "mlflow.tracking"), ("tensorboard", "tensorboard")]
)
def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ClipkitError, match=rf"{name} needs the .* package.*clipkit-contrastive\[trackers\]"):
        trackers.open_tracker(name, tmp_path, {"name": "x"}, 0)


def test_report_to_accepts_a_list_or_comma_separated_text():
    assert trackers.report_to({"train": {"report_to": "tensorboard, mlflow"}}) == ["tensorboard", "mlflow"]
    assert trackers.report_to({"train": {"report_to": ["wandb"]}}) == ["wandb"]
    assert trackers.report_to({"train": {}}) == []


def test_no_step_lines_on_a_terminal(monkeypatch, caplog):
    class Run:
        directory, is_main = Path("r"), True

    caplog.set_level(logging.INFO, logger="clipkit.progress")
    monkeypatch.setattr(progress_log, "to_terminal", lambda: True)
    progress_log.on_metrics(step=2, metrics={"loss": 1.0}, run=Run())
    assert caplog.records == []
    monkeypatch.setattr(progress_log, "to_terminal", lambda: False)
    progress_log.on_metrics(step=2, metrics={"loss": 1.0}, run=Run())
    assert [r.getMessage() for r in caplog.records] == ["step 2  loss 1"]


def test_log_level_and_warnings_go_through_logging():
    script = (
        "import logging, warnings\n"
        "from clipkit.app.watch import configure_logging\n"
        "configure_logging('warning')\n"
        "logging.getLogger('clipkit.x').info('hidden at warning')\n"
        "warnings.warn('a third-party library complains')\n"
        "configure_logging('debug')\n"
        "logging.getLogger('clipkit.x').debug('shown at debug')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "WARNING py.warnings: " in done.stderr and "a third-party library complains" in done.stderr
    assert "hidden at warning" not in done.stderr and "DEBUG clipkit.x: shown at debug" in done.stderr


def test_a_bad_log_level_is_refused_by_the_cli():
    env = {**os.environ, "CLIPKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-m", "clipkit", "--log-level", "loud", "recipes"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--log-level" in done.stderr and "debug, info" in done.stderr
