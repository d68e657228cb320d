"""LoRA adapters through peft (issue 39 item 3, ``model.lora``): which parameters train, the
trainable count, merged == unmerged forward, export merging (or ``--keep-adapters``), exact resume,
locked towers, and the recipe checks. Skipped without peft (the ``[lora]`` extra)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from smoke_data import place_smoke_shards

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.errors import ClipkitError, RecipeError
from clipkit.model import build_model

SMOKE = "quickstart@smoke"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.0"]


def recipe_for(registry, *overrides: str) -> dict:
    return validate_or_raise(load_recipe(SMOKE, list(overrides), registry=registry), registry)


def randomise_adapters(model) -> None:
    """B starts at zero (the adapted model starts as the base one): give it values so merging
    has something to fold in."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def features(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        image, text = model(batch)
    return image.points, text.points


def smoke_batch(model) -> dict:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 48, 48, generator=generator)
    tokens = model.tokenizer(["a small red circle", "a big blue square", "a green triangle"])
    return {"image": images, "text": tokens}


def test_only_adapters_and_the_similarity_train_and_the_count_is_printed(registry, capsys):
    import_peft()
    from clipkit.model.lora import add_adapters

    recipe = recipe_for(registry, *LORA)
    model = build_model(recipe, registry, adapters=False)
    plain = {name: p.numel() for name, p in model.named_parameters()}
    targets = [m for n, m in model.named_modules() if n.endswith(("attn.in_proj", "attn.out_proj"))]
    assert targets
    expected_adapters = sum(4 * (m.in_features + m.out_features) for m in targets)  # A [r, in] + B [out, r]
    add_adapters(model, recipe, announce=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("similarity.") for n in trainable)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert adapters == expected_adapters
    similarity = sum(v for n, v in plain.items() if n.startswith("similarity."))
    total = sum(plain.values()) + adapters
    printed = capsys.readouterr().out
    assert f"model.lora: {adapters + similarity:,} trainable of {total:,} parameters" in printed


def test_merged_forward_equals_the_unmerged_one_and_has_the_plain_keys(registry):
    import_peft()
    from clipkit.model.lora import merge_adapters

    recipe = recipe_for(registry, *LORA, "model.lora.target=.*(attn\\.(in_proj|out_proj)|mlp\\.0)")
    model = build_model(recipe, registry)
    randomise_adapters(model)
    merged = merge_adapters(model)
    batch = smoke_batch(model)
    adapted, merged_out = features(model, batch), features(merged, batch)
    for got, expected in zip(merged_out, adapted, strict=True):
        assert torch.allclose(got, expected, atol=1e-6, rtol=0), (got - expected).abs().max()
    plain = build_model(recipe_for(registry), registry)
    assert set(merged.state_dict()) == set(plain.state_dict())
    # merging changed the weights (the adapters were not zero), and the unmerged model is untouched
    key = next(k for k in plain.state_dict() if k.endswith("attn.in_proj.weight"))
    assert not torch.equal(
        merged.state_dict()[key], model.state_dict()[key.replace("in_proj.", "in_proj.base_layer.")]
    )


def test_a_locked_tower_gets_no_adapter(registry):
    import_peft()
    recipe = recipe_for(registry, *LORA, "model.frozen=[image_encoder]")
    model = build_model(recipe, registry)
    assert not any("lora_" in n for n, _ in model.image_encoder.named_parameters())
    assert any("lora_" in n for n, _ in model.text_encoder.named_parameters())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.rank=0"], "model.lora.rank: must be > 0"),
        (["model.lora.dropout=1.5"], "model.lora.dropout"),
        (["model.lora.towers=[vision]"], "model.lora.towers: 'vision' is not a tower"),
        (["model.lora.rnak=4"], "model.lora.rnak: unknown key"),
        (
            ["model.lora.towers=[image_encoder]", "model.frozen=[image_encoder]"],
            "model.lora.towers: image_encoder is locked",
        ),
    ],
)
def test_validate_names_the_bad_key(registry, overrides, message):
    with pytest.raises(RecipeError, match=message):
        recipe_for(registry, *overrides)


