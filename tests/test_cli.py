"""The CLI through Typer's CliRunner: help, plugins, recipes, validate, bad names."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager

runner = CliRunner()


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def test_help_lists_commands_without_importing_torch():
    code = (
        "import sys\n"
        "from clipkit.app.cli import main\n"
        "sys.argv = ['clipkit', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'clipkit --help imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for command in ("shard", "train", "export", "eval", "plugins", "recipes", "validate"):
        assert command in result.stdout


def test_plugins_lists_distribution_and_names(app):
    result = runner.invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["plugin"]: row for row in json.loads(result.output)}
    losses = rows["clipkit.plugins.losses"]
    assert losses["distribution"] == "clipkit-contrastive" and "infonce" in losses["registers"]["loss"]
    assert rows["clipkit.plugins.sources"]["hooks"] == ["open_source"]
    table = runner.invoke(app, ["plugins"])
    assert table.exit_code == 0 and "vit_tiny" in table.output


def test_recipes_lists_recipes_and_variants(app):
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    assert "quickstart" in result.output and "smoke" in result.output and "tiny" in result.output


def test_validate_ok_and_show(app):
    result = runner.invoke(app, ["validate", "clip@tiny", "train.steps=3", "--show"])
    assert result.exit_code == 0, result.output
    assert "clip@tiny: ok" in result.output and "steps: 3" in result.output


def test_validate_reports_every_error_and_exits_nonzero(app):
    result = runner.invoke(app, ["validate", "clip@tiny", "loss.name=infonse", "optimizer.lr=x"])
    assert result.exit_code == 2
    assert "2 error(s)" in result.output
    assert "Did you mean: infonce" in result.output and "optimizer.lr" in result.output


def test_unknown_recipe_exits_nonzero_with_suggestion(app):
    result = runner.invoke(app, ["train", "quikstart"])
    assert result.exit_code == 2
    assert "unknown recipe 'quikstart'" in result.output and "quickstart" in result.output


def test_eval_of_a_missing_export_is_a_clear_error(app, tmp_path):
    result = runner.invoke(app, ["eval", str(tmp_path)])
    assert result.exit_code == 2 and "clipkit.json is missing" in result.output


def test_shard_command_writes_a_manifest(app, tmp_path):
    out = tmp_path / "shards"
    result = runner.invoke(app, ["shard", "synthetic://shapes?n=10", str(out), "--samples-per-shard", "4"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["n"] == 10 and [s["count"] for s in manifest["shards"]] == [4, 4, 2]
    bad = runner.invoke(app, ["shard", "nowhere://x", str(tmp_path / "other")])
    assert bad.exit_code == 2 and "no data source accepts" in bad.output


def test_shard_command_reports_skips_and_strict_names_the_row(app, tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    (tmp_path / "a.png").write_bytes(buffer.getvalue())
    rows = [{"image": "a.png", "caption": "ok"}, {"image": "gone.png", "caption": "x"}, {"image": "a.png"}]
    table = tmp_path / "t.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = runner.invoke(app, ["shard", str(table), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "wrote 1 samples" in result.output
    assert "skipped 2 bad row(s): empty_caption 1, missing_image 1" in result.output
    strict = runner.invoke(app, ["shard", str(table), str(tmp_path / "strict"), "--strict"])
    assert strict.exit_code == 2 and f"{table}: line 2: missing_image" in strict.output


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "clipkit", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "quickstart" in result.stdout


def test_recipe_listing_shows_the_first_sentence_of_descriptions():
    from clipkit.app.cli import first_sentence

    text = "CLIP (Radford et al. 2021): InfoNCE, e.g. with\n  ViTs. Second sentence. Third."
    assert first_sentence(text) == "CLIP (Radford et al. 2021): InfoNCE, e.g. with ViTs."
    assert first_sentence("no full stop") == "no full stop"


def test_shard_refuses_an_unknown_option_naming_it_and_the_known_ones(app, tmp_path):
    """`-o worker=2` (for `workers`) was ignored without a word: the source ran with defaults."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["shard", "synthetic://shapes?n=4", str(out), "-o", "worker=2"])
    assert result.exit_code == 2, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("error:"))
    assert "unknown source option 'worker'" in line and "workers" in line and "max_caption_chars" in line
    assert not out.exists()
    known = runner.invoke(app, ["shard", "synthetic://shapes?n=4", str(out), "-o", "workers=2"])
    assert known.exit_code == 0, known.output


def test_a_source_plugin_still_takes_options_of_its_own():
    """Only the built-in sources refuse unknown keys: a plugin that opens the URI gets them all."""
    from clipkit.contract.hookspecs import hookimpl
    from clipkit.data.shard import open_source
    from clipkit.errors import DataError

    class Mine:
        @hookimpl
        def open_source(self, uri, options):
            return ["mine", options] if uri.startswith("mine://") else None

    pm = make_plugin_manager(autoload=False, extra_plugins=[Mine()])
    assert open_source("mine://x", {"colour": "red"}, pm=pm) == ["mine", {"colour": "red"}]
    with pytest.raises(DataError, match="unknown source option 'colour'"):
        open_source("synthetic://shapes?n=4", {"colour": "red"}, pm=pm)
