"""Nothing a user had is deleted or overwritten (issue 26, "files deleted or overwritten").

* ``clipkit export`` and ``clipkit shard`` into a folder holding other files are refused (exit 2, one
  line naming the folder and ``--overwrite``), the files kept; ``--overwrite`` replaces the folder;
  an earlier output of the same kind (a re-export, a re-shard of the same source) is replaced as before;
  the run itself, its checkpoints and the source are never replaced, ``--overwrite`` or not.
* Two ``clipkit train`` runs in one run directory: the second refuses at once, naming the directory and
  the first one's pid; the first goes on; a run killed with -9 does not block ``--resume``.
* A table starting with a UTF-8 byte-order mark keeps its first row (JSONL and CSV).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import warm_launch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.data.shard import read_manifest
from clipkit.train.checkpoint import list_checkpoints

pytestmark = pytest.mark.timeout(600)
runner = CliRunner()
SMOKE = "quickstart@smoke"
SOURCE = "synthetic://shapes?n=24&seed=1"
OTHER = "synthetic://shapes?n=40&seed=2"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step quickstart@smoke run with two checkpoints and its export (made once, copied per test)."""
    root = tmp_path_factory.mktemp("trained")
    command = [sys.executable, "-m", "clipkit", "train", SMOKE, "train.steps=2", "train.checkpoint_every=1"]
    done = warm_launch.subprocess_run([*command, "--run-dir", "run"], cwd=root, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture
def work(trained, tmp_path, monkeypatch) -> Path:
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args):
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(result, *names: str) -> None:
    """Exit code 2, one line naming ``names``, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith("machine:")]
    assert len(lines) == 1, result.output
    for name in names:
        assert name in lines[0], result.output


def snapshot(directory: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``directory``."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def user_folder(path: Path) -> dict[str, str]:
    (path / "results").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "results" / "table.csv").write_text("a,b\n1,2\n")
    return snapshot(path)


# ----------------------------------------------------------------------------- clipkit export


def test_export_into_a_folder_with_other_files_is_refused_and_keeps_them(work, app):
    kept = user_folder(work / "mine")
    assert_refused(invoke(app, "export", "run", "mine"), "mine", "--overwrite")
    assert snapshot(work / "mine") == kept


def test_export_with_overwrite_replaces_the_folder(work, app):
    user_folder(work / "mine")
    result = invoke(app, "export", "run", "mine", "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (work / "mine").iterdir()) == ["clipkit.json", "model.safetensors"]


def test_export_again_replaces_an_earlier_export(work, app):
    (work / "run/export/eval.json").write_text("{}")  # `clipkit eval run/export` wrote its report there
    result = invoke(app, "export", "run", "run/export")
    assert result.exit_code == 0, result.output
    assert (work / "run/export/clipkit.json").is_file()
    assert invoke(app, "export", "run", "new/export").exit_code == 0  # a new folder is created


@pytest.mark.parametrize("out", ["run", "run/..", "run/checkpoints", "run/checkpoints/step-00000002"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_export_never_replaces_the_run_or_its_checkpoints(work, app, out, overwrite):
    kept = snapshot(work / "run")
    assert_refused(invoke(app, "export", "run", out, *overwrite), out)
    assert snapshot(work / "run") == kept
    assert len(list_checkpoints(work / "run")) == 2


def test_train_refuses_before_training_when_its_export_folder_holds_other_files(tmp_path, app, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kept = user_folder(tmp_path / "run" / "export")
    result = invoke(app, "train", SMOKE, "train.steps=1", "--run-dir", "run")
    assert_refused(result, "export", "train.export=false")
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training
    assert snapshot(tmp_path / "run" / "export") == kept


def test_train_does_not_shard_into_a_data_shards_folder_holding_other_files(tmp_path, app, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kept = user_folder(tmp_path / "mine")
    result = invoke(app, "train", SMOKE, "train.steps=1", "data.shards=mine", "--run-dir", "run")
    assert_refused(result, "mine", "data.shards")
    assert snapshot(tmp_path / "mine") == kept


# ----------------------------------------------------------------------------- clipkit shard


def test_shard_into_a_folder_with_other_files_is_refused_and_keeps_them(tmp_path, app):
    kept = user_folder(tmp_path / "mine")
    assert_refused(invoke(app, "shard", SOURCE, tmp_path / "mine"), "mine", "--overwrite")
    assert snapshot(tmp_path / "mine") == kept
    result = invoke(app, "shard", SOURCE, tmp_path / "mine", "--overwrite")
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path / "mine")["n"] == 24 and not (tmp_path / "mine/notes.txt").exists()


def test_shard_over_a_set_of_another_source_is_refused(tmp_path, app):
    out = tmp_path / "shards"
    assert invoke(app, "shard", OTHER, out).exit_code == 0
    kept = snapshot(out)
    assert_refused(invoke(app, "shard", SOURCE, out), "shards", OTHER, "--overwrite")
    assert snapshot(out) == kept and read_manifest(out)["n"] == 40


def test_shard_again_from_the_same_source_replaces_the_set(tmp_path, app):
    out = tmp_path / "shards"
    assert invoke(app, "shard", SOURCE, out).exit_code == 0
    assert invoke(app, "shard", SOURCE, out).exit_code == 0
    assert read_manifest(out)["n"] == 24


def test_shard_into_a_partial_folder_with_other_files_is_refused(tmp_path, app):
    kept = user_folder(tmp_path / "shards.partial")
    assert_refused(invoke(app, "shard", SOURCE, tmp_path / "shards"), "shards.partial", "--overwrite")
    assert snapshot(tmp_path / "shards.partial") == kept


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_shard_never_replaces_its_source(tmp_path, app, overwrite):
    source = tmp_path / "set"
    assert invoke(app, "shard", SOURCE, source).exit_code == 0
    kept = snapshot(tmp_path)
    assert_refused(invoke(app, "shard", source, source, *overwrite), "set", "source")
    assert_refused(invoke(app, "shard", source, tmp_path, *overwrite), str(tmp_path), "source")
    assert snapshot(tmp_path) == kept


# ----------------------------------------------------------------------------- run-directory lock


def start_training(run_dir: Path, *extra: str) -> warm_launch.WarmLaunch:
    settings = ["train.steps=100000", "train.log_every=1", "train.checkpoint_every=2", "train.export=false"]
    command = [sys.executable, "-m", "clipkit", "train", SMOKE, *settings, "--run-dir", str(run_dir), *extra]
    return warm_launch.popen(command, cwd=run_dir.parent, env=ENV)


def wait_for(condition, process: warm_launch.WarmLaunch, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_second_train_in_the_same_run_directory_refuses_and_a_killed_one_does_not_block_resume(tmp_path):
    run_dir = tmp_path / "run"
    first = start_training(run_dir)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 1, first)
        recipe = (run_dir / "recipe.yaml").read_bytes()
        command = [sys.executable, "-m", "clipkit", "train", SMOKE, "train.steps=3", f"--run-dir={run_dir}"]
        second = warm_launch.subprocess_run(command, cwd=tmp_path, env=ENV, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and str(run_dir) in lines[0] and f"pid {first.pid}" in lines[0], second.stderr
        # At once, not after waiting for the first one: the first (100000 steps) is still running.
        assert first.poll() is None
        assert (run_dir / "recipe.yaml").read_bytes() == recipe  # the first run's recipe is untouched
        steps = len(metrics.read_text().splitlines())
        more = lambda: len(metrics.read_text().splitlines()) > steps + 1 and list_checkpoints(run_dir)  # noqa: E731
        wait_for(more, first)
        logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert logged == sorted(set(logged))  # one writer: no step twice
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    newest = int(list_checkpoints(run_dir)[-1].name.split("-")[1])
    resume = [sys.executable, "-m", "clipkit", "train", SMOKE, "--resume", "--run-dir", str(run_dir),
              f"train.steps={newest + 1}"]  # fmt: skip
    done = warm_launch.subprocess_run(resume, cwd=tmp_path, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(list_checkpoints(run_dir)[-1].name.split("-")[1]) == newest + 1


# ----------------------------------------------------------------------------- byte-order mark


def png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv"])
def test_a_table_starting_with_a_byte_order_mark_keeps_its_first_row(tmp_path, app, suffix):
    for index in range(3):
        (tmp_path / f"{index}.png").write_bytes(png((80 * index, 0, 0)))
    if suffix == ".jsonl":
        text = "".join(json.dumps({"image": f"{i}.png", "caption": f"row {i}"}) + "\n" for i in range(3))
    else:
        sep = "," if suffix == ".csv" else "\t"
        text = f"image{sep}caption\n" + "".join(f"{i}.png{sep}row {i}\n" for i in range(3))
    table = tmp_path / f"table{suffix}"
    table.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    result = invoke(app, "shard", table, tmp_path / "shards", "--strict")
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "shards")
    assert manifest["n"] == 3 and not (manifest.get("info") or {}).get("skipped")


# ----------------------------------------------------------------------------- clipkit convert


@pytest.fixture
def plain_clip(work, registry) -> Path:
    """A tiny plain-CLIP state dict as clipkit writes it (activation recorded in its header)."""
    from clipkit.model import build_model
    from clipkit.plugins.interop import layouts, open_clip
    from clipkit.plugins.interop.spec import ClipSpec, TextSpec, VisionSpec

    vision = VisionSpec("vit", 64, 1, 1, 32, patch_size=16)
    spec = ClipSpec(16, vision, TextSpec(width=64, layers=1, heads=1, context_length=16), quick_gelu=False)
    model = build_model(layouts.recipe_for(spec, {}, registry), registry)
    return open_clip.write_state_dict(spec, model.state_dict(), work / "source" / "plain.safetensors")


@pytest.mark.parametrize("layout", ["clipkit", "open_clip", "hf"])
def test_convert_into_a_folder_with_other_files_is_refused_and_keeps_them(work, app, layout, plain_clip):
    """The same output check as export's, for every layout: refused with the files kept, replaced with
    --overwrite, and a folder holding only an earlier output of that layout is written again."""
    kept = user_folder(work / "mine")
    assert_refused(invoke(app, "convert", plain_clip, "mine", "--to", layout), "mine", "--overwrite")
    assert snapshot(work / "mine") == kept
    replaced = invoke(app, "convert", plain_clip, "mine", "--to", layout, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert not (work / "mine" / "notes.txt").exists()
    again = invoke(app, "convert", plain_clip, "mine", "--to", layout)
    assert again.exit_code == 0, again.output


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_convert_never_replaces_its_source(work, app, overwrite, plain_clip):
    kept = snapshot(work / "run")
    assert_refused(invoke(app, "convert", "run/export", "run/export", *overwrite), "run/export")
    assert_refused(invoke(app, "convert", "run/export", "run", "--to", "open_clip", *overwrite), "run")
    assert snapshot(work / "run") == kept
    source = snapshot(plain_clip.parent)
    assert_refused(invoke(app, "convert", plain_clip, plain_clip.parent, *overwrite), "source")
    assert_refused(invoke(app, "convert", plain_clip, plain_clip, "--to", "state_dict", *overwrite), "plain")
    assert snapshot(plain_clip.parent) == source


def test_convert_to_a_state_dict_file_replaces_a_file_only_when_asked(work, app, plain_clip):
    target = work / "mine.safetensors"
    target.write_bytes(b"not mine to lose")
    refused = invoke(app, "convert", plain_clip, target, "--to", "state_dict")
    assert_refused(refused, "mine.safetensors", "--overwrite")
    assert target.read_bytes() == b"not mine to lose"
    replaced = invoke(app, "convert", plain_clip, target, "--to", "state_dict", "--overwrite")
    assert replaced.exit_code == 0, replaced.output


EVAL_DATA = "synthetic://shapes?n=8&seed=3"


def eval_into(app, output):
    """``clipkit eval`` of the run's export (retrieval on a few shapes) with its report at ``output``."""
    return invoke(app, "eval", "run/export", "--task", "retrieval", "--data", EVAL_DATA, "--output", output)


