"""The multi-seed PMI study (plugins/experiments/pmi_study.py) and the pmi-fidelity CLI options for it."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.plugins.experiments.pmi_study import mean_interval, run_pmi_study, with_kme_gamma


def test_mean_interval_is_the_student_t_interval():
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(mean_interval([0.5])[1])
    assert mean_interval([2.0] * 6) == (2.0, 0.0)


def test_kme_gamma_options_reach_kme_entries_only_and_keep_their_own():
    specs = with_kme_gamma(["dot", {"name": "kme", "init_gamma": 3.0}, "kme"], 5.0, 0.0)
    assert specs[0] == {"name": "dot"}
    assert specs[1] == {"name": "kme", "init_gamma": 3.0, "max_gamma": None}
    assert specs[2] == {"name": "kme", "init_gamma": 5.0, "max_gamma": None}
    assert with_kme_gamma(None, None, None) is None
    defaults = with_kme_gamma(None, None, 200.0)
    assert [s.get("max_gamma") for s in defaults if s["name"] == "kme"] == [200.0]


def test_study_aggregates_seeds_and_pairs_differences(tmp_path):
    study = run_pmi_study(
        ["dot", {"name": "kme", "label": "kme"}],
        seeds=(0, 1),
        topics=5,
        separation=2.0,
        input_dim=3,
        embed_dim=2,
        points=3,
        steps=3,
        batch_size=16,
        eval_batches=1,
        out_dir=tmp_path,
    )
    assert study["distribution"]["num_latent"] == 5 and study["distribution"]["x_dim"] == 3
    rows = {row["label"]: row for row in study["summary"]}
    for label, row in rows.items():
        per_seed = [r["pearson"] for run in study["runs"] for r in run["results"] if r["label"] == label]
        assert row["pearson"] == pytest.approx(sum(per_seed) / 2)
        assert row["pearson_ci95"] == pytest.approx(12.706 * abs(per_seed[0] - per_seed[1]) / 2)
    leader = study["leader"]
    assert rows[leader]["rank"] == 1 and rows[leader]["pearson_vs_best"] == 0.0
    assert (tmp_path / "pmi_study.png").read_bytes()[:4] == b"\x89PNG"
    assert "±" in (tmp_path / "pmi_study.md").read_text()


def test_cli_runs_a_study_with_the_task_model_and_kme_options(tmp_path):
    app = make_app(make_plugin_manager(autoload=False))
    outcome = CliRunner().invoke(
        app,
        [
            "experiment", "pmi-fidelity", "--out", str(tmp_path), "--seeds", "2", "--seed", "3",
            "--topics", "6", "--separation", "2.5", "--input-dim", "4", "--embed-dim", "2",
            "--points", "3", "--hidden", "8", "--lr", "0.01", "--steps", "2", "--batch-size", "16",
            "--eval-batches", "1", "--similarity", "dot", "--similarity", "kme",
            "--kme-init-gamma", "5", "--kme-max-gamma", "50",
        ],
    )  # fmt: skip
    assert outcome.exit_code == 0, outcome.output
    study = json.loads((tmp_path / "pmi_study.json").read_text())
    assert study["config"]["seeds"] == [3, 4] and study["config"]["hidden"] == 8
    assert study["config"]["lr"] == 0.01 and study["config"]["points"] == 3
    assert study["distribution"]["num_latent"] == 6 and study["distribution"]["separation"] == 2.5
    kme = [s for s in study["config"]["similarities"] if s["name"] == "kme"][0]
    assert kme["init_gamma"] == 5.0 and kme["max_gamma"] == 50.0
    kme_run = [r for r in study["runs"][0]["results"] if r["name"] == "kme"][0]
    assert kme_run["similarity_metrics"]["gamma"] == pytest.approx(5.0, rel=0.05)  # 2 Adam steps from 5
    assert "| rank | similarity |" in outcome.output and "±" in outcome.output


def test_cli_rejects_zero_seeds(tmp_path):
    app = make_app(make_plugin_manager(autoload=False))
    outcome = CliRunner().invoke(app, ["experiment", "pmi-fidelity", "--out", str(tmp_path), "--seeds", "0"])
    assert outcome.exit_code == 2 and "--seeds" in outcome.output


def test_recipe_level_gamma_start_and_clamp_reach_the_kme_similarity():
    import torch

    from clipkit.contract.registry import default_registry
    from clipkit.model import build_slot

    config = {"name": "kme", "init_gamma": 5.0, "max_gamma": 6.0}
    similarity = build_slot(default_registry(), "similarity", config, "test", embed_dim=4)
    assert float(similarity.gamma().detach()) == pytest.approx(5.0)
    with torch.no_grad():
        similarity.log_gamma.fill_(math.log(10.0))
    assert float(similarity.gamma().detach()) == pytest.approx(6.0)  # clamped
    unclamped = build_slot(
        default_registry(), "similarity", {"name": "kme", "max_gamma": None}, "t", embed_dim=4
    )
    with torch.no_grad():
        unclamped.log_gamma.fill_(math.log(500.0))
    assert float(unclamped.gamma().detach()) == pytest.approx(500.0)
