"""Recipes: every built-in recipe and variant validates; errors list every problem with its key path."""

import pytest

from clipkit.config.recipe import load_recipe, validate, variants_of
from clipkit.errors import RecipeError, UnknownNameError


def all_specs(registry):
    for name in registry.names("recipe"):
        yield name
        for variant in variants_of(name, registry):
            yield f"{name}@{variant}"


def test_every_recipe_and_variant_validates(registry):
    specs = list(all_specs(registry))
    assert {"quickstart", "quickstart@smoke", "clip", "clip@tiny"} <= set(specs)
    for spec in specs:
        recipe = load_recipe(spec, [], registry=registry)
        assert validate(recipe, registry) == [], spec


def test_variant_and_overrides_apply_in_order(registry):
    recipe = load_recipe("clip@tiny", ["train.steps=7", "optimizer.lr=0.01"], registry=registry)
    assert recipe["name"] == "clip@tiny"
    assert recipe["model"]["image_encoder"] == {"name": "vit_tiny"}  # the variant replaced the slot
    assert recipe["train"]["steps"] == 7 and recipe["optimizer"]["lr"] == 0.01
    assert recipe["optimizer"]["weight_decay"] == 0.2  # untouched keys survive
    assert recipe["overrides"] == ["train.steps=7", "optimizer.lr=0.01"]
    assert "variants" not in recipe


def test_changing_a_slot_name_resets_its_arguments(registry):
    recipe = load_recipe(
        "clip", ["model.image_encoder.name=vit_tiny", "model.image_encoder.layers=1"], registry=registry
    )
    assert recipe["model"]["image_encoder"] == {"name": "vit_tiny", "layers": 1}


def test_unknown_variant_and_recipe_suggest(registry):
    with pytest.raises(UnknownNameError, match="Did you mean: tiny"):
        load_recipe("clip@tiyn", [], registry=registry)
    with pytest.raises(UnknownNameError, match="Did you mean: clip"):
        load_recipe("clpi", [], registry=registry)


def test_all_errors_are_reported_with_key_paths(registry):
    recipe = load_recipe(
        "clip@tiny",
        [
            "loss.name=infonse",  # unknown plugin
            "optimizer.lr=fast",  # wrong type
            "optimizer.momentum=0.9",  # not an AdamW argument
            "model.image_encoder.embed_dim=3",  # injected by clipkit
            "train.stpes=3",  # misspelled section key
            "train.precision=fp8",
            "data.batch_size=0",
            "similarity.init_scale=true",  # bool for a float
        ],
        registry=registry,
    )
    errors = validate(recipe, registry)
    joined = "\n".join(errors)
    assert "loss.name: unknown loss 'infonse'. Did you mean: infonce," in joined
    assert "optimizer.lr: expected float, got str 'fast'" in joined
    assert "optimizer.momentum: unknown key for optimizer 'adamw'" in joined
    assert "model.image_encoder.embed_dim: set by clipkit" in joined
    assert "train.stpes: unknown key; did you mean steps" in joined
    assert "train.precision: must be one of" in joined
    assert "data.batch_size: must be > 0" in joined
    assert "similarity.init_scale: expected float, got bool True" in joined
    assert len(errors) == 8


def test_missing_required_argument_is_reported(registry):
    recipe = load_recipe("clip@tiny", ["eval=[{name: zero_shot}]"], registry=registry)
    errors = validate(recipe, registry)
    assert "eval.0.data: missing required argument of eval 'zero_shot'" in errors
    assert not any(e.startswith("eval.0.label") for e in errors)  # label defaults to "label"


def test_missing_sections_and_slots(registry):
    errors = validate({"name": "x", "data": {"batch_size": 2}, "model": {}}, registry)
    joined = "\n".join(errors)
    assert "data: set `shards`" in joined
    assert "model.image_encoder: missing" in joined and "loss: missing" in joined


def test_recipe_from_a_yaml_file(registry, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("description: mine\nvariants: {short: {train.steps: 3}}\n")
    recipe = load_recipe(f"{path}@short", [], registry=registry)
    assert recipe["train"]["steps"] == 3 and recipe["name"] == "mine"


def test_bad_override_syntax(registry):
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe("clip", ["train.steps"], registry=registry)


def test_an_empty_value_clears_a_text_setting(registry):
    recipe = load_recipe("clip@tiny", ["data.shards=my/shards", "data.source="], registry=registry)
    assert recipe["data"]["source"] == "" and recipe["data"]["shards"] == "my/shards"
    assert validate(recipe, registry) == []


def test_cloob_tiny_runs_one_cosine_cycle_over_however_many_steps_it_is_given(registry):
    """The tiny variant's restart cycle follows train.steps (a fixed 10-step cycle would restart the
    lr every 10 steps of a long run on a user's table)."""
    assert load_recipe("cloob@tiny", [], registry=registry)["schedule"]["cycle_steps"] == 20
    recipe = load_recipe("cloob@tiny", ["train.steps=3000"], registry=registry)
    assert recipe["schedule"]["cycle_steps"] == 3000 and recipe["schedule"]["name"] == "cosine_restarts"
    assert load_recipe("cloob", [], registry=registry)["schedule"]["cycle_steps"] == 39648  # paper's


def test_every_tiny_variant_fits_its_batch_to_small_data(registry):
    for name in registry.names("recipe"):
        spec = f"{name}@tiny" if "tiny" in variants_of(name, registry) else None
        if spec:
            assert load_recipe(spec, [], registry=registry)["data"]["fit_batch"] is True, spec
    assert load_recipe("quickstart", [], registry=registry)["data"]["fit_batch"] is True
    assert load_recipe("clip", [], registry=registry)["data"].get("fit_batch", False) is False