@pytest.mark.parametrize(
    "target",
    ["run/export/model.safetensors", "run/export/clipkit.json", "run/recipe.yaml", "run/metrics.jsonl"],
)
def test_eval_never_writes_its_report_over_a_file_that_is_not_a_report(work, app, target):
    # `--output EXPORT/model.safetensors` used to replace the weights being evaluated with the report.
    kept = snapshot(work / "run")
    assert_refused(eval_into(app, target), target, "not a clipkit eval report")
    assert snapshot(work / "run") == kept


def test_eval_replaces_an_earlier_report_but_never_a_markdown_file_beside_a_new_one(work, app):
    (work / "notes.md").write_text("mine")
    assert_refused(eval_into(app, "notes.json"), "notes.md")
    assert (work / "notes.md").read_text() == "mine" and not (work / "notes.json").exists()
    assert_refused(invoke(app, "eval", "run/export", "--output", "r.md"), "name a .json file")
    for _ in range(2):  # the second run replaces the first one's report and table
        done = eval_into(app, "r.json")
        assert done.exit_code == 0, done.output
    assert json.loads((work / "r.json").read_text())["results"][0]["name"] == "retrieval"


def test_report_never_writes_into_a_compared_run_a_run_or_a_file(work, app):
    shutil.copytree(work / "run", work / "other")
    kept = snapshot(work / "run")
    assert_refused(invoke(app, "report", "run", "--out", "run"), "is a compared run")
    assert_refused(invoke(app, "report", "run", "--out", "other"), "other", "not a clipkit comparison report")
    assert_refused(invoke(app, "report", "run", "--out", "."), "contains a compared run")
    (work / "afile").write_text("x")
    assert_refused(invoke(app, "report", "run", "--out", "afile"), "afile", "not a directory")
    (work / "evals").mkdir()
    shutil.copy(work / "run" / "export" / "clipkit.json", work / "evals" / "eval.json")
    assert_refused(invoke(app, "report", "run", "--out", "evals"), "is not a comparison")
    for _ in range(2):  # an earlier comparison is replaced
        done = invoke(app, "report", "run", "other", "--out", "compare")
        assert done.exit_code == 0, done.output
    assert (work / "compare" / "loss.png").is_file()
    # a metric no run logged: named with those they did log, nothing written (an empty plot before)
    assert_refused(invoke(app, "report", "run", "--metric", "nosuch", "--out", "m"), "'nosuch'", "loss, ")
    assert not (work / "m").exists()
    assert snapshot(work / "run") == kept and (work / "afile").read_text() == "x"


