"""Loop features the seed recipes rely on, run through `api.train` end to end:

* two-view single-modality training (y-Aware / SimCLR family) through the one loop;
* meta-data from the shards reaching the loss (with ``data.meta_keys`` renaming);
* NUCLR's per-sample state (u, ζ, ξ) surviving checkpoint -> resume exactly.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from clipkit.app import api
from clipkit.artifacts.reader import load_export
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.contract.types import LossOutput
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

SOURCE = "synthetic://shapes?n=128&split=train&image_size=48"


def registry(*extra) -> Registry:
    return Registry(make_plugin_manager(autoload=False, extra_plugins=list(extra)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data") / "shapes"
    api.shard(SOURCE, directory, registry=registry())
    return directory


def data_overrides(shards) -> list[str]:
    return [f"data.shards={shards}", f"data.source={SOURCE}", "data.batch_size=16"]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- two views


class RecordBatches:
    """A plugin whose loss records what the loop hands it (the views and the meta-data)."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def register_losses(self, register):
        recorder = self

        class Probe:
            requires = frozenset({"meta", "index", "features"})

            def __call__(self, logits, targets, ctx):
                a, b = ctx.features
                recorder.calls.append(
                    {
                        "meta": ctx.meta,
                        "index": ctx.index.tolist(),
                        "a": a.points.detach(),
                        "b": b.points.detach(),
                    }
                )
                # Something differentiable so the optimiser step runs.
                return LossOutput(-(a.points * b.points).sum(-1).mean())

        register("probe", Probe)


def test_two_view_training_feeds_two_different_views_of_each_image(shards, tmp_path):
    probe = RecordBatches()
    overrides = data_overrides(shards) + [
        "model.image_encoder=vit_tiny",
        "loss=probe",
        "train.steps=2",
        "train.log_every=1",
        "train.export=false",
    ]
    api.train("yaware@tiny", overrides, run_dir=tmp_path / "run", registry=registry(probe))
    assert len(probe.calls) == 2
    call = probe.calls[0]
    # Random-resized crops (tiny: scale 0.5..1) make the two views of a sample differ ...
    assert not torch.allclose(call["a"], call["b"])
    # ... but they come from one shared encoder: points are unit vectors of the same width.
    assert call["a"].shape == call["b"].shape == (16, 1, 32)


def test_meta_data_reaches_the_loss_per_sample_with_renamed_keys(shards, tmp_path):
    probe = RecordBatches()
    overrides = data_overrides(shards) + [
        "model.image_encoder=vit_tiny",
        "loss=probe",
        "train.steps=1",
        "train.log_every=1",
        "train.export=false",
    ]
    api.train("yaware@tiny", overrides, run_dir=tmp_path / "run", registry=registry(probe))
    meta, index = probe.calls[0]["meta"], probe.calls[0]["index"]
    source = SyntheticShapes(n=128, split="train", image_size=48)
    for row, i in enumerate(index):
        truth = source.sample(i).meta
        assert meta["colour"][row] == truth["colour"] and meta["extent"][row] == truth["extent"]
        # data.meta_keys of yaware@tiny: label <- combo, age <- extent, sex <- colour.
        assert meta["label"][row] == truth["combo"]
        assert meta["age"][row] == truth["extent"] and meta["sex"][row] == truth["colour"]
    assert len(set(index)) == 16


def test_a_missing_meta_key_is_named(shards, tmp_path):
    overrides = data_overrides(shards) + [
        "model.image_encoder=vit_tiny",
        "data.meta_keys={label: no_such_column}",
        "train.steps=1",
        "train.export=false",
    ]
    with pytest.raises(Exception, match="no_such_column"):
        api.train("yaware@tiny", overrides, run_dir=tmp_path / "run", registry=registry())


@pytest.mark.parametrize(
    "variant", ["", "@yaware_infonce+tiny", "@simclr+tiny", "@supcon+tiny", "@align_uniform+tiny"]
)
def test_two_view_recipes_train_and_export(variant, shards, tmp_path):
    spec = "yaware" + (variant or "@tiny")
    overrides = data_overrides(shards) + [
        "model.image_encoder=vit_tiny",
        "data.num_workers=0",  # the recipes are the point: no loader worker process to fork
        "train.steps=3",
        "train.log_every=1",
    ]
    result = api.train(spec, overrides, run_dir=tmp_path / "run", registry=registry())
    values = losses(tmp_path / "run")
    assert len(values) == 3 and all(math.isfinite(v) for v in values)
    model, metadata = load_export(result.run_dir / "export", registry())
    assert model.pair == "two_view" and model.text_encoder is None


