"""Every recipe that has a `tiny` variant trains on CPU, alone and composed with each other variant."""

from __future__ import annotations

import json
import math

import pytest

from clipkit import api
from clipkit.manager import make_plugin_manager
from clipkit.recipe import variants_of
from clipkit.registry import Registry

REGISTRY = Registry(make_plugin_manager(autoload=False))
SPECS = [
    f"{name}@{variant}+tiny" if variant != "tiny" else f"{name}@tiny"
    for name in REGISTRY.names("recipe")
    if "tiny" in variants_of(name, REGISTRY)
    for variant in variants_of(name, REGISTRY)
    if variant not in ("cc12m",)  # changes only data/steps, which `tiny` overrides again
]


SOURCE = "synthetic://shapes?n=96&split=train&image_size=48"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data") / "shapes"
    api.shard(SOURCE, directory, registry=REGISTRY)
    return directory


def test_the_paper_recipes_have_tiny_variants():
    assert {
        "clip@tiny",
        "wpse@imq_50_50+tiny",
        "wpse@cossim_mean+tiny",
        "kme_clip@tiny",
        "siglip@tiny",
    } <= set(SPECS)


@pytest.mark.parametrize("spec", SPECS)
def test_trains_a_few_steps_with_finite_losses(spec, shards, tmp_path):
    overrides = [
        f"data.shards={shards}",
        f"data.source={SOURCE}",
        "data.batch_size=16",
        "train.steps=3",
        "train.log_every=1",
        "train.export=false",
    ]
    result = api.train(spec, overrides, run_dir=tmp_path / "run", registry=REGISTRY)
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 3 and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    assert result.metrics["loss"] == losses[-1]