def test_a_damaged_newest_checkpoint_is_refused_not_skipped_for_an_older_one(work, app):
    # Checkpoints are published whole: one without state.pt is damaged. Export and resume used to
    # take the step before it without a word.
    older, newest = list_checkpoints(work / "run")[-2:]
    (newest / "state.pt").unlink()
    shutil.rmtree(work / "run" / "export")
    refused = invoke(app, "export", "run", "out")
    assert_refused(refused, newest.name, "damaged checkpoint", f"the one before it ({older.name})")
    assert not (work / "out").exists()
    resumed = invoke(app, "train", SMOKE, "--resume", "--run-dir", "run", "train.steps=3")
    assert resumed.exit_code == 2 and "Traceback" not in resumed.output, resumed.output
    assert f"{newest.name}: damaged checkpoint" in resumed.output.strip().splitlines()[-1]
    # the remedy the message gives: export the earlier one (its state.pt named works too)
    done = invoke(app, "export", "run", "out", "--checkpoint", older / "state.pt")
    assert done.exit_code == 0, done.output


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


def test_a_refused_resume_leaves_the_runs_recipe_as_it_was(work, app):
    # The recipe with the launch's overrides was saved before the checkpoint loaded: a refused
    # resume (EMA asked of a run without it) made every later plain --resume fail the same way.
    kept = (work / "run" / "recipe.yaml").read_bytes()
    refused = invoke(
        app, "train", SMOKE, "--resume", "--run-dir", "run", "train.ema.decay=0.9", "train.steps=3"
    )
    assert refused.exit_code == 2 and "holds no EMA weights" in last_line(refused), refused.output
    assert (work / "run" / "recipe.yaml").read_bytes() == kept
    resumed = invoke(app, "train", SMOKE, "--resume", "--run-dir", "run", "train.steps=3")
    assert resumed.exit_code == 0, resumed.output
    assert "steps: 3" in (work / "run" / "recipe.yaml").read_text()  # an accepted resume's recipe is saved


