"""Every recipe that has a `tiny` variant trains 20 steps on CPU with finite losses, alone and composed
with each of its other variants (issue 3's bar)."""

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
        "kme_clip@m10+tiny",
        "cloob@tiny",
        "cloob@infoloob+tiny",
        "cloob@infonce+tiny",
        "cloob@infonce_hopfield+tiny",
        "yaware@tiny",
        "yaware@simclr+tiny",
        "yaware@supcon+tiny",
        "yaware@align_uniform+tiny",
        "yaware@yaware_infonce+tiny",
        "yaware@mri+tiny",
        "nuclr@tiny",
        "nuclr@sogclr+tiny",
        "nuclr@clip+tiny",
        "nuclr@siglip+tiny",
        "nuclr@cyclip+tiny",
        "nuclr@dcl+tiny",
    } <= set(SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_trains_20_steps_with_finite_losses(spec, shards, tmp_path):
    overrides = [
        f"data.shards={shards}",
        f"data.source={SOURCE}",
        "data.batch_size=16",
        "train.steps=20",
        "train.log_every=1",
        "train.export=false",
    ]
    result = api.train(spec, overrides, run_dir=tmp_path / "run", registry=REGISTRY)
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 20 and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    assert result.metrics["loss"] == losses[-1]