def test_a_pattern_matching_nothing_names_the_key(registry):
    import_peft()
    with pytest.raises(ClipkitError, match="model.lora.target: 'nothing_here' matches no adaptable module"):
        build_model(recipe_for(registry, "model.lora.target=nothing_here"), registry)


def import_peft():
    """peft, or skip the test when the ``lora`` extra is not installed; installed but broken by a
    torchvision that cannot import (the CUDA build beside the CPU torch), the op schemas its
    meta-registrations need are defined first (tests/interop_support.py) — never a silent skip."""
    from interop_support import installed, patch_torchvision_ops

    if not installed("peft"):
        pytest.skip("peft is not installed (the lora extra)")
    patch_torchvision_ops()
    import peft

    return peft


def test_without_peft_the_error_names_the_extra(registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ClipkitError, match=r"pip install 'clipkit-contrastive\[lora\]'"):
        build_model(recipe_for(registry, *LORA), registry)


# ----------------------------------------------------------------------------- a run with adapters


def cli(*args: str):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    return CliRunner().invoke(make_app(make_plugin_manager(autoload=False)), list(args))


def test_train_resume_and_export_merged_or_with_adapters(registry, in_tmp, smoke_shards):
    import_peft()
    place_smoke_shards(in_tmp, smoke_shards)
    from safetensors.torch import load_file

    from clipkit.artifacts.reader import load_export
    from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

    common = [
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        "train.export=false",
        *LORA,
    ]
    done = cli("train", SMOKE, *common, "--run-dir", str(in_tmp / "full"))
    assert done.exit_code == 0 and "model.lora:" in done.output, done.output
    # resume from step 2 in a copy of the run: the same weights at step 4
    (in_tmp / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copy(in_tmp / "full" / "recipe.yaml", in_tmp / "resumed" / "recipe.yaml")
    shutil.copytree(in_tmp / "full/checkpoints/step-00000002", in_tmp / "resumed/checkpoints/step-00000002")
    done = cli("train", SMOKE, *common, "--resume", "--run-dir", str(in_tmp / "resumed"))
    assert done.exit_code == 0, done.output
    expected = load_checkpoint(list_checkpoints(in_tmp / "full")[-1])["model"]
    got = load_checkpoint(list_checkpoints(in_tmp / "resumed")[-1])["model"]
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in expected.items())  # the adapters trained
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key

    assert cli("export", str(in_tmp / "full"), str(in_tmp / "merged")).exit_code == 0
    done = cli("export", str(in_tmp / "full"), str(in_tmp / "adapters"), "--keep-adapters")
    assert done.exit_code == 0, done.output
    merged_keys = set(load_file(in_tmp / "merged" / "model.safetensors"))
    assert not any("lora_" in k for k in merged_keys)
    assert any("lora_" in k for k in load_file(in_tmp / "adapters" / "model.safetensors"))
    metadata = json.loads((in_tmp / "merged" / "clipkit.json").read_text())
    assert "lora" not in metadata["recipe"]["model"]
    merged, _ = load_export(in_tmp / "merged", registry)
    kept, _ = load_export(in_tmp / "adapters", registry)
    batch = smoke_batch(kept)
    for got_features, expected_features in zip(features(merged, batch), features(kept, batch), strict=True):
        assert torch.allclose(got_features, expected_features, atol=1e-6, rtol=0)


