"""Settings refused before anything is built or written (issue 26): a text tower's own tokenizer,
data locations, eval arguments; and the command line's version, completion, choices and file names.

Each case is the command a user ran, through Typer's CliRunner: exit code 2, one message naming
the key / file / override, no traceback, nothing written.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.contract.manager import make_plugin_manager
from clipkit.model import build_model

runner = CliRunner()
TINY = "clip@tiny"
MINILM_TOKENIZER = "model.tokenizer={name: wordpiece, vocab: minilm}"


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def assert_refused(result, *names: str) -> None:
    """Exit code 2, every name in the message, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    for name in names:
        assert name in result.output, result.output


# ----------------------------------------------------------------------------- a tower's own tokenizer


def test_validate_refuses_minilm_with_another_tokenizer_naming_the_override(app, in_tmp):
    result = invoke(app, "validate", TINY, "model.text_encoder=minilm_l6")
    assert_refused(result, "model.tokenizer:", "'minilm_l6'", MINILM_TOKENIZER, "hashed_words")
    assert "vocab_size to be 30522" not in result.output  # refused before building, not by the build
    assert list(in_tmp.iterdir()) == []


def test_train_refuses_it_before_the_run_directory_exists(app, in_tmp):
    result = invoke(app, "train", TINY, "model.text_encoder=minilm_l6", "--run-dir", in_tmp / "run")
    assert_refused(result, MINILM_TOKENIZER)
    assert not (in_tmp / "run").exists()


def test_the_named_override_is_accepted(app, in_tmp):
    result = invoke(app, "validate", TINY, "model.text_encoder=minilm_l6", MINILM_TOKENIZER)
    assert result.exit_code == 0, result.output
    # the tokenizer's defaults count: {name: wordpiece} is vocab minilm
    same = invoke(app, "validate", TINY, "model.text_encoder=minilm_l6", "model.tokenizer={name: wordpiece}")
    assert same.exit_code == 0, same.output
    other = invoke(
        app,
        "validate",
        TINY,
        "model.text_encoder=minilm_l6",
        "model.tokenizer={name: wordpiece, vocab: v.txt}",
    )
    assert_refused(other, "vocab: v.txt", MINILM_TOKENIZER)


def test_required_tokenizer_is_an_optional_encoder_member(registry):
    from clipkit.contract.types import optional_member

    assert optional_member(registry.factory("encoder", "minilm_l6"), "required_tokenizer") == {
        "name": "wordpiece",
        "vocab": "minilm",
    }
    assert optional_member(registry.factory("encoder", "text_transformer_tiny"), "required_tokenizer") is None


# ----------------------------------------------------------------------------- data locations


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.shards={tmp}/gone", "data.source="], "data.shards {tmp}/gone: no such file or directory"),
        (
            ["data.shards={tmp}/out", "data.source={tmp}/missing.jsonl"],
            "{tmp}/missing.jsonl: table not found",
        ),
        (["data.shards={tmp}/out", "data.source=nowhere://x"], "no data source accepts 'nowhere://x'"),
        # validate said ok; train refused once it had sharded the data and built the student
        (["train.distill.teacher={tmp}/teacher"], "train.distill.teacher: {tmp}/teacher does not exist"),
    ],
    ids=["missing-shards", "missing-table", "unknown-scheme", "missing-teacher"],
)
def test_validate_checks_the_data_location_as_train_does(app, in_tmp, overrides, message):
    overrides = [item.format(tmp=in_tmp) for item in overrides]
    validated = invoke(app, "validate", TINY, *overrides)
    assert_refused(validated, message.format(tmp=in_tmp))
    trained = invoke(app, "train", TINY, *overrides, "--run-dir", in_tmp / "run")
    assert_refused(trained, message.format(tmp=in_tmp))
    assert list(in_tmp.iterdir()) == []  # no shards, no run directory


def test_validate_accepts_existing_shards_and_an_openable_source(app, in_tmp):
    made = invoke(app, "shard", "synthetic://shapes?n=8", in_tmp / "shards")
    assert made.exit_code == 0, made.output
    for overrides in (
        [f"data.shards={in_tmp}/shards", "data.source=synthetic://shapes?n=8"],
        [f"data.shards={in_tmp}/new", "data.source=synthetic://shapes?n=8"],
    ):
        result = invoke(app, "validate", TINY, *overrides)
        assert result.exit_code == 0, result.output
    assert not (in_tmp / "new").exists()  # validate writes nothing
    other = invoke(
        app, "validate", TINY, f"data.shards={in_tmp}/shards", "data.source=synthetic://shapes?n=9"
    )
    assert_refused(other, "holds shards of 'synthetic://shapes?n=8'")


