"""Step telemetry in every log line (issue 38): samples/s per device, MFU, data-wait share, the step
split, peak memory — in metrics.jsonl, the plain-text log line and ``clipkit report``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from smoke_data import place_smoke_shards
from torch import nn

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.contract.registry import default_registry
from clipkit.errors import ClipkitError, RecipeError
from clipkit.train import telemetry
from clipkit.train.build import build_trainer
from clipkit.train.loop import train_loop
from clipkit.train.telemetry import (
    PhaseClock,
    Telemetry,
    looked_up_peak,
    peak_tflops,
    training_flops_per_sample,
)


@pytest.fixture(scope="module")
def registry():
    return default_registry()


def run(registry, run_dir: Path, *overrides: str) -> list[dict]:
    recipe = validate_or_raise(
        load_recipe(
            "quickstart@smoke", ["train.steps=4", "train.log_every=2", *overrides], registry=registry
        ),
        registry,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    train_loop(build_trainer(recipe, run_dir, registry))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


class FakeClock:
    """perf_counter replaced by a list of instants."""

    def __init__(self, *instants: float) -> None:
        self.instants = list(instants)

    def __call__(self) -> float:
        return self.instants.pop(0)


# ----------------------------------------------------------------------------- the measurements


def test_interval_metrics_from_known_times(monkeypatch):
    """Data wait 0.25 s and phases 10 / 30 / 5 ms per step, over 2 steps of 1 s: the share, the
    per-device rate and the per-step split follow by hand."""
    monkeypatch.setattr(telemetry.time, "perf_counter", FakeClock(0.0, 0.25))
    measured = Telemetry(torch.device("cpu"), world_size=2, peak=0.5, flops_per_sample=1e9)
    with measured.waiting_for_data():
        pass
    clock = measured.clock
    # step 1: start 0, forward 0.010, backward 0.040, optimizer 0.045; step 2 the same from 1.0
    monkeypatch.setattr(
        telemetry.time, "perf_counter", FakeClock(0, 0.010, 0.040, 0.045, 1, 1.010, 1.040, 1.045)
    )
    for _ in range(2):
        clock.start()
        for phase in ("forward", "backward", "optimizer"):
            clock.mark(phase)
    measured.steps = 2
    metrics = measured.interval_metrics(samples=200, elapsed_s=2.0)
    assert metrics["samples_per_s_per_device"] == pytest.approx(50.0)  # 200 / 2 s / 2 devices
    assert metrics["data_wait_share"] == pytest.approx(0.125)  # 0.25 s of 2 s
    assert metrics["step_ms"] == pytest.approx(1000.0)
    assert metrics["forward_ms"] == pytest.approx(10.0)
    assert metrics["backward_ms"] == pytest.approx(30.0)
    assert metrics["optimizer_ms"] == pytest.approx(5.0)
    assert metrics["model_tflops_per_s_per_device"] == pytest.approx(1e9 * 50 / 1e12)
    assert metrics["mfu"] == pytest.approx(1e9 * 50 / 1e12 / 0.5)
    assert metrics["cpu_peak_rss_gib"] > 0
    again = measured.interval_metrics(samples=0, elapsed_s=1.0)  # the interval was reset
    assert again["data_wait_share"] == 0.0 and "forward_ms" not in again


def test_no_mfu_without_a_peak():
    metrics = Telemetry(torch.device("cpu"), 1, peak=None, flops_per_sample=3e6).interval_metrics(10, 1.0)
    assert "mfu" not in metrics and metrics["model_tflops_per_s_per_device"] == pytest.approx(3e-5)


def test_model_flops_are_three_forwards_of_one_sample():
    """Two linear towers 6 -> 4 and 5 -> 4: a forward is 2·6·4 + 2·5·4 = 88 FLOPs per sample, a
    training sample 3 x 88 = 264 (forward + the backward's two products)."""

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image, self.text = nn.Linear(6, 4), nn.Linear(5, 4)

        def forward(self, batch):
            return self.image(batch["x"]), self.text(batch["y"])

    batch = {"x": torch.randn(8, 6), "y": torch.randn(8, 5), "meta": {"id": list(range(8))}}
    model = Towers().train()
    before = torch.random.get_rng_state()
    assert training_flops_per_sample(model, batch, 8, contextlib.nullcontext()) == 264
    assert model.training and torch.equal(torch.random.get_rng_state(), before)  # no trace left


def test_peaks_by_device_name_setting_or_measured():
    assert looked_up_peak("NVIDIA H100 80GB HBM3", half=True) == 989.4
    assert looked_up_peak("NVIDIA H100 PCIe", half=True) == 756.5
    assert looked_up_peak("NVIDIA A100-SXM4-80GB", half=False) == 19.5
    assert looked_up_peak("NVIDIA A10", half=True) == 125.0
    assert looked_up_peak("NVIDIA L40S", half=True) == 362.1
    assert looked_up_peak("Some Accelerator 9000", half=True) is None
    cpu = torch.device("cpu")
    peak, reason = peak_tflops("auto", cpu, "no")
    assert peak is None and "train.peak_tflops" in reason
    assert peak_tflops(2.5, cpu, "no") == (2.5, "train.peak_tflops")
    measured, source = peak_tflops("measure", cpu, "bf16")
    assert measured > 0 and source == "measured (float32 matmul)"
    with pytest.raises(ClipkitError, match="train.peak_tflops"):
        peak_tflops(-1, cpu, "no")


def test_a_bad_peak_is_a_recipe_error(registry):
    with pytest.raises(RecipeError, match="train.peak_tflops"):
        validate_or_raise(
            load_recipe("quickstart@smoke", ["train.peak_tflops=fast"], registry=registry), registry
        )


def test_phase_clock_sums_host_time_per_phase(monkeypatch):
    monkeypatch.setattr(telemetry.time, "perf_counter", FakeClock(1.0, 1.5, 1.75))
    clock = PhaseClock(torch.device("cpu"))
    clock.start()
    clock.mark("forward_backward")
    clock.mark("optimizer")
    assert clock.totals_ms() == pytest.approx({"forward_backward": 500.0, "optimizer": 250.0})
    assert clock.totals_ms() == {}


# ----------------------------------------------------------------------------- in a run


def test_every_log_line_carries_the_telemetry(registry, tmp_path, monkeypatch, smoke_shards):
    monkeypatch.chdir(tmp_path)
    place_smoke_shards(tmp_path, smoke_shards)
    rows = run(registry, tmp_path / "run")
    assert [row["step"] for row in rows] == [2, 4]
    for row in rows:
        assert row["samples_per_s_per_device"] == pytest.approx(row["samples_per_s"])  # one process
        assert 0.0 <= row["data_wait_share"] <= 1.0
        phases = row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]
        assert 0 < phases <= row["step_ms"]
        assert row["model_tflops_per_s_per_device"] > 0 and row["cpu_peak_rss_gib"] > 0
        assert "mfu" not in row  # no CPU peak unless the recipe sets one