def test_export_ema_of_a_lora_run_merges_the_averaged_adapters(registry, in_tmp, smoke_shards):
    import_peft()
    place_smoke_shards(in_tmp, smoke_shards)
    from safetensors.torch import load_file

    from clipkit.model.lora import merge_adapters
    from clipkit.train.checkpoint import list_checkpoints, load_checkpoint
    from clipkit.train.ema import ema_state_dict

    overrides = ["train.steps=3", "train.export=false", "train.ema.decay=0.5", *LORA]
    done = cli("train", SMOKE, *overrides, "--run-dir", str(in_tmp / "run"))
    assert done.exit_code == 0, done.output
    done = cli("export", str(in_tmp / "run"), str(in_tmp / "out"), "--ema")
    assert done.exit_code == 0, done.output
    state = load_checkpoint(list_checkpoints(in_tmp / "run")[-1])
    assert all("lora_" in k or k.startswith("similarity.") for k in state["ema"]["weights"])
    model = build_model(recipe_for(registry, *overrides), registry)
    model.load_state_dict(ema_state_dict(state["model"], state["ema"], "state.pt"))
    expected = merge_adapters(model).state_dict()
    exported = load_file(in_tmp / "out" / "model.safetensors")
    assert set(exported) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_launched_lora_resumes_exactly_and_exports_merged(tmp_path, strategy, monkeypatch):
    """Two processes (DDP, or DeepSpeed ZeRO-2 over the adapters only) train, resume to the same
    weights as the uninterrupted run, and export merged weights."""
    from interop_support import torchvision_is_broken

    import_peft()
    if torchvision_is_broken():  # the launched processes need the op schemas too (tests/shims)
        shims = str(Path(__file__).parent / "shims")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [shims, os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("CLIPKIT_TESTS_TORCHVISION_OPS", "1")
    if strategy == "zero2":
        pytest.importorskip("deepspeed")
    from test_distributed import COMMON, accelerate_launch

    from clipkit.app import api
    from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

    api.shard("synthetic://shapes?n=512&split=train&image_size=48", tmp_path / "data" / "smoke-shapes")
    zero = ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2"]
    overrides = [*COMMON, *LORA, "train.export=false", *(zero if strategy == "zero2" else [])]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    accelerate_launch("train", *overrides, "--run-dir", str(full), cwd=tmp_path)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "recipe.yaml", resumed / "recipe.yaml")
    shutil.copytree(full / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    accelerate_launch(
        "train", SMOKE, "train.export=false", "--resume", "--run-dir", str(resumed), cwd=tmp_path
    )
    expected = load_checkpoint(list_checkpoints(full)[-1])["model"]
    got = load_checkpoint(list_checkpoints(resumed)[-1])["model"]
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in expected.items())
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    done = cli("export", str(resumed), str(tmp_path / "export"))
    assert done.exit_code == 0, done.output


def test_a_merged_lora_export_of_an_open_clip_model_loads_in_open_clip(registry, tmp_path):
    """The fine-tuning path a researcher takes: an open_clip model converted into clipkit, LoRA
    adapters on both towers (given values, as training would), ``clipkit export``'s merge, then
    ``clipkit convert --to open_clip``: open_clip's own loader reads it and computes what the adapted
    model computes (1e-5, fp32)."""
    import_peft()
    from interop_support import import_open_clip
    from test_interop_open_clip import VIT, assert_same_outputs, open_clip_model, save_open_clip_dir

    from clipkit.artifacts.export import merged_model, write_export
    from clipkit.artifacts.reader import load_export
    from clipkit.model.lora import add_adapters, has_adapters
    from clipkit.plugins.interop.layouts import convert

    open_clip = import_open_clip()
    source = save_open_clip_dir(open_clip_model(VIT), VIT, tmp_path / "open_clip")
    start = convert(source, tmp_path / "start", "clipkit", registry)
    model, metadata = load_export(start, registry)
    recipe = json.loads(json.dumps(metadata["recipe"]))
    recipe["model"]["lora"] = {"rank": 4, "alpha": 8.0, "target": r".*(attn\.(in_proj|out_proj)|mlp\.0)"}
    recipe = validate_or_raise(recipe, registry)
    add_adapters(model, recipe)
    assert {n.split(".")[0] for n, _ in model.named_parameters() if "lora_" in n} == {
        "image_encoder",
        "text_encoder",
    }
    randomise_adapters(model)
    model.eval()

    merged, plain_recipe = merged_model(model, recipe)
    assert not has_adapters(merged) and "lora" not in plain_recipe["model"]
    exported = write_export(merged, plain_recipe, tmp_path / "export", registry)
    back = convert(exported, tmp_path / "back", "open_clip", registry)
    reloaded = open_clip.create_model(f"local-dir:{back}").eval()
    assert_same_outputs(reloaded, model, VIT)
    original = open_clip_model(VIT)  # the adapters changed the weights open_clip now holds
    key = "transformer.resblocks.0.attn.in_proj_weight"
    assert not torch.equal(reloaded.state_dict()[key], original.state_dict()[key])