def test_resuming_with_another_optimizer_is_refused_before_a_step(work, app):
    # AdamW's saved groups were loaded into SGD, which failed in its first step (KeyError: 'momentum').
    kept = (work / "run" / "recipe.yaml").read_bytes()
    refused = invoke(
        app, "train", SMOKE, "--resume", "--run-dir", "run", "optimizer.name=sgd", "train.steps=3"
    )
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert "another optimiser's than SGD" in last_line(refused) and "'momentum'" in last_line(refused)
    assert (work / "run" / "recipe.yaml").read_bytes() == kept


def test_a_run_directory_that_is_a_file_and_a_size_an_encoder_refuses_are_one_line(work, app):
    (work / "afile").write_text("x")
    assert_refused(invoke(app, "train", SMOKE, "--run-dir", "afile"), "afile", "is a file, not a directory")
    assert (work / "afile").read_text() == "x"
    # a factory's ValueError (the CLIP ResNet needs a multiple of 32 px) names the slot, no traceback
    refused = invoke(app, "train", SMOKE, "model.image_encoder.name=rn_tiny", "--run-dir", "rn")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert "model.image_encoder (rn_tiny): image_size must be a positive multiple of 32" in last_line(refused)


def test_a_checkpoint_write_cut_short_is_cleared_by_the_next_checkpoint(work, app):
    # A second Ctrl-C (or a crash) during a checkpoint write leaves .step-N.partial/; it was kept
    # for ever unless step N was saved again.
    stale = work / "run" / "checkpoints" / ".step-00000099.partial"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"cut short")
    done = invoke(app, "train", SMOKE, "--resume", "--run-dir", "run", "train.steps=3")
    assert done.exit_code == 0, done.output
    assert not stale.exists()
    assert [path.name for path in list_checkpoints(work / "run")][-1] == "step-00000003"


def test_a_resumed_run_logs_each_step_once_and_drops_a_torn_line(work, app):
    # Resumed from an earlier checkpoint, a run logged its later steps a second time; a line torn by
    # a crash ended up mid-file, where `clipkit report` refuses the log.
    log = work / "run" / "metrics.jsonl"
    first = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert 2 in first
    shutil.rmtree(list_checkpoints(work / "run")[-1])  # resume from step 1: step 2 runs again
    with log.open("a") as out:
        out.write('{"step": 3, "lo')
    done = invoke(app, "train", SMOKE, "--resume", "--run-dir", "run", "train.steps=3", "train.log_every=1")
    assert done.exit_code == 0, done.output
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-2:] == [2, 3], steps
    assert invoke(app, "report", "run", "--out", "compare").exit_code == 0
