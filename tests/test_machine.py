"""Defaults that fit the machine: auto loader workers and torch threads from the usable CPUs, a
one-line notice, recipe checks; and `validate --show` lists the knobs a user sets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from clipkit.config import machine
from clipkit.errors import RecipeError


@pytest.fixture
def cpus(monkeypatch):
    def set_cpus(count: int, processes: int = 1) -> None:
        monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        for name in machine.THREAD_VARIABLES:  # the environment's thread count is tested below
            monkeypatch.delenv(name, raising=False)

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


def test_explicit_values_are_kept_and_still_announced(cpus):
    cpus(2)
    fit = machine.fit_to_machine(3, 5)
    assert (fit.workers, fit.threads) == (3, 5)
    assert (
        fit.notice
        == "machine: 1 process(es), each with 5 torch thread(s) and 3 loader worker(s); 2 usable CPU(s)"
    )
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
    from clipkit.app import api

    assert api.resolve("clip@tiny", ["data.num_workers=auto", "train.threads=2"], registry)
    with pytest.raises(RecipeError) as error:
        api.resolve("clip@tiny", ["data.num_workers=many", "train.threads=0", "data.holdout=1.5"], registry)
    text = str(error.value)
    assert "data.num_workers: must be auto or an integer >= 0" in text
    assert (
        "train.threads: must be auto or an integer >= 1" in text and "data.holdout: must be in [0, 1)" in text
    )


def test_validate_show_lists_the_knobs():
    from clipkit.app.cli import make_app

    # data.source: validate checks the data as train does, and clip's data/shards is a placeholder
    outcome = CliRunner().invoke(make_app(), ["validate", "clip", "data.source=synthetic://shapes", "--show"])
    assert outcome.exit_code == 0, outcome.output
    assert "num_workers: auto" in outcome.output  # the full-size recipe derives it
    for knob in ("data.shards", "data.holdout", "data.background", "train.threads"):
        assert f"#   {knob}:" in outcome.output


def test_auto_threads_follow_omp_num_threads(cpus, monkeypatch):
    """`train.threads=auto` ignored OMP_NUM_THREADS=1 (8 threads on a shared 16-CPU node)."""
    cpus(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    fit = machine.fit_to_machine("auto", "auto", processes=1)
    assert (fit.workers, fit.threads) == (8, 1)
    assert "train.threads=1 (from OMP_NUM_THREADS)" in fit.notice
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert machine.fit_to_machine("auto", "auto").threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")  # not a count: the next variable, then auto
    assert machine.fit_to_machine("auto", "auto").threads == 3
    explicit = machine.fit_to_machine("auto", 4)
    assert (
        explicit.threads == 4
        and "train.threads=4 from the recipe overrides MKL_NUM_THREADS=3" in explicit.notice
    )


def test_a_launch_of_several_processes_that_started_one_is_named(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    assert machine.launch_warning(1) is None  # `clipkit train`: nothing asked for
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # accelerate's single-process launcher ...
    assert machine.launch_warning(1) is None  # ... asked for one process
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # ... asked for several: it sets the address
    warning = machine.launch_warning(1)
    assert warning.startswith("warning: accelerate launch was asked for") and "started 1" in warning
    assert "--multi_gpu" in warning and "\n" not in warning
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real multi-process launch
    assert machine.launch_warning(2) is None


def test_accelerate_launch_cpu_with_two_processes_says_it_runs_one(tmp_path):
    """`accelerate launch --num_processes 2 --cpu -m clipkit train` ran ONE process with no word."""
    pytest.importorskip("accelerate")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "clipkit", "train", "quickstart@smoke", "train.steps=2", "--run-dir", "run"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    (notice,) = [line for line in lines if line.startswith("machine:")]
    assert notice.startswith("machine: 1 process(es), each with 1 torch thread(s)")
    assert "train.threads=1 (from OMP_NUM_THREADS)" in notice
    (warning,) = [line for line in lines if line.startswith("warning: accelerate launch")]
    assert "asked for 2 processes but started 1" in warning
    assert "Traceback" not in done.stderr