# ----------------------------------------------------------------------------- NUCLR state


@pytest.mark.parametrize("holdout", [0.0, 0.25])
def test_nuclr_state_survives_checkpoint_and_resume_exactly(shards, tmp_path, holdout):
    """An uninterrupted 6-step NUCLR run and a run resumed from its step-3 checkpoint end with
    identical weights and identical u, ζ, ξ (ζ unfrozen from the start so it moves). With a held-out
    split (`clipkit train --data`), the per-sample state is sized by the training samples and
    indexed by their places among them."""
    from clipkit.data.loader import training_split

    trained = training_split(shards, holdout).num_samples
    overrides = data_overrides(shards) + [
        f"data.holdout={holdout}",
        "model.image_encoder=vit_tiny",
        "model.text_encoder=text_transformer_tiny",
        "loss.freeze_epochs=0",
        "loss.zeta_lr=0.05",
        "loss.zeta_lr_schedule=constant",  # 6 steps are under one epoch: no epoch schedule
        "train.steps=6",
        "train.checkpoint_every=3",
        "train.keep_checkpoints=3",
        "train.log_every=1",
        "train.export=false",
    ]
    full = tmp_path / "full"
    api.train("nuclr@tiny", overrides, run_dir=full, registry=registry())
    first, last = list_checkpoints(full)[0], list_checkpoints(full)[-1]
    expected = load_checkpoint(last)["loss"]
    early = load_checkpoint(first)["loss"]
    # The state is real and it moved between step 3 and step 6, on the batch coordinates only.
    assert set(expected) >= {"log_u", "visited", "zeta", "xi"}
    assert trained < 128 if holdout else trained == 128
    assert expected["log_u"].shape == (2, trained) and not torch.equal(expected["zeta"], early["zeta"])
    touched = (expected["log_u"] != early["log_u"]).any(dim=0)
    assert 0 < int(touched.sum()) <= 3 * 16

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(first, resumed / "checkpoints" / first.name)
    (resumed / "recipe.yaml").write_text((full / "recipe.yaml").read_text())
    api.train("nuclr@tiny", run_dir=resumed, resume=True, registry=registry())
    got = load_checkpoint(list_checkpoints(resumed)[-1])
    for key, tensor in expected.items():
        assert torch.equal(tensor, got["loss"][key]), key
    for key, tensor in load_checkpoint(last)["model"].items():
        assert torch.equal(tensor, got["model"][key]), key


# ----------------------------------------------------------------------------- batched augmentation


def test_batched_augmentation_trains_two_views_and_resumes_exactly(shards, tmp_path):
    """data.augment=batched: the loader emits uint8 images, the crops happen per batch in the
    loop; both views differ, and a resumed run draws the same crops (weights equal)."""
    probe = RecordBatches()
    overrides = data_overrides(shards) + [
        "data.augment=batched",
        "data.color_jitter=0",
        "data.grayscale=0",
        "model.image_encoder=vit_tiny",
        "loss=probe",
        "train.steps=1",
        "train.export=false",
    ]
    api.train("yaware@tiny", overrides, run_dir=tmp_path / "probe", registry=registry(probe))
    assert not torch.allclose(probe.calls[0]["a"], probe.calls[0]["b"])

    overrides = data_overrides(shards) + [
        "data.augment=batched",
        "data.color_jitter=0",
        "data.grayscale=0",
        "model.image_encoder=vit_tiny",
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=2",
        "train.export=false",
    ]
    full = tmp_path / "full"
    api.train("yaware@tiny", overrides, run_dir=full, registry=registry())
    first, last = list_checkpoints(full)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(first, resumed / "checkpoints" / first.name)
    (resumed / "recipe.yaml").write_text((full / "recipe.yaml").read_text())
    api.train("yaware@tiny", run_dir=resumed, resume=True, registry=registry())
    got = load_checkpoint(list_checkpoints(resumed)[-1])["model"]
    for key, tensor in load_checkpoint(last)["model"].items():
        assert torch.equal(tensor, got[key]), key


def test_batched_augmentation_refuses_colour_operations():
    from clipkit.errors import RecipeError

    with pytest.raises(RecipeError, match="color_jitter/grayscale need augment: sample"):
        api.resolve("yaware", ["data.augment=batched"], registry())
