"""Method settings a researcher mistypes, second round (after tests/test_hostile_methods.py): values
that validated and built, then trained on something else than asked — a start above its bound
silently clamped to it, a WPSE kernel so narrow its random features overflow to a NaN loss.

Built in-process (recipes resolved and validated, plugins built): no training runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.config.recipe import load_recipe, validate
from clipkit.errors import ClipkitError
from clipkit.model import build_slot

# ------------------------------------------------------------------- a start above its bound

# (slot config, what the factory says): each built before, starting at the bound, not the value.
STARTS_ABOVE_BOUND = [
    ({"name": "dot", "init_scale": 200.0}, "init_scale (200) must be <= max_scale (100)"),
    ({"name": "dot", "init_scale": 200.0, "learn_scale": False}, "init_scale (200) must be <= max_scale"),
    ({"name": "dot", "init_scale": 20.0, "max_scale": 10.0}, "init_scale (20) must be <= max_scale (10)"),
    ({"name": "cosine_mean", "init_scale": 500.0}, "init_scale (500) must be <= max_scale (100)"),
    ({"name": "wpse", "init_scale": 300.0}, "init_scale (300) must be <= max_scale (100)"),
    ({"name": "kme", "init_gamma": 300.0}, "init_gamma (300) must be <= max_gamma (100)"),
    (
        {"name": "hopfield", "inverse_tau": 150.0, "learn_scale": True},
        "inverse_tau (150) must be <= the bound of a learned inverse_tau (100)",
    ),
]


@pytest.mark.parametrize(
    ("config", "message"), STARTS_ABOVE_BOUND, ids=[str(c) for c, _ in STARTS_ABOVE_BOUND]
)
def test_a_start_above_its_bound_is_refused_in_one_line_not_clamped(registry, config, message):
    with pytest.raises(ClipkitError, match=r"^similarity") as refused:
        build_slot(registry, "similarity", config, "similarity", embed_dim=8)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_train_refuses_a_start_above_its_bound_before_reading_data(registry):
    """The recipe path `train` takes: the slot is named, the fix is said."""
    recipe = load_recipe("clip@tiny", ["similarity.init_scale=200"], registry=registry)
    assert validate(recipe, registry) == []  # one argument against another: the factory's to say
    with pytest.raises(ClipkitError, match=r"^similarity \(dot\): init_scale .*raise max_scale"):
        build_slot(registry, "similarity", recipe["similarity"], "similarity")


# Starts the papers, clipkit convert and fixed scales use: built, and start where asked.
START_ACCEPTED = [
    ({"name": "dot", "init_scale": 100.0}, 100.0),  # at the bound
    ({"name": "dot", "init_scale": 100.0, "learn_scale": False, "max_scale": None}, 100.0),  # NUCLR
    ({"name": "dot", "init_scale": 200.0, "max_scale": None}, 200.0),
    # `clipkit convert` of a checkpoint clamped at 100: exp of its rounded log 100 (fp32: 100.0000064,
    # fp16 as OpenAI released CLIP: 100.03) is the bound, not a start above it
    ({"name": "dot", "init_scale": math.exp(float(torch.tensor(math.log(100.0))))}, 100.0),
    ({"name": "dot", "init_scale": math.exp(float(torch.tensor(math.log(100.0)).half()))}, 100.0),
    ({"name": "kme", "init_gamma": 500.0, "max_gamma": None}, 500.0),
    ({"name": "hopfield", "inverse_tau": 150.0}, 150.0),  # a fixed 1/τ has no bound
]


@pytest.mark.parametrize(("config", "start"), START_ACCEPTED, ids=[str(c) for c, _ in START_ACCEPTED])
def test_a_start_within_its_bound_is_built_where_asked(registry, config, start):
    similarity = build_slot(registry, "similarity", config, "similarity", embed_dim=8)
    value = similarity.gamma() if config["name"] == "kme" else similarity.scale()
    assert float(value.detach()) == pytest.approx(start, rel=1e-5)


# ----------------------------------------------------------- a WPSE kernel too narrow for fp32

NARROW_KERNELS = [
    (["similarity.kernel=imq", "similarity.c=1e-20"], "similarity.c: must be >= 1e-06"),  # was: NaN loss
    (["similarity.sigma=1e-45"], "similarity.sigma: must be >= 1e-06"),  # was: NaN loss
    (["similarity.sigma=1e-9"], "similarity.sigma: must be >= 1e-06"),  # phases beyond fp32: noise
]


@pytest.mark.parametrize(
    ("overrides", "message"), NARROW_KERNELS, ids=[" ".join(o) for o, _ in NARROW_KERNELS]
)
def test_validate_refuses_a_wpse_kernel_too_narrow_for_its_features(registry, overrides, message):
    errors = validate(load_recipe("wpse@tiny", overrides, registry=registry), registry)
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("argument", ["sigma", "c"])
def test_the_wpse_factory_refuses_a_too_narrow_kernel(registry, argument):
    config = {"name": "wpse", "kernel": "gaussian" if argument == "sigma" else "imq", argument: 1e-20}
    with pytest.raises(ClipkitError, match=rf"^similarity \(wpse\): {argument} must be >= 1e-06"):
        build_slot(registry, "similarity", config, "similarity", embed_dim=8)


@pytest.mark.parametrize(
    "overrides",
    [["similarity.sigma=1e-6"], ["similarity.kernel=imq", "similarity.c=1e-6"], ["similarity.sigma=0.3"]],
)
def test_the_narrowest_accepted_wpse_kernel_scores_finitely(registry, overrides):
    from clipkit.contract.types import PointSet

    recipe = load_recipe("wpse@tiny", overrides, registry=registry)
    assert validate(recipe, registry) == []
    similarity = build_slot(registry, "similarity", recipe["similarity"], "similarity", embed_dim=8)
    points = PointSet(
        torch.nn.functional.normalize(
            torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0)), dim=-1
        )
    )
    logits = similarity(points, points, generator=torch.Generator().manual_seed(1)).i2t
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------ transformer tower sizes

# Each validated before and was refused only when `train` built the tower; now at `clipkit validate`
# (a preset such as vit_tiny carries its class's declared ranges). One size against another (width
# by heads, image_size by patch_size) is still the factory's one line when the tower is built.
VIT, TEXT = "model.image_encoder", "model.text_encoder"
TOWER_SIZES = [
    ("clip@tiny", f"{VIT}={{name: vit_tiny, layers: 0}}", f"{VIT}.layers: must be > 0"),
    ("clip@tiny", f"{VIT}={{name: vit_tiny, heads: 0}}", f"{VIT}.heads: must be > 0"),
    ("clip@tiny", f"{VIT}={{name: vit_tiny, width: 0}}", f"{VIT}.width: must be > 0"),
    ("clip@tiny", f"{VIT}={{name: vit_tiny, patch_size: 0}}", f"{VIT}.patch_size: must be > 0"),
    ("clip@tiny", f"{VIT}={{name: vit_tiny, output: pooled}}", f"{VIT}.output: must be one of cls, tokens"),
    (
        "clip@tiny",
        f"{VIT}={{name: vit, width: 64, layers: 1, heads: 2, patch_size: 8, mlp_ratio: 0}}",
        f"{VIT}.mlp_ratio: must be > 0",
    ),
    ("clip@tiny", f"{TEXT}={{name: text_transformer_tiny, layers: -1}}", f"{TEXT}.layers: must be > 0"),
    ("clip@tiny", f"{TEXT}={{name: text_transformer_tiny, output: cls}}", f"{TEXT}.output: must be one of"),
    ("kme_clip@tiny", f"{VIT}.weights=relu", f"{VIT}.weights: must be one of None, softplus, scaled_tanh"),
    ("kme_clip@tiny", f"{VIT}.weight_scale=0", f"{VIT}.weight_scale: must be > 0"),
    ("kme_clip@tiny", f"{TEXT}.pad_points=maybe", f"{TEXT}.pad_points: must be one of mask, include"),
]


@pytest.mark.parametrize(("spec", "override", "message"), TOWER_SIZES, ids=[case[1] for case in TOWER_SIZES])
def test_validate_refuses_a_transformer_tower_size_naming_its_key(registry, spec, override, message):
    errors = validate(load_recipe(spec, [override], registry=registry), registry)
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("tower", ["image", "text"])
def test_a_kme_weight_head_is_switched_off_with_null(registry, tower):
    """`weights=null` reached the factory as '' (a text setting cleared) and was refused."""
    from clipkit.model import build_model

    recipe = load_recipe("kme_clip@tiny", [f"model.{tower}_encoder.weights=null"], registry=registry)
    assert recipe["model"][f"{tower}_encoder"]["weights"] is None
    assert validate(recipe, registry) == []
    model = build_model(recipe, registry)
    assert getattr(model, f"{tower}_encoder").weight_head is None


def test_null_still_clears_a_text_host_setting(registry):
    recipe = load_recipe("clip@tiny", ["data.source=null"], registry=registry)
    assert recipe["data"]["source"] == ""


# ------------------------------------------------------------------------------ NUCLR's ζ schedule


def test_validate_refuses_a_fractional_nuclr_freeze_epochs(registry):
    """`loss.freeze_epochs=2.5` validated, then the loss refused it once the data was sharded."""
    errors = validate(load_recipe("nuclr@tiny", ["loss.freeze_epochs=2.5"], registry=registry), registry)
    assert errors == ["loss.freeze_epochs: must be a whole number of epochs >= 0, got 2.5"]


@pytest.mark.parametrize("value", ["0", "5", "5.0"])
def test_whole_nuclr_freeze_epochs_still_validate(registry, value):
    recipe = load_recipe("nuclr@tiny", [f"loss.freeze_epochs={value}"], registry=registry)
    assert validate(recipe, registry) == []
