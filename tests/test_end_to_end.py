"""shard -> train a few steps -> export -> eval, with golden numbers; exact resume; export round trip.

Regenerate the golden numbers (after an intended change of the numerics) with:

    CLIPKIT_REGENERATE_GOLDEN=1 python -m pytest tests/test_end_to_end.py -k golden
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from clipkit.app import api
from clipkit.errors import ClipkitError
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

GOLDEN = Path(__file__).parent / "golden" / "smoke.json"
SMOKE = ["train.steps=8", "train.log_every=2", "train.checkpoint_every=4", "data.num_workers=0"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One tiny CLIP run on the embedded synthetic data, shared by the tests below."""
    root = tmp_path_factory.mktemp("smoke")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        result = api.train("quickstart@smoke", SMOKE, run_dir=root / "run", registry=fresh_registry())
    finally:
        os.chdir(cwd)
    return root, result


def fresh_registry():
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    return Registry(make_plugin_manager(autoload=False))


def test_golden_losses_and_eval(smoke_run):
    root, result = smoke_run
    observed = {
        "losses": {str(m["step"]): m["loss"] for m in read_metrics(result.run_dir)},
        "eval": {
            f"{r['name']}:{r.get('label', '')}": {k: v for k, v in r.items() if isinstance(v, float)}
            for r in result.evals
        },
    }
    if os.environ.get("CLIPKIT_REGENERATE_GOLDEN"):
        GOLDEN.write_text(
            json.dumps(
                {"command": "clipkit train quickstart@smoke " + " ".join(SMOKE), **observed},
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )
    golden = json.loads(GOLDEN.read_text())
    assert set(observed["losses"]) == {"2", "4", "6", "8"}
    for step, loss in golden["losses"].items():
        assert observed["losses"][step] == pytest.approx(loss, rel=1e-3, abs=1e-4), f"step {step}"
    for task, metrics in golden["eval"].items():
        for name, value in metrics.items():
            assert observed["eval"][task][name] == pytest.approx(value, abs=0.02), f"{task} {name}"


def test_run_directory_layout(smoke_run):
    root, result = smoke_run
    run = result.run_dir
    assert (run / "recipe.yaml").is_file() and (run / "eval.json").is_file()
    assert [p.name for p in list_checkpoints(run)] == ["step-00000004", "step-00000008"]
    assert (root / "data" / "smoke-shapes" / "manifest.json").is_file()  # sharded on first use
    report = json.loads((run / "eval.json").read_text())
    assert [r["name"] for r in report["results"]] == ["zero_shot", "retrieval"]
    assert {"i2t_R@1", "t2i_R@10", "mean_recall"} <= set(report["results"][1])


def test_export_is_self_describing_and_round_trips_bit_exact(smoke_run):
    root, result = smoke_run
    metadata = json.loads((result.export_dir / "clipkit.json").read_text())
    assert metadata["plugins"]["model.image_encoder"]["name"] == "vit_tiny"
    assert metadata["plugins"]["similarity"]["distribution"] == "clipkit-contrastive"
    assert metadata["tokenizer"]["name"] == "hashed_words"
    assert metadata["preprocessing"]["image_size"] == 48
    assert metadata["recipe"]["name"] == "quickstart@smoke"

    from clipkit.artifacts.reader import load_export

    model, _ = load_export(result.export_dir, fresh_registry())
    saved = load_checkpoint(list_checkpoints(result.run_dir)[-1])["model"]
    loaded = model.state_dict()
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert torch.equal(tensor, loaded[key]), key


def test_reading_an_export_draws_no_initial_weights_and_keeps_buffers(smoke_run, monkeypatch):
    """The export's weights replace every parameter, so reading it draws none (torch.nn.init's random
    initialisers skip parameters while it builds); a buffer drawn with them (a plugin's seeded random
    features) is still drawn, and torch.nn.init is itself again afterwards."""
    from clipkit.artifacts.reader import load_export
    from clipkit.model import RANDOM_INITS, build_model, parameters_not_initialised

    _, result = smoke_run
    drawn = []  # per call of Tensor.normal_ (what torch.nn.init.normal_ draws with): on a parameter?
    original = torch.Tensor.normal_

    def counting_normal(tensor, *args, **kwargs):
        drawn.append(isinstance(tensor, torch.nn.Parameter))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", counting_normal)
    registry = fresh_registry()
    model, metadata = load_export(result.export_dir, registry)
    assert not any(drawn)
    build_model(metadata["recipe"], registry)  # the same build, not reading an export: it draws them
    assert any(drawn)
    saved = load_checkpoint(list_checkpoints(result.run_dir)[-1])["model"]
    assert all(torch.equal(model.state_dict()[key], tensor) for key, tensor in saved.items())

    class Seeded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.register_buffer("features", torch.zeros(4), persistent=False)
            generator = torch.Generator().manual_seed(0)
            torch.nn.init.normal_(self.weight, generator=generator)
            torch.nn.init.normal_(self.features, generator=torch.Generator().manual_seed(0))

    before = [getattr(torch.nn.init, name) for name in RANDOM_INITS]
    with parameters_not_initialised():
        built = Seeded()
    assert torch.equal(built.weight.detach(), torch.zeros(4))  # skipped: the export's value replaces it
    assert torch.equal(built.features, Seeded().features) and built.features.abs().sum() > 0
    assert [getattr(torch.nn.init, name) for name in RANDOM_INITS] == before


def test_exporting_a_run_draws_no_initial_weights(smoke_run, tmp_path, monkeypatch):
    """The export writer's model takes every parameter from the checkpoint (strictly): it is built
    without drawing initial values for them, and the export holds the checkpoint's weights."""
    from safetensors.torch import load_file

    _, result = smoke_run
    drawn = []
    original = torch.Tensor.normal_

    def counting_normal(tensor, *args, **kwargs):
        drawn.append(isinstance(tensor, torch.nn.Parameter))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", counting_normal)
    out = api.export(result.run_dir, tmp_path / "again", registry=fresh_registry())
    assert not any(drawn)
    saved = load_checkpoint(list_checkpoints(result.run_dir)[-1])["model"]
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[key], tensor) for key, tensor in saved.items())


