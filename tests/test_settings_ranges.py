"""``validate`` is the contract of ``train``: every out-of-range setting is refused with its key
path (host settings from clipkit.config.settings_schema.HOST, plugin parameters from their
``Annotated[..., Range(...)]``), and YAML errors name the file or override with line and column."""

from __future__ import annotations

from typing import Annotated

import pytest
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.config.recipe import load_recipe, validate
from clipkit.config.settings_schema import HOST, Integer, Interval, Numbers, OneOf, Range
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.errors import RecipeError

runner = CliRunner()
SMOKE = "quickstart@smoke"


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def errors_for(registry, *overrides: str) -> list[str]:
    return validate(load_recipe(SMOKE, list(overrides), registry=registry), registry)


REFUSED = [
    # The settings `validate` accepted and `train` then crashed on (issue 19) ...
    ("train.checkpoint_every=0", "train.checkpoint_every: must be > 0"),
    ("train.log_every=0", "train.log_every: must be > 0"),
    ("seed=abc", "seed: must be an integer, got str 'abc'"),
    ("data.num_workers=-1", "data.num_workers: must be >= 0"),
    ("schedule.warmup_steps=-10", "schedule.warmup_steps: must be >= 0, got -10"),
    ("optimizer.lr=-1", "optimizer.lr: must be > 0, got -1"),
    ("data.crop_scale=[2.0,0.5]", "data.crop_scale: must be [low, high] with low <= high"),
    # ... and a handful more.
    ("data.crop_scale=[0.5,2.0]", "data.crop_scale: both ends must be > 0 and <= 1"),
    ("data.crop_scale=[0.5]", "data.crop_scale: must be a pair [low, high]"),
    ("data.crop_ratio=[0,1]", "data.crop_ratio: both ends must be > 0"),
    ("data.grayscale=1.5", "data.grayscale: must be >= 0 and <= 1, got 1.5"),
    ("data.shuffle_buffer=-5", "data.shuffle_buffer: must be >= 0"),
    ("model.std=[0.2,0,0.2]", "model.std: each must be > 0"),
    ("model.mean=[0.5,0.5]", "model.mean: must be a list of 3 numbers"),
    ("train.keep_checkpoints=-1", "train.keep_checkpoints: must be >= 0"),
    ("train.grad_clip=-0.5", "train.grad_clip: must be >= 0"),
    ("train.eval_every=-2", "train.eval_every: must be >= 0"),
    ("eval_seed=1.5", "eval_seed: must be an integer, got float 1.5"),
    ("seed=-1", "seed: must be >= 0, got -1"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: must be >= 0"),
    ("optimizer.eps=0", "optimizer.eps: must be > 0"),
    ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio: must be >= 0 and <= 1"),
    ("train.precision=fp8", "train.precision: must be one of no, bf16, fp16, got 'fp8'"),
]


@pytest.mark.parametrize(("override", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_validate_refuses_out_of_range_settings_naming_the_key(app, override, message):
    result = runner.invoke(app, ["validate", SMOKE, override])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("override", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_each_refused_setting_is_one_error(override, message):
    """One line per bad key: `data.num_workers=-1` was refused twice, by its range and again by
    the machine-fit check (`must be auto or an integer >= 0`)."""
    from clipkit.contract.registry import default_registry

    key = override.partition("=")[0]
    lines = [error for error in errors_for(default_registry(), override) if error.startswith(f"{key}:")]
    assert len(lines) == 1, lines


@pytest.mark.parametrize("override", ["train.log_every=0", "train.checkpoint_every=0", "seed=abc"])
def test_train_refuses_what_validate_refuses_before_doing_anything(app, in_tmp, override):
    result = runner.invoke(app, ["train", SMOKE, override, "--run-dir", "run"])
    assert result.exit_code == 2 and override.partition("=")[0] in result.output, result.output
    assert not (in_tmp / "run").exists() and not (in_tmp / "data").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.num_workers=0", "schedule.warmup_steps=0", "data.crop_scale=[0.5,1.0]", "seed=0"],
        ["data.grayscale=1", "train.keep_checkpoints=0", "train.grad_clip=0", "optimizer.lr=1e-9"],
        ["optimizer.name=sgd", "optimizer.momentum=0", "schedule.name=step", "schedule.step_size=1"],
    ],
)
def test_boundary_values_are_accepted(registry, overrides):
    assert errors_for(registry, *overrides) == []


def test_a_type_error_is_reported_once_not_again_as_a_range_error(registry):
    assert errors_for(registry, "train.precision=5") == ["train.precision: expected str, got int 5"]


def test_every_host_setting_in_the_table_exists_in_a_section():
    from dataclasses import fields

    from clipkit.config.recipe import TOP_LEVEL
    from clipkit.config.settings_schema import SCHEMA

    sections = {prefix: settings for prefix, settings in SCHEMA.items() if prefix}  # sub-sections too
    for path in HOST:
        parent, _, key = path.rpartition(".")
        known = TOP_LEVEL if not parent else {f.name for f in fields(sections[parent])}
        assert key in known, path


# ----------------------------------------------------------------------------- plugin ranges


def scaled_loss(
    temperature: Annotated[float, Range(gt=0, le=10)] = 1.0, mode: Annotated[str, OneOf(("a", "b"))] = "a"
):
    return None


class RangedPlugin:
    @hookimpl
    def register_losses(self, register):
        register("ranged", scaled_loss)


@pytest.fixture
def ranged_registry():
    return Registry(make_plugin_manager(autoload=False, extra_plugins=[RangedPlugin()]))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "loss.temperature: must be > 0 and <= 10, got 0"),
        ("11", "loss.temperature: must be > 0 and <= 10, got 11"),
        ("hot", "loss.temperature: expected float, got str 'hot'"),
        ("2.5", None),
        ("10", None),
    ],
)
def test_a_plugin_parameter_declares_its_range_with_annotated(ranged_registry, value, problem):
    recipe = load_recipe(SMOKE, ["loss.name=ranged", f"loss.temperature={value}"], registry=ranged_registry)
    assert validate(recipe, ranged_registry) == ([problem] if problem else [])