def test_stored_teacher_embeddings_are_looked_for_in_the_manifest_first(app, in_tmp):
    """train.distill.stored on shards without teacher embeddings: validate said ok, and train
    sharded the source (when the shards were missing) and built the student before refusing. The
    manifest says it: both refuse before anything is written."""
    made = invoke(app, "shard", "synthetic://shapes?n=8", in_tmp / "plain")
    assert made.exit_code == 0, made.output
    (in_tmp / "tars").mkdir()  # the same tar without its manifest: read as a streamed set
    shutil.copy(next((in_tmp / "plain").glob("*.tar")), in_tmp / "tars")
    cases = {
        "plain": ([f"data.shards={in_tmp}/plain"], "holds no teacher embeddings"),
        "to-be-made": (
            [f"data.shards={in_tmp}/new", "data.source=synthetic://shapes?n=8"],
            "train.distill.stored reads a clipkit shard directory",
        ),
        "tars": ([f"data.shards={in_tmp}/tars"], "train.distill.stored: stored embeddings are read from"),
    }
    for overrides, message in cases.values():
        overrides = [*overrides, "train.distill.stored=true"]
        assert_refused(invoke(app, "validate", TINY, *overrides), message)
        assert_refused(invoke(app, "train", TINY, *overrides, "--run-dir", in_tmp / "run"), message)
    assert not (in_tmp / "new").exists() and not (in_tmp / "run").exists()  # no shards, no run


# ----------------------------------------------------------------------------- eval arguments


@pytest.fixture
def export(tmp_path, registry):
    """An untrained clip@tiny export (evaluation does not care)."""
    overrides = ["model.tokenizer.name=clip_bpe", "model.tokenizer.context_length=16"]
    recipe = validate_or_raise(load_recipe(TINY, overrides, registry=registry), registry)
    torch.manual_seed(0)
    return write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)


def test_eval_refuses_an_unknown_task_before_writing_a_report(app, export):
    before = sorted(p.name for p in export.iterdir())
    result = invoke(app, "eval", export, "--task", "zeroshot", "--data", "synthetic://shapes?n=8")
    assert_refused(result, "unknown eval 'zeroshot'", "Did you mean: zero_shot")
    assert sorted(p.name for p in export.iterdir()) == before  # no eval report, no eval-index.json


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--task", "zero_shot", "--data", "nowhere://x"],
            "eval[0].data: no data source accepts 'nowhere://x'",
        ),
        (["--task", "retrieval"], "eval[0].data: missing required argument"),
        (
            ["--task", "retrieval", "--data", "synthetic://shapes?n=8", "--set", "lmit=3"],
            "eval[0].lmit: unknown key",
        ),
    ],
    ids=["unknown-data", "no-data", "unknown-argument"],
)
def test_eval_checks_task_arguments_and_data_first(app, export, args, message):
    before = sorted(p.name for p in export.iterdir())
    result = invoke(app, "eval", export, *args)
    assert_refused(result, message, "nothing evaluated")
    assert sorted(p.name for p in export.iterdir()) == before


def test_eval_refuses_a_bad_task_of_a_tasks_file(app, export, tmp_path):
    tasks = tmp_path / "suite.yaml"
    tasks.write_text("- {name: retrieval, data: 'synthetic://shapes?n=8'}\n- {name: zero_shoot, data: x}\n")
    result = invoke(app, "eval", export, "--tasks", tasks)
    assert_refused(result, "eval[1].name: unknown eval 'zero_shoot'")
    assert not list(export.glob("eval*"))  # no report, no index


# ----------------------------------------------------------------------------- the command line


def test_version_names_the_distribution(app):
    from clipkit import __version__

    result = invoke(app, "--version")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"clipkit {__version__} (distribution clipkit-contrastive)"


def test_shell_completion_is_offered(app):
    result = invoke(app, "--help")
    assert "--install-completion" in result.output and "--show-completion" in result.output


@pytest.mark.parametrize(
    "command, shown",
    [
        ("eval", "[diagnostics|linear_probe|retrieval|zero_shot]"),
        ("convert", "[clipkit|open_clip|state_dict|hf]"),
    ],
)
def test_help_lists_the_choices(app, command, shown):
    result = invoke(app, command, "--help", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert shown in result.output


def test_errors_about_a_recipe_file_name_the_file(app, in_tmp):
    (in_tmp / "empty.yaml").write_text("")
    result = invoke(app, "validate", "empty.yaml")
    assert_refused(result, "recipe file empty.yaml has")
    assert "recipe 'empty'" not in result.output
    trained = invoke(app, "train", in_tmp / "empty.yaml")
    assert_refused(trained, f"recipe file {in_tmp / 'empty.yaml'} has")


def test_shell_completion_completes_task_names(app):
    env = {"_CLIPKIT_COMPLETE": "complete_bash", "COMP_WORDS": "clipkit eval x --task ", "COMP_CWORD": "4"}
    result = runner.invoke(app, [], env=env, prog_name="clipkit")
    assert result.output.split() == ["diagnostics", "linear_probe", "retrieval", "zero_shot"], result.output