def test_eval_reads_the_export_alone(smoke_run, tmp_path):
    root, result = smoke_run
    moved = tmp_path / "moved-export"
    result.export_dir.rename(moved)  # no run directory, no shards needed
    try:
        report = api.evaluate(moved, None, registry=fresh_registry(), output=tmp_path / "r.json")
    finally:
        moved.rename(result.export_dir)
    assert report["results"][0]["n"] == 64
    assert json.loads((tmp_path / "r.json").read_text())["results"] == report["results"]


def test_resume_continues_exactly(smoke_run, tmp_path, monkeypatch):
    """Drop the last checkpoint, resume from step 4: the final weights equal the uninterrupted run's."""
    root, result = smoke_run
    monkeypatch.chdir(root)
    interrupted = tmp_path / "interrupted"
    (interrupted / "checkpoints").mkdir(parents=True)
    first = list_checkpoints(result.run_dir)[0]
    shutil.copytree(first, interrupted / "checkpoints" / first.name)
    (interrupted / "recipe.yaml").write_text((result.run_dir / "recipe.yaml").read_text())

    with pytest.raises(ClipkitError, match="is a run of recipe 'quickstart@smoke'"):
        api.train("clip", run_dir=interrupted, resume=True, registry=fresh_registry())
    resumed = api.train("quickstart@smoke", run_dir=interrupted, resume=True, registry=fresh_registry())
    expected = load_checkpoint(list_checkpoints(result.run_dir)[-1])
    got = load_checkpoint(list_checkpoints(interrupted)[-1])
    assert got["step"] == 8 and got["data"] == expected["data"]
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    assert resumed.metrics["loss"] == read_metrics(result.run_dir)[-1]["loss"]


def test_refuses_to_overwrite_a_run(smoke_run):
    root, result = smoke_run
    with pytest.raises(ClipkitError, match="already holds a run"):
        api.train("quickstart@smoke", SMOKE, run_dir=result.run_dir, registry=fresh_registry())
