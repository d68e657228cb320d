"""Recipe resolution never reads the environment and is bounded (issue 26, "Secrets and resource
limits"): ``${oc.env:VAR}`` and every other resolver are refused naming the key, before anything
is resolved or written; interpolations that double a value at every level fail fast naming the
key instead of growing to tens of gigabytes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.config.recipe import load_recipe
from clipkit.contract.manager import make_plugin_manager
from clipkit.errors import RecipeError

runner = CliRunner()
SMOKE = "quickstart@smoke"
SECRET = "hunter2-do-not-leak-7f3a"


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def everything_written(root: Path) -> bytes:
    return b"".join(path.read_bytes() for path in root.rglob("*") if path.is_file())


def output_of(result) -> str:
    parts = [result.output]
    with contextlib.suppress(ValueError, AttributeError):  # click < 8.2 mixes stderr into output
        parts.append(result.stderr)
    return "\n".join(parts)


def assert_refused(result, *names: str) -> None:
    text = output_of(result)
    assert result.exit_code == 2, (result.exit_code, text, result.exception)
    assert "Traceback" not in text
    for name in names:
        assert name in text, text


@pytest.mark.parametrize(
    "where",
    [
        ("override", "notes=${oc.env:CLIPKIT_TEST_SECRET}"),
        ("override", "data.source=synthetic://shapes?n=${oc.env:CLIPKIT_TEST_SECRET}"),
        ("override", "train.steps=${oc.env:CLIPKIT_TEST_SECRET}"),  # once echoed in a type error
        ("override", "notes=${oc.decode:'${oc.env:CLIPKIT_TEST_SECRET}'}"),
        ("file", "notes: ${oc.env:CLIPKIT_TEST_SECRET}\n"),
    ],
    ids=["notes", "inside-a-value", "type-error", "decode", "recipe-file"],
)
@pytest.mark.parametrize("command", ["train", "validate"])
def test_an_environment_variable_never_lands_in_artifacts_or_output(app, in_tmp, monkeypatch, where, command):
    monkeypatch.setenv("CLIPKIT_TEST_SECRET", SECRET)
    kind, text = where
    if kind == "file":
        base = (Path(__file__).parents[1] / "recipes" / "quickstart.yaml").read_text()
        (in_tmp / "mine.yaml").write_text(base + text)
        args = ["mine.yaml@smoke"]
    else:
        args = [SMOKE, text]
    extra = ["--run-dir", "run", "train.steps=1"] if command == "train" else ["--show"]
    if command == "train" and "train.steps" in text:
        extra = ["--run-dir", "run"]
    result = runner.invoke(app, [command, *args, *extra])
    assert_refused(result, "not allowed in recipes")
    key = text.partition("=")[0] if kind == "override" else "notes"
    assert f"{key}: the resolver" in output_of(result)
    assert SECRET not in output_of(result)
    assert SECRET.encode() not in everything_written(in_tmp)


def test_an_escaped_reference_stays_text_and_is_refused_when_read_back(registry, in_tmp, monkeypatch):
    monkeypatch.setenv("CLIPKIT_TEST_SECRET", SECRET)
    recipe = load_recipe(SMOKE, [r"notes=\${oc.env:CLIPKIT_TEST_SECRET}"], registry=registry)
    assert recipe["notes"] == "${oc.env:CLIPKIT_TEST_SECRET}"  # written as text, never resolved ...
    from clipkit.app.api import resume_recipe
    from clipkit.config.recipe import save_recipe

    save_recipe(recipe, in_tmp / "recipe.yaml")
    with pytest.raises(RecipeError, match="notes: the resolver"):  # ... and refused on --resume
        resume_recipe(in_tmp, [], registry)


def doubling_recipe(levels: int = 25) -> str:
    lines = ["notes:", "  a0: x"] + [
        f"  a{i}: ${{notes.a{i - 1}}}${{notes.a{i - 1}}}" for i in range(1, levels + 1)
    ]
    return "\n".join(lines) + "\n"


def test_nested_doubling_interpolations_fail_fast_naming_the_key(in_tmp):
    """25 levels once took ~20 GB and were OOM-killed: now one error in well under a second, in a
    process limited to little memory (so the old behaviour fails this test instead of the machine)."""
    (in_tmp / "double.yaml").write_text(doubling_recipe())
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
        "from clipkit.app.cli import main; sys.argv = ['clipkit', 'validate', 'double.yaml']; main()"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=in_tmp, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert "notes.a17: interpolations need more than 100,000 references to resolve" in done.stderr, (
        done.stderr
    )


@pytest.mark.parametrize(
    ("recipe", "problem"),
    [
        ("".join(f"a{i}: ${{a{i - 1}}}\n" if i else "a0: x\n" for i in range(40)), "references deep"),
        ("a0: ''\n" + "".join(f"a{i}: ${{a{i - 1}}}${{a{i - 1}}}\n" for i in range(1, 30)), "more than"),
        ("a: ${b.${c}}\nb: {d: 1}\nc: d\n", "a key built from an interpolation"),
    ],
    ids=["deep-chain", "empty-doubling", "dynamic-key"],
)
def test_resolution_is_bounded_in_depth_and_work(registry, in_tmp, recipe, problem):
    (in_tmp / "mine.yaml").write_text(recipe)
    with pytest.raises(RecipeError, match=problem):
        load_recipe("mine.yaml", [], registry=registry)


def test_ordinary_interpolations_still_resolve(registry, in_tmp):
    recipe = load_recipe(
        SMOKE,
        ["train.log_every=${train.steps}", "notes={a: '${seed}-${.b}', b: '${model.image_size}'}"],
        registry=registry,
    )
    assert recipe["train"]["log_every"] == recipe["train"]["steps"]
    assert recipe["notes"] == {
        "a": f"{recipe['seed']}-{recipe['model']['image_size']}",
        "b": recipe["model"]["image_size"],
    }
    cloob = load_recipe("cloob", [], registry=registry)  # a built-in recipe with ${train.steps}
    assert "${" not in repr(cloob)
    (in_tmp / "mine.yaml").write_text(doubling_recipe(10))
    assert len(load_recipe("mine.yaml", [], registry=registry)["notes"]["a10"]) == 1024


def test_interpolations_brought_by_overrides_alone_are_still_bounded(registry):
    """A recipe holding no `${` is not walked again while the overrides add none; once one does, the
    walk runs again: a doubling chain built from the command line alone is refused like a file's."""
    chain = ["notes.a0=x"] + [f"notes.a{i}=${{notes.a{i - 1}}}${{notes.a{i - 1}}}" for i in range(1, 26)]
    with pytest.raises(RecipeError, match="more than"):
        load_recipe(SMOKE, chain, registry=registry)
    with pytest.raises(RecipeError, match="resolver"):
        load_recipe(SMOKE, ["train.steps=4", "notes.home=${oc.env:HOME}", "seed=3"], registry=registry)


def test_a_recipe_without_interpolations_is_not_walked(registry, monkeypatch):
    """The bound's walk (:class:`_Estimate`) runs only where a `${` exists: most recipes hold none."""
    from clipkit.config import recipe as recipe_module

    def walked(*args, **kwargs):
        raise AssertionError("walked a recipe without interpolations")

    monkeypatch.setattr(recipe_module, "_Estimate", walked)
    recipe = load_recipe(SMOKE, ["train.steps=4", "data.batch_size=8", "notes={a: plain}"], registry=registry)
    assert recipe["train"]["steps"] == 4 and recipe["notes"] == {"a": "plain"}
    with pytest.raises(AssertionError, match="walked"):
        load_recipe(SMOKE, ["train.log_every=${train.steps}"], registry=registry)
    assert recipe_module.mentions_interpolation({"a": [1, {"b": "${c}"}]})
    assert not recipe_module.mentions_interpolation({"a": [1, {"b": "$c {d}"}], "${key}": 2})
