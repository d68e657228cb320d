"""The docs' 20-line plugin: pip-installed, listed by `clipkit plugins`, trained from an override."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def example_files() -> dict[str, str]:
    """The fenced blocks that follow `<!-- example: NAME -->` markers in docs/plugins.md."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- example: (\S+) -->\n```\w*\n(.*?)```", text, flags=re.S)
    return dict(blocks)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    package, site = root / "clipkit-i2t-loss", root / "site"
    package.mkdir()
    for name, content in example_files().items():
        (package / name).write_text(content, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
        str(package),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "CLIPKIT_DISABLE_PLUGIN_AUTOLOAD": "0"}
    return root, env


def clipkit(args, env, cwd):
    """``python -m clipkit ARGS`` in a fresh process (forked warm: tests/warm_launch.py), whose
    ``PYTHONPATH`` holds the pip-installed plugin; output captured as text."""
    return warm_launch.run(args, cwd=cwd, env=env, timeout=300)


def test_the_example_is_about_twenty_lines():
    files = example_files()
    assert set(files) == {"pyproject.toml", "clipkit_i2t_loss.py"}
    code = [line for line in files["clipkit_i2t_loss.py"].splitlines() if line.strip()]
    assert len(code) <= 20


def test_installed_plugin_is_listed(installed):
    root, env = installed
    result = clipkit(["plugins", "--json"], env, root)
    assert result.returncode == 0, result.stderr
    rows = {row["plugin"]: row for row in json.loads(result.stdout)}
    row = rows["i2t_loss"]
    assert (row["distribution"], row["version"]) == ("clipkit-i2t-loss", "0.1.0")
    assert row["registers"] == {"loss": ["i2t_infonce"]}


def test_installed_plugin_trains_from_a_recipe_override(installed):
    root, env = installed
    args = [
        "train",
        "quickstart@smoke",
        "loss.name=i2t_infonce",
        "loss.weight=0.5",
        "train.steps=2",
        "train.log_every=1",
        "--run-dir",
        "run",
    ]
    result = clipkit(args, env, root)
    assert result.returncode == 0, result.stderr + result.stdout
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "i2t_ce" in metrics[0]
    exported = json.loads((root / "run" / "export" / "clipkit.json").read_text())
    assert exported["recipe"]["loss"] == {"name": "i2t_infonce", "weight": 0.5}


def test_autoload_disabled_hides_it(installed):
    root, env = installed
    result = clipkit(
        ["validate", "quickstart", "loss.name=i2t_infonce"],
        {**env, "CLIPKIT_DISABLE_PLUGIN_AUTOLOAD": "1"},
        root,
    )
    assert result.returncode == 2 and "unknown loss 'i2t_infonce'" in result.stderr


def test_contract_checks_pass_on_the_example(installed):
    root, env = installed
    code = (
        "import clipkit_i2t_loss as m\n"
        "from clipkit.contract.testing import check_loss, check_plugin\n"
        "assert 'i2t_infonce' in check_plugin(m).names('loss')\n"
        "check_loss(m.ImageToTextInfoNCE())\n"
    )
    (root / "check.py").write_text(code, encoding="utf-8")
    result = warm_launch.run([], cwd=root, env=env, script=root / "check.py", timeout=120)
    assert result.returncode == 0, result.stderr
