"""`clipkit experiment pmi-fidelity` and `nuclr-synthetic` through the CLI: files, table, errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager


@pytest.fixture
def invoke():
    app = make_app(make_plugin_manager(autoload=False))
    return lambda *args: CliRunner().invoke(app, ["experiment", *args])


def test_pmi_fidelity_ranks_the_named_similarities(invoke, tmp_path):
    out = tmp_path / "pmi"
    outcome = invoke(
        "pmi-fidelity", "--out", str(out), "--steps", "3", "--batch-size", "32",
        "--similarity", "dot", "--similarity", "{name: kme, label: kme-small}",
    )  # fmt: skip
    assert outcome.exit_code == 0, outcome.output
    report = json.loads((out / "pmi_fidelity.json").read_text())
    assert sorted(report["ranking"]) == ["dot", "kme-small"]
    assert (out / "pmi_fidelity.png").read_bytes()[:4] == b"\x89PNG"
    assert "| rank |" in outcome.output


def test_pmi_fidelity_names_a_bad_similarity(invoke, tmp_path):
    outcome = invoke("pmi-fidelity", "--out", str(tmp_path), "--steps", "2", "--similarity", "dott")
    assert outcome.exit_code == 2
    assert "dott" in outcome.output
    outcome = invoke("pmi-fidelity", "--out", str(tmp_path), "--similarity", "{name: [")
    assert outcome.exit_code == 2 and "not a mapping" in outcome.output


def test_nuclr_synthetic_writes_its_report(invoke, tmp_path):
    out = tmp_path / "nuclr"
    outcome = invoke("nuclr-synthetic", "--out", str(out), "--n", "50", "--n", "100", "--seeds", "2")
    assert outcome.exit_code == 0, outcome.output
    report = json.loads((out / "nuclr_synthetic.json").read_text())
    assert {"nuclr_synthetic.json", "nuclr_synthetic.md", "nuclr_synthetic.png"} == {
        p.name for p in out.iterdir()
    }
    assert "GCL" in outcome.output and report
    outcome = invoke("nuclr-synthetic", "--out", str(out), "--tau", "0")
    assert outcome.exit_code == 2 and "tau" in outcome.output
