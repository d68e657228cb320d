"""``train.distill.teacher`` naming a path no model can be read from (an empty folder, a stray file, a
run directory instead of its export) is refused by ``clipkit validate`` and by ``clipkit train``
before anything is written, in one line naming the key: it used to pass validation and fail only
when the teacher was loaded, after the data was sharded and the student built."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.errors import ClipkitError
from clipkit.train.distill import check_teacher

runner = CliRunner()


def empty_folder(root):
    (root / "teacher").mkdir()
    return "teacher", "is an empty folder"


def text_file(root):
    (root / "teacher.txt").write_text("not a model\n")
    return "teacher.txt", "is a file but not a .safetensors state dict"


def pickle_file(root):
    (root / "open_clip_pytorch_model.bin").write_bytes(b"\x80\x04")
    return "open_clip_pytorch_model.bin", "is a file but not a .safetensors state dict"


def run_directory(root):
    (root / "run" / "export").mkdir(parents=True)
    (root / "run" / "export" / "clipkit.json").write_text("{}")
    (root / "run" / "recipe.yaml").write_text("{}")
    return "run", "is a run directory, not its export (run/export)"


PATHS = [empty_folder, text_file, pickle_file, run_directory]


@pytest.mark.parametrize("make", PATHS)
def test_validate_refuses_a_teacher_path_holding_no_model(make, in_tmp):
    path, problem = make(in_tmp)
    app = make_app(make_plugin_manager(autoload=False))
    result = runner.invoke(app, ["validate", "quickstart@distill", f"train.distill.teacher={path}"])
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert line.startswith(f"error: train.distill.teacher: {path} {problem}; a teacher path holds ")
    assert "clipkit export" in line and "Traceback" not in result.output


@pytest.mark.parametrize("make", [empty_folder, text_file])
def test_train_refuses_it_before_writing_the_run_directory(make, in_tmp, registry):
    path, problem = make(in_tmp)
    overrides = [f"train.distill.teacher={path}", "train.steps=1"]
    with pytest.raises(ClipkitError, match=f"train.distill.teacher: {path} {problem}"):
        api.train("quickstart@smoke", overrides, run_dir=in_tmp / "out", registry=registry)
    assert not (in_tmp / "out").exists()


def test_a_safetensors_state_dict_is_left_to_the_reader(in_tmp, registry):
    """An OpenAI-layout state dict is one file: whether it holds a CLIP model, loading says."""
    (in_tmp / "ViT-B-32.safetensors").write_bytes(b"")
    recipe = api.resolve(
        "quickstart@distill", ["train.distill.teacher=ViT-B-32.safetensors"], registry=registry
    )
    check_teacher(recipe, registry)


class FileReader:
    """A third-party reader of some other checkpoint format."""

    @hookimpl
    def read_model(self, path, registry, options):
        return None


def test_with_a_plugin_reader_only_a_missing_path_or_an_empty_folder_is_refused(in_tmp):
    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=[FileReader()]))
    for make in (text_file, run_directory):
        path, _ = make(in_tmp)
        check_teacher(
            api.resolve("quickstart@distill", [f"train.distill.teacher={path}"], registry=registry), registry
        )
    path, _ = empty_folder(in_tmp)
    recipe = api.resolve("quickstart@distill", [f"train.distill.teacher={path}"], registry=registry)
    with pytest.raises(ClipkitError, match="is an empty folder"):
        check_teacher(recipe, registry)
