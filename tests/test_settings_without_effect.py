"""A setting that another setting of the recipe makes do nothing is said (one ``warning:`` line
at resolve, so ``clipkit validate`` and ``clipkit train`` show it), never ignored unseen; and an
override ``{}`` empties a mapping, so a feature a recipe turns on can be turned off."""

from __future__ import annotations

from pathlib import Path

import pytest

from clipkit.app import api
from clipkit.config.recipe import settings_without_effect, variants_of
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.plugins.similarities.kme import KMESimilarity

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["train.eval_every=2"], "train.eval_every=2 does nothing: the recipe has no eval: tasks"),
        (
            ["train.similarity_precision=half"],
            "similarity_precision=half does nothing with train.precision=no",
        ),
        (["train.distributed.zero_stage=3"], "zero_stage=3 does nothing with strategy=ddp"),
        (["train.compile_unit=block"], "train.compile_unit=block does nothing with train.compile=none"),
        (
            ["train.compile_scope=step", "train.compile_unit=block"],
            "train.compile_scope=step, compile_unit=block does nothing",
        ),
        (
            ["train.distributed.strategy=fsdp2", "train.distributed.offload_optimizer=cpu"],
            "offload_optimizer=cpu",
        ),
    ],
)
def test_a_setting_without_effect_is_one_warning_line(registry, capsys, overrides, said):
    api.resolve("clip@tiny", overrides, registry)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1 and said in lines[0], lines


def test_the_settings_that_take_effect_warn_nothing(registry, capsys):
    api.resolve("clip@tiny", ["train.precision=bf16", "train.similarity_precision=half"], registry)
    api.resolve(
        "clip@tiny", ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"], registry
    )
    api.resolve("clip@tiny", ["train.compile=default", "train.compile_unit=block"], registry)
    assert "warning" not in capsys.readouterr().err


def test_no_shipped_recipe_or_variant_sets_a_setting_without_effect(registry):
    for name in sorted(path.stem for path in RECIPES.glob("*.yaml")):
        for spec in [name, *(f"{name}@{variant}" for variant in variants_of(name, registry))]:
            assert settings_without_effect(api.resolve(spec, [], registry)) == [], spec


@pytest.mark.parametrize(
    "spec, overrides, key",
    [
        ("clip@tiny", ["train.ema.decay=0.9", "train.ema={}"], "ema"),
        ("quickstart@distill", ["train.distill={}"], "distill"),
    ],
)
def test_an_empty_mapping_switches_off_what_the_recipe_turned_on(registry, spec, overrides, key):
    # Mappings merge, so `train.ema={}` used to change nothing: no command line could turn off a
    # feature a recipe or variant enabled (and `=null` is not a mapping).
    assert api.resolve(spec, overrides[:-1], registry)["train"][key]  # on before the last override
    assert api.resolve(spec, overrides, registry)["train"][key] == {}


def test_threads_far_above_the_usable_cpus_are_one_warning_line(registry, capsys, monkeypatch):
    import clipkit.config.recipe as recipe_module

    monkeypatch.setattr(recipe_module, "usable_cpus", lambda: 2)
    api.resolve("clip@tiny", ["train.threads=4"], registry)  # twice the cores: hyper-threads, no word
    assert "warning" not in capsys.readouterr().err
    api.resolve("clip@tiny", ["train.threads=64"], registry)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1 and "train.threads=64 is more than twice the 2 CPU(s)" in lines[0], lines


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            [
                "train.distributed.strategy=deepspeed",
                "train.distributed.zero_stage=3",
                "train.compile=default",
            ],
            "train.compile: under ZeRO-3 TorchDynamo traces DeepSpeed's",
        ),
        (
            ["train.report_to=[tensorboard,tensorbored]"],
            "train.report_to: unknown tracker 'tensorbored'; known: ",
        ),
        (["train.report_to=[accelerate:nosuch]"], "train.report_to: unknown tracker 'nosuch'"),
        (  # the run refused it once the model was built, after sharding the data
            ["train.precision=bf16", "train.similarity_precision=half", "similarity=kme"],
            "train.similarity_precision: half: the similarity KMESimilarity does not declare half_features",
        ),
    ],
)
def test_validate_refuses_what_the_run_would_refuse_at_its_start(registry, overrides, said):
    """These passed `clipkit validate` and stopped `clipkit train` once it had built the runtime
    (ZeRO-3 + compile) or opened the run (an unknown tracker)."""
    from clipkit.errors import RecipeError

    with pytest.raises(RecipeError) as refused:
        api.resolve("clip@tiny", overrides, registry)
    assert len(refused.value.errors) == 1 and refused.value.errors[0].startswith(said), refused.value.errors


def test_validate_knows_accelerates_trackers_without_importing_its_tracking(registry, monkeypatch):
    """Every name of the static list is one Accelerate opens, and validating one of them does not
    import accelerate.tracking (~0.7 s at every `clipkit validate`)."""
    import sys

    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    from clipkit.config.settings_schema import ACCELERATE_TRACKERS

    assert set(ACCELERATE_TRACKERS) <= set(LOGGER_TYPE_TO_CLASS)
    monkeypatch.setitem(sys.modules, "accelerate.tracking", None)  # importing it now raises
    api.resolve("clip@tiny", [f"train.report_to=[{','.join(ACCELERATE_TRACKERS)}]"], registry)


def test_every_tracker_name_validate_knows_the_run_can_open():
    """validate's list is the trackers plugin's own plus Accelerate's: the same two sources."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    from clipkit.config.recipe import validate
    from clipkit.contract.registry import default_registry

    registry = default_registry()
    for name in ["tensorboard", "wandb", "mlflow", *LOGGER_TYPE_TO_CLASS]:
        assert validate(api.resolve("clip@tiny", [f"train.report_to=[{name}]"], registry), registry) == []


def unnamed(**kwargs):
    return DotSimilarity(**kwargs)


def named(**kwargs) -> KMESimilarity:  # a string annotation (__future__), resolved by validation
    return KMESimilarity(**kwargs)


def test_a_similarity_factory_that_does_not_name_its_class_is_left_to_the_run():
    """Validation reads ``half_features`` off the class a factory names; a plain function's module
    is asked once built (clipkit.train.objective.feature_dtype), not refused unread."""
    from clipkit.config.recipe import declared_class, half_features_refusal

    assert declared_class(unnamed) is None and declared_class(named) is KMESimilarity
    assert half_features_refusal(DotSimilarity) is None
    assert half_features_refusal(DotSimilarity()) is None  # the built module, as the objective asks
    assert "KMESimilarity does not declare half_features" in half_features_refusal(KMESimilarity)


def test_validate_and_the_run_refuse_compile_under_zero3_with_one_check(registry):
    """Validation asks the refusal the DeepSpeed strategy gives the run (no copy of its rule)."""
    from clipkit.config.recipe import compile_refusal
    from clipkit.errors import RecipeError
    from clipkit.train.runtime.zero import DeepSpeedStrategy

    for stage in (1, 2, 3):
        strategy = DeepSpeedStrategy(precision="no", zero_stage=stage, config={})
        assert strategy.compile_refusal == compile_refusal("deepspeed", stage)
    zero3 = [
        "train.distributed.strategy=deepspeed",
        "train.distributed.zero_stage=3",
        "train.compile=default",
    ]
    with pytest.raises(RecipeError) as refused:
        api.resolve("clip@tiny", zero3, registry)
    assert refused.value.errors == [f"train.compile: {compile_refusal('deepspeed', 3)}"]
    assert compile_refusal("deepspeed", 2) is None and compile_refusal("fsdp2", 3) is None