def test_a_plugin_parameter_declares_its_choices_with_annotated(ranged_registry):
    recipe = load_recipe(SMOKE, ["loss.name=ranged", "loss.mode=c"], registry=ranged_registry)
    assert validate(recipe, ranged_registry) == ["loss.mode: must be one of a, b, got 'c'"]


def test_type_hints_are_remembered_per_factory_and_still_checked(ranged_registry, monkeypatch):
    """Validation reads each factory's annotations once per process (string annotations cost an
    evaluation per call); every resolve still checks values against them, and an unresolvable
    annotation is never remembered (asked again)."""
    import typing

    from clipkit.config.constraints import type_hints

    calls = []
    original = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda *a, **k: calls.append(a[0]) or original(*a, **k))
    for value in ("0", "hot", "0"):  # the same factory three times: its hints read at most once more
        overrides = ["loss.name=ranged", f"loss.temperature={value}"]
        assert validate(load_recipe(SMOKE, overrides, registry=ranged_registry), ranged_registry), value
    assert calls.count(scaled_loss) <= 2  # once with Annotated extras, once without (if not yet read)
    assert type_hints(scaled_loss)["temperature"] is float

    def unresolvable(x: NotDefinedAnywhere) -> None:  # noqa: F821
        return None

    for _ in range(2):
        with pytest.raises(NameError):
            type_hints(unresolvable)
    assert calls.count(unresolvable) == 2


def test_constraints_describe_themselves():
    assert Range(gt=0).problem(0) == "must be > 0, got 0"
    assert (
        Range(ge=0, lt=1).problem(0.5) is None
        and Range(ge=0, lt=1).problem(1) == "must be >= 0 and < 1, got 1"
    )
    assert Range(gt=0).problem("x") is None  # types are another check's business
    assert OneOf((0, 1)).problem(True) == "must be one of 0, 1, got True"  # a bool is not 1
    assert Integer(Range(ge=0)).problem(True) == "must be an integer, got bool True"
    assert Interval(Range(gt=0)).problem([1, 2]) is None
    assert Numbers(2).problem([1, "a"]) == "must be a list of 2 numbers, got [1, 'a']"


# ----------------------------------------------------------------------------- YAML errors


def test_a_yaml_syntax_error_in_a_recipe_file_names_file_line_and_column(app, in_tmp):
    (in_tmp / "mine.yaml").write_text("name: mine\ntrain:\n  steps: [1, 2\nseed: 3\n")
    result = runner.invoke(app, ["validate", "mine.yaml"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "mine.yaml: recipe file is not valid YAML (line 4, column 5" in result.output


def test_a_recipe_file_that_is_a_list_is_refused(app, in_tmp):
    (in_tmp / "mine.yaml").write_text("- loss: infonce\n")
    result = runner.invoke(app, ["validate", "mine.yaml"])
    assert result.exit_code == 2 and "mine.yaml: recipe file is a YAML list" in result.output


def test_a_yaml_syntax_error_in_an_override_names_it_with_its_column(registry):
    with pytest.raises(RecipeError) as error:
        load_recipe(SMOKE, ["train.steps=a: b: c"], registry=registry)
    # the second ':' is character 17 of the override
    assert "override 'train.steps=a: b: c': value is not valid YAML (line 1, column 17" in str(error.value)


def test_a_bad_interpolation_names_the_key(registry, in_tmp):
    (in_tmp / "mine.yaml").write_text("seed: ${nowhere}\n")
    with pytest.raises(RecipeError, match="seed: cannot resolve interpolation"):
        load_recipe("mine.yaml", [], registry=registry)
