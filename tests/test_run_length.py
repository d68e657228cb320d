"""Own-data runs sized by epochs (clipkit.app.run_length): defaults, the start line, the short-run note."""

from __future__ import annotations

import json
import math

import pytest
from test_own_data_flow import write_drawings
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.app.own_data import is_held_out
from clipkit.app.run_length import (
    DEFAULT_EPOCHS,
    MAX_DEFAULT_STEPS,
    RunLength,
    plan_line,
    sets_steps,
    short_run_note,
    sized_by_epochs,
    steps_for,
)
from clipkit.errors import ClipkitError


def test_tiny_variants_are_sized_by_epochs():
    assert sized_by_epochs("clip@tiny") and sized_by_epochs("wpse@imq+tiny") and sized_by_epochs("quickstart")
    assert not sized_by_epochs("clip") and not sized_by_epochs("clip@b32") and not sized_by_epochs("my.yaml")


def test_steps_for_epochs_round_up_and_cap():
    assert steps_for(10, 3000, 64) == 469  # ceil(30 000 / 64)
    assert steps_for(0.01, 100, 64) == 1  # never zero steps
    assert steps_for(DEFAULT_EPOCHS, 1_000_000, 64, cap=MAX_DEFAULT_STEPS) == MAX_DEFAULT_STEPS
    with pytest.raises(ClipkitError, match="--epochs must be > 0"):
        steps_for(0, 100, 64)


def test_user_steps_are_recognised():
    assert sets_steps(["data.batch_size=8", "train.steps=5"]) and sets_steps(["+train.steps=5"])
    assert not sets_steps(["train.steps_per_eval=5", "data.batch_size=8"])


def test_plan_line_and_short_run_note():
    assert plan_line(RunLength(469, 64, 3000)).startswith("train: 469 steps = 10 epochs of your 3000 samples")
    short = plan_line(RunLength(20, 64, 2850))  # the case: 20 steps of 64 over 2 850 rows
    assert "20 steps = 0.449 epochs of your 2850 samples" in short and "under one epoch" in short
    assert "0.45 of an epoch" in short_run_note({"epoch": 0.449})
    assert short_run_note({"epoch": 1.0}) is None and short_run_note({}) is None


def test_several_processes_never_shard_before_training(in_tmp, monkeypatch, registry):
    """Under a launcher every process runs the sizing before any can wait for another: a table not
    yet sharded keeps the recipe's steps (process 0 shards it during training); shards made
    before the launch are counted."""
    from clipkit.app import api
    from clipkit.app.run_length import plan

    table = write_drawings(in_tmp, n=40)
    overrides = [f"data.source={in_tmp / table}", f"data.shards={in_tmp / 'shards'}"]
    recipe = api.resolve("clip@tiny", overrides, registry)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan(recipe, registry, epochs=None, by_default=True) is None
    assert not (in_tmp / "shards").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    length = plan(recipe, registry, epochs=2, by_default=True)
    assert (length.num_samples, length.batch_size, length.steps) == (40, 40, 2)  # fit_batch: 40 rows
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan(recipe, registry, epochs=2, by_default=True).steps == 2  # shards there: counted


def test_epochs_without_data_is_refused():
    outcome = CliRunner().invoke(make_app(), ["train", "clip@tiny", "--epochs", "3"])
    assert outcome.exit_code == 2 and "--epochs counts passes over your --data" in outcome.output


@pytest.mark.slow
def test_own_data_run_lasts_epochs_and_a_short_one_says_so(in_tmp):
    """`clipkit train clip@tiny --data TABLE`: 10 epochs over the training rows, said at the start;
    `train.steps=1` (under one epoch) is kept, and the last line and the report say it was short."""
    runner, app = CliRunner(), make_app()
    table = write_drawings(in_tmp, n=96)
    kept = 96 - sum(is_held_out(str(i), 0.05) for i in range(96))
    quick = ["data.num_workers=0", "train.memory_check=false", "train.checkpoint_every=100"]
    outcome = runner.invoke(app, ["train", "clip@tiny", "--data", table, "--run-dir", "run", *quick])
    assert outcome.exit_code == 0, outcome.output
    steps = math.ceil(DEFAULT_EPOCHS * kept / 64)
    assert f"train: {steps} steps = {steps * 64 / kept:.3g} epochs of your {kept} samples" in outcome.output
    last = json.loads((in_tmp / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == steps and last["epoch"] >= DEFAULT_EPOCHS
    assert "note:" not in outcome.output and "Note" not in (in_tmp / "run" / "eval.md").read_text()

    short = runner.invoke(
        app, ["train", "clip@tiny", "--data", table, "--run-dir", "run2", "train.steps=1", *quick]
    )
    assert short.exit_code == 0, short.output
    assert f"train: 1 steps = {64 / kept:.3g} epochs of your {kept} samples" in short.output
    assert (
        short.output.strip()
        .splitlines()[-1]
        .startswith(f"note: this run ended after {64 / kept:.2f} of an epoch")
    )
    assert "**Note:** this run ended after" in (in_tmp / "run2" / "eval.md").read_text()
    assert json.loads((in_tmp / "run2" / "eval.json").read_text())["notes"][0].startswith("this run ended")
