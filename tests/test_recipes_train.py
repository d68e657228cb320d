"""Every recipe that has a `tiny` variant trains 20 steps on CPU with finite losses, alone and composed
with each of its other variants (issue 3's bar).

A variant whose every setting `tiny` overrides (`cloob@rn101+tiny` keeps nothing of rn101) resolves
to the very recipe of another spec; such a spec is trained once, through its first spec, and
:func:`test_every_spec_trains_as_itself_or_as_an_identical_recipe` pins that they are identical.
"""

from __future__ import annotations

import functools
import json
import math

import pytest

from clipkit.app import api
from clipkit.config.recipe import variants_of
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry

REGISTRY = Registry(make_plugin_manager(autoload=False))
SPECS = [
    f"{name}@{variant}+tiny" if variant != "tiny" else f"{name}@tiny"
    for name in REGISTRY.names("recipe")
    if "tiny" in variants_of(name, REGISTRY)
    for variant in variants_of(name, REGISTRY)
]


SOURCE = "synthetic://shapes?n=96&split=train&image_size=48"
# Batch 8: 20 steps train ~0.75x the CPU of batch 16, and a smaller batch is the harder case for
# the losses' finite values (fewer positives and negatives per anchor). Batches are loaded in the
# training process: a loader worker process (forked from the pytest worker each epoch) cost ~0.35
# CPU-s of a run's ~1.5, and the recipes, not the loader, are the point here.
OVERRIDES = [
    "data.batch_size=8",
    "data.num_workers=0",
    "train.steps=20",
    "train.log_every=1",
    "train.export=false",
]
#: Keys that describe a recipe without changing what it trains.
DESCRIPTIVE = ("name", "overrides", "description", "notes", "paper")


@functools.cache
def training_content(spec: str) -> str:
    """What ``spec`` trains (its resolved recipe without the descriptive keys), comparable as text;
    resolved once per spec (collection needs it for the parameters, a test compares it again)."""
    recipe = api.resolve(spec, [f"data.source={SOURCE}", *OVERRIDES], REGISTRY)
    return json.dumps({k: v for k, v in recipe.items() if k not in DESCRIPTIVE}, sort_keys=True)


def first_spec_of_each_recipe(specs: list[str]) -> dict[str, str]:
    """spec -> the first spec resolving to the same training content (itself when it is the first)."""
    first: dict[str, str] = {}
    return {spec: first.setdefault(training_content(spec), spec) for spec in specs}


SAME_AS = first_spec_of_each_recipe(SPECS)
TRAINED = [spec for spec in SPECS if SAME_AS[spec] == spec]


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


def test_every_spec_trains_as_itself_or_as_an_identical_recipe():
    assert set(TRAINED) <= set(SPECS) and len(TRAINED) >= 30  # only exact duplicates are left out
    for spec, trained in SAME_AS.items():
        assert trained in TRAINED and training_content(spec) == training_content(trained), spec


@pytest.mark.slow
@pytest.mark.parametrize("spec", TRAINED)
def test_trains_20_steps_with_finite_losses(spec, shards, tmp_path):
    overrides = [f"data.shards={shards}", f"data.source={SOURCE}", *OVERRIDES]
    result = api.train(spec, overrides, run_dir=tmp_path / "run", registry=REGISTRY)
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 20 and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    assert result.metrics["loss"] == losses[-1]
