"""Weight EMA (issue 39 item 1, ``train.ema``): the update against a float64 recurrence, skipped
steps, checkpoint round trips, kill -9 then bit-identical resume, ``clipkit export --ema``, the
in-training evaluation of the EMA weights, and the recipe checks (ZeRO-3 / FSDP2 refused)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from safetensors.torch import load_file
from smoke_data import place_smoke_shards

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.config.settings_schema import EmaConfig
from clipkit.errors import ArtifactError, RecipeError
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint
from clipkit.train.ema import WeightEMA, ema_state_dict, update_ema

SMOKE = "quickstart@smoke"
EMA = ["train.ema.decay=0.9", "train.ema.warmup=3", "train.ema.every=2"]


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)  # a locked parameter: never averaged
    return model


def reference_average(snapshots: list[dict], decay: float, warmup: int, every: int) -> dict:
    """The documented recurrence, written independently, in float64: ``snapshots[0]`` are the
    initial weights, ``snapshots[t]`` the weights after applied optimiser step t."""
    average = {k: v.double() for k, v in snapshots[0].items()}
    for t in range(1, len(snapshots)):
        if t % every:
            continue
        d = (decay * (min(1.0, t / warmup) if warmup else 1.0)) ** every
        average = {k: d * average[k] + (1 - d) * snapshots[t][k].double() for k in average}
    return average


@pytest.mark.parametrize(("decay", "warmup", "every"), [(0.9, 0, 1), (0.8, 3, 2), (0.99, 5, 3)])
def test_update_follows_the_float64_recurrence_and_ignores_skipped_steps(decay, warmup, every):
    model = tiny_model()
    ema = WeightEMA(model, EmaConfig(decay=decay, warmup=warmup, every=every))
    assert set(ema.average) == {"0.weight", "0.bias", "1.weight"}  # the locked bias is not averaged
    assert all(t.dtype == torch.float32 for t in ema.average.values())
    trained = lambda: {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}  # noqa: E731
    snapshots = [trained()]
    generator = torch.Generator().manual_seed(1)
    for step in range(9):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator))
        if step in (2, 5):  # a skipped optimiser step: the weights changed (not really), nothing counted
            update_ema(ema, applied=False)
            continue
        update_ema(ema, applied=True)
        snapshots.append(trained())
    assert ema.applied_steps == 7 and ema.updates == 7 // every
    expected = reference_average(snapshots, decay, warmup, every)
    for name, tensor in expected.items():
        assert torch.allclose(ema.average[name].double(), tensor, rtol=1e-6, atol=1e-6), name
    assert ema.num_bytes == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_decay_zero_tracks_the_live_weights_and_half_precision_weights_average_in_fp32():
    model = tiny_model().to(torch.bfloat16)
    ema = WeightEMA(model, EmaConfig(decay=0.0))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.after_optimizer_step()
    assert ema.average["0.weight"].dtype == torch.float32
    assert torch.equal(ema.average["0.weight"], model[0].weight.float())


def test_the_average_follows_the_weights_to_the_device_the_model_moves_to():
    """The trainer builds the EMA before runtime.prepare moves the model (on a GPU run: CPU ->
    CUDA, which failed on an H200 with a device mismatch); the average must follow its weights.
    'meta' stands in for the other device here."""
    model = tiny_model()
    ema = WeightEMA(model, EmaConfig(decay=0.5))
    model.to("meta")
    ema.after_optimizer_step()
    assert all(tensor.device.type == "meta" for tensor in ema.average.values())
    assert all(tensor.dtype == torch.float32 for tensor in ema.average.values())


def test_state_round_trip_is_bit_identical_and_damage_is_named():
    model = tiny_model()
    ema = WeightEMA(model, EmaConfig(decay=0.7, warmup=2))
    for _ in range(3):
        with torch.no_grad():
            model[0].weight.mul_(1.1)
        ema.after_optimizer_step()
    state = ema.state_dict()
    again = WeightEMA(tiny_model(), EmaConfig(decay=0.7, warmup=2))
    again.load_state_dict(state, "state.pt")
    assert (again.applied_steps, again.updates) == (3, 3)
    for name, tensor in ema.average.items():
        assert torch.equal(again.average[name], tensor), name
    damaged = {**state, "weights": {k: v for k, v in state["weights"].items() if k != "0.bias"}}
    with pytest.raises(
        ArtifactError, match=r"state.pt: its EMA weights do not fit the model \(missing \['0.bias'\]"
    ):
        again.load_state_dict(damaged, "state.pt")
    with pytest.raises(ArtifactError, match="state.pt: `ema` is not an EMA state"):
        again.load_state_dict([1, 2], "state.pt")
    merged = ema_state_dict(model.state_dict(), state, "state.pt")
    assert torch.equal(merged["1.bias"], model[1].bias) and torch.equal(
        merged["0.weight"], ema.average["0.weight"]
    )


# ----------------------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.ema.decay=1.5"], "train.ema.decay: must be >= 0 and < 1, got 1.5"),
        (["train.ema.every=0"], "train.ema.every: must be > 0"),
        (["train.ema.deacy=0.9"], "train.ema.deacy: unknown key"),
        (["train.ema.eval=best"], "train.ema.eval: must be one of live, ema, both"),
        (
            ["train.ema.decay=0.9", "train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"],
            "train.ema: weight EMA is not supported with ZeRO-3: each process holds only a shard",
        ),
        (
            ["train.ema.decay=0.9", "train.distributed.strategy=fsdp2"],
            "train.ema: weight EMA is not supported with FSDP2",
        ),
    ],
)
def test_recipe_errors_name_the_key(registry, overrides, message):
    with pytest.raises(RecipeError, match=message):
        validate_or_raise(load_recipe(SMOKE, overrides, registry=registry), registry)


def test_zero_1_and_2_are_accepted(registry):
    for stage in (1, 2):
        overrides = [
            "train.ema.decay=0.9",
            "train.distributed.strategy=deepspeed",
            f"train.distributed.zero_stage={stage}",
        ]
        validate_or_raise(load_recipe(SMOKE, overrides, registry=registry), registry)


# ----------------------------------------------------------------------------- a run with EMA


def cli(*args: str):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    return CliRunner().invoke(make_app(make_plugin_manager(autoload=False)), list(args))


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, smoke_shards):
    """quickstart@smoke, 6 steps, EMA evaluated (both) at step 2 and 4, checkpoints at 2/4/6."""
    root = tmp_path_factory.mktemp("ema-run")
    place_smoke_shards(root, smoke_shards)
    previous = os.getcwd()
    os.chdir(root)
    try:
        overrides = [
            "train.steps=6",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=3",
            "train.eval_every=2",
        ]
        overrides += ["train.export=false", *EMA]
        done = cli("train", SMOKE, *overrides, "--run-dir", str(root / "run"))
        assert done.exit_code == 0, done.output
    finally:
        os.chdir(previous)
    return root


def test_checkpoints_hold_the_average_and_it_differs_from_the_live_weights(ema_run):
    state = load_checkpoint(list_checkpoints(ema_run / "run")[-1])
    assert state["ema"]["applied_steps"] == 6 and state["ema"]["updates"] == 3
    weights = state["ema"]["weights"]
    assert set(weights) == {k for k in state["model"] if k in weights} and "similarity.log_scale" in weights
    assert any(not torch.equal(weights[k], state["model"][k]) for k in weights)


def test_export_ema_writes_the_average_and_plain_export_the_live_weights(ema_run, monkeypatch):
    monkeypatch.chdir(ema_run)
    state = load_checkpoint(list_checkpoints(ema_run / "run")[-1])
    done = cli("export", str(ema_run / "run"), str(ema_run / "ema-export"), "--ema")
    assert done.exit_code == 0 and "(EMA weights)" in done.output, done.output
    done = cli("export", str(ema_run / "run"), str(ema_run / "live-export"))
    assert done.exit_code == 0, done.output
    averaged = load_file(ema_run / "ema-export" / "model.safetensors")
    live = load_file(ema_run / "live-export" / "model.safetensors")
    for key, tensor in state["model"].items():
        assert torch.equal(live[key], tensor), key
        expected = state["ema"]["weights"].get(key, tensor)  # buffers and locked weights: the live ones
        assert torch.equal(averaged[key], expected), key
    evaluated = cli("eval", str(ema_run / "ema-export"))
    assert evaluated.exit_code == 0 and "zero_shot" in evaluated.output, evaluated.output


def test_in_training_evaluation_scores_live_and_ema_weights(ema_run):
    rows = [json.loads(line) for line in (ema_run / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in rows if any(k.startswith("eval") for k in row)]
    assert [row["step"] for row in evaluated] == [2, 4]
    for row in evaluated:
        live = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
        averaged = {k.removeprefix("eval_ema/"): v for k, v in row.items() if k.startswith("eval_ema/")}
        assert live and set(live) == set(averaged)


def test_ema_with_decay_zero_scores_exactly_the_live_weights(registry, in_tmp, smoke_shards):
    place_smoke_shards(in_tmp, smoke_shards)
    """The EMA copy the evaluation builds is the model with the average loaded: with decay 0 the
    average is the live weights, so both score the same."""
    from clipkit.train.build import build_trainer
    from clipkit.train.loop import evaluate_during_training, train_step

    overrides = ["train.ema.decay=0.0", "train.ema.eval=both"]
    recipe = validate_or_raise(load_recipe(SMOKE, overrides, registry=registry), registry)
    (in_tmp / "run").mkdir()
    trainer = build_trainer(recipe, in_tmp / "run", registry)
    batch = trainer.runtime.to_device(next(iter(trainer.stream)))
    update_ema(trainer.ema, train_step(trainer, batch, 0).applied)
    results = evaluate_during_training(trainer, 1)
    half = len(results) // 2
    assert half and results[:half] == results[half:]


def test_export_ema_of_a_run_without_ema_and_resuming_it_with_ema_are_refused(in_tmp, smoke_shards):
    place_smoke_shards(in_tmp, smoke_shards)
    run = in_tmp / "plain"
    done = cli("train", SMOKE, "train.steps=2", "train.export=false", "--run-dir", str(run))
    assert done.exit_code == 0, done.output
    done = cli("export", str(run), str(in_tmp / "out"), "--ema")
    assert done.exit_code == 2 and "no EMA weights to export (the run had no train.ema)" in done.output
    # Resuming it with train.ema would restart the average from the resumed weights: refused.
    done = cli("train", SMOKE, "train.steps=4", "train.export=false", *EMA, "--resume", "--run-dir", str(run))
    assert done.exit_code == 2 and "the checkpoint holds no EMA weights" in done.output, done.output


# ----------------------------------------------------------------------------- kill -9, then resume


def train_command(run_dir: Path, *extra: str) -> list[str]:
    overrides = [
        "train.steps=10",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=3",
        "train.export=false",
    ]
    return [
        "train",
        SMOKE,
        *overrides,
        *EMA,
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def newest_step(run_dir: Path) -> int:
    directory = run_dir / "checkpoints"
    names = [p.name for p in directory.glob("*step-*")] if directory.is_dir() else []
    return max((int(name.split("step-")[1].split(".")[0]) for name in names), default=0)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [3])  # one point: each case is three 10-step runs
def test_kill_9_then_resume_keeps_the_average_bit_identical(in_tmp, kill_at):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    warm_launch.run(train_command(in_tmp / "reference"), cwd=in_tmp, env=env, check=True)
    expected = load_checkpoint(list_checkpoints(in_tmp / "reference")[-1])
    run_dir = in_tmp / "killed"
    process = warm_launch.WarmLaunch(train_command(run_dir), cwd=in_tmp, env=env)
    deadline = time.monotonic() + 300
    while newest_step(run_dir) < kill_at and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode != 0, "the run finished before the kill landed"
    warm_launch.run(train_command(run_dir, "--resume"), cwd=in_tmp, env=env, check=True)
    got = load_checkpoint(list_checkpoints(run_dir)[-1])
    assert got["step"] == expected["step"] == 10
    assert got["ema"]["applied_steps"] == expected["ema"]["applied_steps"] == 10
    assert got["ema"]["updates"] == expected["ema"]["updates"] == 5
    for key, tensor in expected["ema"]["weights"].items():
        assert torch.equal(got["ema"]["weights"][key], tensor), key
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def test_the_memory_estimate_counts_the_average(registry):
    from clipkit.model import build_model
    from clipkit.train.memory_fit import estimate_memory
    from clipkit.train.runtime import BatchPlan

    plan = BatchPlan.split(32, 0, 1)
    parts = {}
    for name, overrides in (("plain", []), ("ema", ["train.ema.decay=0.9", "model.frozen=[text_encoder]"])):
        recipe = validate_or_raise(load_recipe(SMOKE, overrides, registry=registry), registry)
        model = build_model(recipe, registry)
        if overrides:
            model.text_encoder.requires_grad_(False)  # what model.frozen does when training builds it
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        parts[name] = estimate_memory(recipe, model, plan, world_size=1, device="cpu", workers=0).parts
        parts[name + "-trainable"] = trainable
    assert parts["plain"]["weight EMA"] == 0
    assert parts["ema"]["weight EMA"] == 4 * parts["ema-trainable"] < 4 * parts["plain-trainable"]
