"""Registered batch streams (``data.stream``) and ``model.pair: vectors``: generated data trains
through the one loop, checkpoints and resumes exactly, and validates like any recipe."""

from __future__ import annotations

import shutil

import torch

from clipkit.app import api
from clipkit.config.recipe import validate
from clipkit.contract.registry import default_registry
from clipkit.plugins.experiments.pmi import LatentPairDistribution, LatentPairStream, study_stream
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint


def vectors_recipe(steps: int, **train) -> dict:
    tower = {"name": "point_set_mlp", "points": 3, "weighted": True, "hidden": 16}
    return {
        "name": "vectors-test",
        "seed": 5,
        "data": {"stream": study_stream(LatentPairDistribution(4, 3, 5, seed=2)), "batch_size": 8},
        "model": {
            "pair": "vectors",
            "embed_dim": 4,
            "image_encoder": {**tower, "in_dim": 3},
            "text_encoder": {**tower, "in_dim": 5},
        },
        "similarity": {"name": "kme"},
        "loss": {"name": "infonce"},
        "optimizer": {"name": "adam", "lr": 0.01},
        "schedule": {"name": "constant"},
        "train": {"steps": steps, "log_every": 1, "export": False, **train},
    }


def test_a_stream_recipe_validates_without_shards_or_tokenizer():
    assert validate(vectors_recipe(2), default_registry()) == []
    broken = vectors_recipe(2)
    broken["data"]["stream"]["seed"] = 3  # the host sets the run's seed
    assert any("data.stream.seed: set by clipkit" in error for error in validate(broken, default_registry()))


def test_stream_restore_replays_the_same_batches():
    stream = LatentPairStream(batch_size=4, seed=1, x_dim=3, y_dim=5)
    batches = [next(stream) for _ in range(3)]
    position = {"batches": 1}
    again = LatentPairStream(batch_size=4, seed=1, x_dim=3, y_dim=5)
    again.restore(position)
    assert torch.equal(next(again)["x"], batches[1]["x"])
    assert torch.equal(batches[2]["index"], torch.arange(8, 12))


def test_trains_through_the_loop_and_resumes_bit_identically(tmp_path):
    registry = default_registry()
    full = tmp_path / "full"
    model = api.train_in_process(vectors_recipe(6, checkpoint_every=3, keep_checkpoints=3), full, registry)
    losses = [line for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6
    first = list_checkpoints(full)[0]
    expected = load_checkpoint(list_checkpoints(full)[-1])["model"]
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in expected.items())

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(first, resumed / "checkpoints" / first.name)
    (resumed / "recipe.yaml").write_text((full / "recipe.yaml").read_text())
    api.train("vectors-test", run_dir=resumed, resume=True, registry=registry)
    got = load_checkpoint(list_checkpoints(resumed)[-1])["model"]
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
