"""A run too large for the machine is refused before it starts (it used to be killed by the kernel
minutes later with no message), with the estimate and the knobs that lower it; near the limit it
warns; ``train.memory_check=false`` runs it anyway; the tiny recipes pass.

"Available memory" is monkeypatched (``clipkit.train.memory_fit.available_ram``), so no test needs
a small machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from smoke_data import place_smoke_shards
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager

runner = CliRunner()
GiB = 2**30
#: nuclr's default text tower without the optional all-MiniLM-L6-v2 package (its WordPiece vocabulary):
#: the same sizes (30522 ids, 32 tokens), hashed.
NO_OPTIONAL_VOCAB = "model.tokenizer={name: hashed_words, vocab_size: 30522, context_length: 32}"


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args):
    return runner.invoke(app, [str(a) for a in args])


def machine_with(monkeypatch, ram: int) -> None:
    """This machine has ``ram`` bytes available (a no-op before clipkit had the check)."""
    try:
        import clipkit.train.memory_fit as memory_fit
    except ImportError:
        return
    monkeypatch.setattr(memory_fit, "available_ram", lambda: ram)
    monkeypatch.setattr(memory_fit, "resident_bytes", lambda: 0)  # nothing held yet: figures exact


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_a_full_size_recipe_on_a_24_gib_machine_is_refused_with_the_estimate(app, in_tmp, monkeypatch):
    machine_with(monkeypatch, 24 * GiB)
    source = "data.source=synthetic://shapes?n=64"  # a data location train accepts: memory is what is refused
    result = invoke(app, "train", "nuclr", NO_OPTIONAL_VOCAB, source, "--run-dir", "run")
    line = one_error_line(result)
    assert "needs about" in line and "activations" in line and "24.00 GiB of RAM available" in line
    for knob in ("data.batch_size", "train.micro_batch_size", "train.grad_checkpointing", "train.precision"):
        assert knob in line
    assert "train.memory_check=false" in line
    assert not (in_tmp / "run" / "checkpoints").exists()  # refused before any training or data


def test_a_small_recipe_on_a_smaller_machine_is_refused_then_run_when_asked(
    app, in_tmp, monkeypatch, smoke_shards
):
    place_smoke_shards(in_tmp, smoke_shards)
    machine_with(monkeypatch, 2**20)  # 1 MiB
    args = ["train", "quickstart@smoke", "train.steps=1", "train.export=false", "--run-dir", "run"]
    line = one_error_line(invoke(app, *args))
    assert "1 MiB" in line or "0.00 GiB of RAM available" in line
    anyway = invoke(app, *args, "train.memory_check=false")
    assert anyway.exit_code == 0, anyway.output
    assert (in_tmp / "run" / "checkpoints" / "step-00000001").is_dir()


def test_memory_check_is_validated_like_every_train_setting(app):
    assert invoke(app, "validate", "quickstart@smoke", "train.memory_check=false").exit_code == 0
    result = invoke(app, "validate", "quickstart@smoke", "train.memory_check=maybe")
    assert result.exit_code == 2 and "train.memory_check" in result.output, result.output
    assert "bool" in result.output


def built(spec: str, overrides=()):
    from clipkit.app import api
    from clipkit.contract.registry import default_registry
    from clipkit.model import build_model

    registry = default_registry()
    recipe = api.resolve(spec, list(overrides), registry)
    return recipe, build_model(recipe, registry)


def cpu_runtime(batch: int, micro: int = 0):
    micro_batches = batch // micro if micro else 1
    plan = SimpleNamespace(local_size=batch, global_size=batch, micro_size=micro or batch,
                           micro_batches=micro_batches)  # fmt: skip
    return SimpleNamespace(device=torch.device("cpu"), plan=plan, world_size=1)


@pytest.mark.parametrize("spec", ["quickstart@smoke", "clip@tiny", "nuclr@tiny", "siglip@tiny"])
def test_tiny_recipes_fit_a_small_machine(spec, monkeypatch):
    from clipkit.config.recipe import section
    from clipkit.train.memory_fit import check_memory

    machine_with(monkeypatch, 4 * GiB)
    recipe, model = built(spec)
    estimate = check_memory(recipe, model, cpu_runtime(section(recipe, "data").batch_size), workers=0,
                            announce=False)  # fmt: skip
    assert 0 < estimate.total < GiB, estimate.describe()


def test_near_the_limit_it_warns_and_the_knobs_lower_the_estimate(monkeypatch, capsys):
    from clipkit.train.memory_fit import check_memory

    recipe, model = built("clip@tiny")
    machine_with(monkeypatch, 10**12)
    full = check_memory(recipe, model, cpu_runtime(64), workers=0, announce=False)
    machine_with(monkeypatch, int(full.total / 0.9))
    check_memory(recipe, model, cpu_runtime(64), workers=0, announce=True)
    assert "warning: this run needs about" in capsys.readouterr().out
    machine_with(monkeypatch, 10**12)
    micro = check_memory(recipe, model, cpu_runtime(64, micro=8), workers=0, announce=False)
    assert micro.parts["activations"] < full.parts["activations"] / 4
    recipe_bf16 = {**recipe, "train": {**recipe["train"], "precision": "bf16"}}
    half = check_memory(recipe_bf16, model, cpu_runtime(64), workers=0, announce=False)
    assert half.parts["activations"] < full.parts["activations"]


def test_the_activation_extrapolation_matches_a_measured_larger_batch():
    from clipkit.train.memory_fit import activation_bytes, random_batch, saved_activation_bytes

    recipe, model = built("clip@tiny")
    size = recipe["model"]["image_size"]
    model.train()
    measured = saved_activation_bytes(
        model, random_batch(model, 16, size), torch.autocast("cpu", enabled=False)
    )
    predicted = activation_bytes(model, 16, size, "no")
    assert abs(predicted - measured) / measured < 0.1, (predicted, measured)


def test_measuring_leaves_no_trace_on_the_model_or_the_random_streams():
    from clipkit.train.memory_fit import activation_bytes

    recipe, model = built("nuclr@tiny")  # a ResNet with BatchNorm statistics, dropout in the text tower
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    model.eval()
    assert activation_bytes(model, 32, recipe["model"]["image_size"], "no") > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
