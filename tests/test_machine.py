"""Defaults that fit the machine: auto loader workers and torch threads from the usable CPUs, a
one-line notice, recipe checks; and `validate --show` lists the knobs a user sets."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from clipkit import machine
from clipkit.errors import RecipeError


@pytest.fixture
def cpus(monkeypatch):
    def set_cpus(count: int, processes: int = 1) -> None:
        monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))

    return set_cpus


CASES = [(1, 1, 0, 1), (2, 1, 1, 1), (16, 1, 8, 8), (64, 1, 8, 56), (32, 4, 4, 4)]


@pytest.mark.parametrize(("count", "processes", "workers", "threads"), CASES)
def test_auto_splits_the_usable_cpus(cpus, count, processes, workers, threads):
    cpus(count, processes)
    fit = machine.fit_to_machine("auto", "auto")
    assert (fit.workers, fit.threads) == (workers, threads)
    assert f"{count} usable CPU(s)" in fit.notice and f"data.num_workers={workers}" in fit.notice


GPU_CASES = [(1, 1, 0, 1), (2, 1, 1, 1), (4, 1, 2, 2), (16, 1, 14, 2), (64, 1, 32, 32), (64, 8, 6, 2)]


@pytest.mark.parametrize(("count", "processes", "workers", "threads"), GPU_CASES)
def test_auto_on_a_gpu_gives_the_cpus_to_the_loader(cpus, count, processes, workers, threads):
    """Training on a GPU, all but two CPUs decode (the host process launches kernels); the measured
    case: 16 cores, 8 workers starved a ViT-B/16 bf16 step on an H200, 16 fed it."""
    cpus(count, processes)
    fit = machine.fit_to_machine("auto", "auto", accelerator=True)
    assert (fit.workers, fit.threads) == (workers, threads)
    assert machine.fit_to_machine(3, "auto", accelerator=True).workers == 3


def test_explicit_values_are_kept_and_not_announced(cpus):
    cpus(2)
    fit = machine.fit_to_machine(3, 5)
    assert (fit.workers, fit.threads, fit.notice) == (3, 5, "")
    only_threads = machine.fit_to_machine(0, "auto")
    assert only_threads.threads == 2 and "train.threads=2" in only_threads.notice
    assert "num_workers" not in only_threads.notice


def test_apply_sets_torch_threads_and_prints_once(cpus, capsys):
    before = torch.get_num_threads()
    try:
        machine.apply(machine.MachineFit(workers=0, threads=1, notice="machine: x"), announce=True)
        assert torch.get_num_threads() == 1
        assert capsys.readouterr().err.strip() == "machine: x"
        machine.apply(machine.MachineFit(workers=0, threads=1, notice="machine: x"), announce=False)
        assert capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(before)


def test_recipe_checks_the_machine_settings(registry):
    from clipkit import api

    assert api.resolve("clip@tiny", ["data.num_workers=auto", "train.threads=2"], registry)
    with pytest.raises(RecipeError) as error:
        api.resolve("clip@tiny", ["data.num_workers=many", "train.threads=0", "data.holdout=1.5"], registry)
    text = str(error.value)
    assert "data.num_workers: must be auto or an integer >= 0" in text
    assert (
        "train.threads: must be auto or an integer >= 1" in text and "data.holdout: must be in [0, 1)" in text
    )


def test_validate_show_lists_the_knobs():
    from clipkit.cli import make_app

    # data.source: validate checks the data as train does, and clip's data/shards is a placeholder
    outcome = CliRunner().invoke(make_app(), ["validate", "clip", "data.source=synthetic://shapes", "--show"])
    assert outcome.exit_code == 0, outcome.output
    assert "num_workers: auto" in outcome.output  # the full-size recipe derives it
    for knob in ("data.shards", "data.holdout", "data.background", "train.threads"):
        assert f"#   {knob}:" in outcome.output