def test_mfu_against_a_peak_the_recipe_sets(registry, tmp_path, monkeypatch, smoke_shards):
    monkeypatch.chdir(tmp_path)
    place_smoke_shards(tmp_path, smoke_shards)
    rows = run(registry, tmp_path / "run", "train.peak_tflops=0.5", "train.micro_batch_size=8")
    for row in rows:
        assert row["mfu"] == pytest.approx(row["model_tflops_per_s_per_device"] / 0.5)
        assert row["forward_backward_ms"] > 0 and "forward_ms" not in row  # exact accumulation


def test_the_log_line_and_report_show_the_telemetry(registry, tmp_path, monkeypatch, smoke_shards):
    from clipkit.app import api
    from clipkit.plugins.loggers.progress_log import step_line

    monkeypatch.chdir(tmp_path)
    place_smoke_shards(tmp_path, smoke_shards)
    rows = run(registry, tmp_path / "run")
    line = step_line(rows[-1]["step"], rows[-1], {"total": 4, "first": 0, "started": 0.0})
    for part in ("samples/s/device", "data wait", "step", "fwd", "bwd", "opt", "peak"):
        assert part in line, line
    written = api.report([tmp_path / "run"], tmp_path / "report")
    assert tmp_path / "report" / "telemetry.png" in written
    assert (tmp_path / "report" / "telemetry.png").stat().st_size > 0
