"""The seed-claim experiments: `clipkit experiment kme-mixture` (seed 003 §4.2) and
`clipkit experiment cloob-ablation` (seed 001 Table 3) — the task, the metric and the plumbing."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.types import PointSet
from clipkit.plugins.experiments.kme_mixture import KMixture, approximation_error


@pytest.fixture
def invoke():
    app = make_app(make_plugin_manager(autoload=False))
    return lambda *args: CliRunner().invoke(app, ["experiment", *args])


def test_k_mixture_pmi_takes_the_four_hand_derived_values():
    task = KMixture(3)  # datapoints: 0, 1, 2 pure; 3 = {0, 1}, 4 = {0, 2}, 5 = {1, 2}
    pmi = task.pmi()
    assert task.size == 6
    assert pmi[0, 0] == pytest.approx(math.log(3))  # K · 1
    assert pmi[0, 3] == pytest.approx(math.log(3 / 2))  # K · ½
    assert pmi[3, 3] == pytest.approx(math.log(3 / 2))  # K · (¼ + ¼)
    assert pmi[3, 4] == pytest.approx(math.log(3 / 4))  # K · ¼
    assert pmi[3, 5] == pytest.approx(math.log(3 / 4))
    assert pmi[0, 1] == -math.inf and pmi[0, 5] == -math.inf
    joint = task.joint()
    assert float(joint.sum()) == pytest.approx(1.0)
    assert torch.allclose(joint.sum(dim=1), torch.full((6,), 1 / 6, dtype=torch.float64))


def test_k_mixture_samples_follow_its_joint():
    task = KMixture(3)
    a, b = task.sample(120_000, torch.Generator().manual_seed(0))
    counts = torch.zeros(6, 6, dtype=torch.float64)
    counts.index_put_((a, b), torch.ones(len(a), dtype=torch.float64), accumulate=True)
    assert torch.allclose(counts / len(a), task.joint(), atol=4e-3)
    assert float(counts[0, 1]) == 0.0  # never a pair without a shared class


def test_approximation_error_is_the_best_constant_sup_and_rms():
    task = KMixture(3)
    pmi = task.pmi()
    support = torch.isfinite(pmi)
    exact = torch.where(support, pmi + 0.7, torch.full_like(pmi, -50.0))
    assert approximation_error(exact, task) == pytest.approx(
        {"sup_error": 0.0, "rms_error": 0.0, "off_support": 0.0}
    )
    bumped = exact.clone()
    bumped[3, 3] += 0.4  # residuals 0 and 0.4: the best constant leaves 0.2 either way
    error = approximation_error(bumped, task)
    assert error["sup_error"] == pytest.approx(0.2)
    weight = float(task.joint()[3, 3] / task.joint()[support].sum())
    assert error["rms_error"] == pytest.approx(0.4 * math.sqrt(weight * (1 - weight)))
    leaky = exact.clone()
    leaky[0, 1] = 10.0  # one off-support pair above its row's support pairs
    assert approximation_error(leaky, task)["off_support"] == pytest.approx(1 / int((~support).sum()))


def theorem_7_embedding(task: KMixture, dim: int = 2) -> PointSet:
    """Seed 003 Thm 7's construction: class z at the point e_z (K points on the unit circle), each
    datapoint the two points of its classes weighted by p(z|x) (a pure one: its point twice)."""
    angles = 2 * math.pi * torch.arange(task.classes, dtype=torch.float64) / task.classes
    corners = torch.stack([angles.cos(), angles.sin()], dim=1)
    classes = [row.nonzero().flatten().tolist() for row in task.posterior]
    pairs = torch.tensor([c if len(c) == 2 else c * 2 for c in classes])
    return PointSet(corners[pairs], torch.full((task.size, 2), 0.5, dtype=torch.float64))


def test_kme_expresses_the_k_mixture_pmi_as_gamma_grows():
    """Theorem 7 through the registered kme similarity: the error of the construction shrinks with
    γ and is near 0 at large γ, where CLIP would need a dimension growing with K."""
    from clipkit.contract.registry import default_registry
    from clipkit.model import build_slot

    task = KMixture(6)
    embedding = theorem_7_embedding(task)
    errors = []
    for gamma in (5.0, 50.0, 500.0):
        config = {"name": "kme", "init_gamma": gamma, "max_gamma": None}
        kme = build_slot(default_registry(), "similarity", config, "test", embed_dim=2).double()
        with torch.no_grad():
            errors.append(approximation_error(kme(embedding, embedding).i2t, task)["sup_error"])
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-6 and errors[0] > 0.01


def test_kme_mixture_cli_writes_report_and_verdict(invoke, tmp_path):
    out = tmp_path / "mixture"
    outcome = invoke("kme-mixture", "--out", str(out), "--classes", "3", "--classes", "4", "--seeds", "2",
                     "--steps", "3", "--batch-size", "16")  # fmt: skip
    assert outcome.exit_code == 0, outcome.output
    study = json.loads((out / "kme_mixture.json").read_text())
    assert len(study["runs"]) == 2 * 2 * 3  # K × seeds × similarities
    assert {row["classes"] for row in study["summary"]} == {3, 4}
    assert study["verdict"].startswith("verdict: ") and "verdict: " in outcome.output
    assert (out / "kme_mixture.png").read_bytes()[:4] == b"\x89PNG"
    dot = [run for run in study["runs"] if run["label"].startswith("dot")][0]
    assert math.isfinite(dot["sup_error"]) and dot["cpu_seconds"] >= 0


def test_kme_mixture_refuses_a_budget_the_point_sets_cannot_split(invoke, tmp_path):
    outcome = invoke("kme-mixture", "--out", str(tmp_path), "--budget", "7", "--steps", "1")
    assert outcome.exit_code == 2 and "budget 7" in outcome.output
    outcome = invoke("kme-mixture", "--out", str(tmp_path), "--classes", "1", "--steps", "1")
    assert outcome.exit_code == 2 and "K >= 2" in outcome.output


def colour_table(directory) -> str:
    """A 40-row table of 16 px squares in four colours, captioned with their colour."""
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}
    rows = []
    for i in range(40):
        name = list(colours)[i % 4]
        Image.new("RGB", (16, 16), colours[name]).save(directory / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": f"a {name} square number {i}", "colour": name})
    (directory / "table.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(directory / "table.jsonl")


@pytest.mark.slow  # four tiny training runs with export and evaluation (about a CPU-minute)
def test_cloob_ablation_trains_every_arm_and_seed_with_the_fixed_settings(invoke, tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPKIT_DATA_DIR", str(tmp_path / "data"))
    table, out = colour_table(tmp_path), tmp_path / "ablation"
    outcome = invoke(
        "cloob-ablation", "--data", table, "--label", "colour", "--holdout", "0.3", "--out", str(out),
        "--arm", "infonce", "--arm", "cloob", "--seeds", "2", "--steps", "4", "--batch-size", "16",
        "--warmup-fraction", "0.5", "--beta", "5", "--set", "data.num_workers=0",
        "--set", "train.memory_check=false",
    )  # fmt: skip
    assert outcome.exit_code == 0, outcome.output
    report = json.loads((out / "cloob_ablation.json").read_text())
    assert [(run["arm"], run["seed"]) for run in report["runs"]] == [
        ("infonce", 0), ("cloob", 0), ("infonce", 1), ("cloob", 1)
    ]  # fmt: skip
    assert report["config"]["warmup_steps"] == 2
    for arm in ("infonce", "cloob"):
        row = report["summary"][arm]
        assert row["seeds"] == 2 and "zero_shot.top1" in row and "diagnostics.uniformity_image" in row
    from omegaconf import OmegaConf

    cloob = OmegaConf.load(out / "cloob" / "seed-1" / "recipe.yaml")
    assert cloob.similarity.name == "hopfield" and cloob.similarity.beta == 5.0
    assert cloob.similarity.inverse_tau == 30.0 and cloob.loss.inverse_tau == 30.0 and cloob.seed == 1
    assert cloob.schedule.warmup_steps == 2 and cloob.data.batch_size == 16
    infonce = OmegaConf.load(out / "infonce" / "seed-0" / "recipe.yaml")
    assert infonce.similarity.name == "dot" and infonce.similarity.learn_scale is False
    assert infonce.similarity.init_scale == 30.0 and infonce.loss.name == "infonce"
    assert {claim["metric"] for claim in report["claims"]} == {"zero_shot.top1", "retrieval.mean_recall"}
    assert "| cloob | InfoLOOB | on |" in outcome.output
    assert (out / "cloob_ablation.png").read_bytes()[:4] == b"\x89PNG"


def test_cloob_ablation_names_bad_settings(invoke, tmp_path):
    outcome = invoke("cloob-ablation", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))
    assert outcome.exit_code == 2 and "missing.jsonl" in outcome.output
    outcome = invoke("cloob-ablation", "--data", str(tmp_path), "--arm", "hopfield_only")
    assert outcome.exit_code == 2 and "hopfield_only" in outcome.output


def test_pmi_fidelity_reports_seed_000s_uniform_error_with_its_best_constant():
    from clipkit.plugins.experiments.pmi_metrics import pmi_fidelity

    # true − learned = [0, 0, 0, −2]: the best constant is −1, leaving |±1| at worst.
    result = pmi_fidelity(torch.tensor([0.0, 1, 2, 5]), torch.tensor([0.0, 1, 2, 3]))
    assert result["sup_error"] == pytest.approx(1.0)
    assert pmi_fidelity(torch.tensor([2.0, 3, 4]), torch.tensor([0.0, 1, 2]))["sup_error"] == 0.0


def test_pmi_study_headline_names_each_papers_measure(tmp_path):
    from clipkit.plugins.experiments.pmi_study import run_pmi_study, study_table

    study = run_pmi_study(["dot", "kme"], seeds=(0, 1), topics=3, input_dim=2, embed_dim=2, points=2,
                          steps=2, batch_size=8, eval_batches=1)  # fmt: skip
    table = study_table(study)
    assert table.index("sup error (seed 000's measure)") < table.index("All metrics, ranked by Pearson r")
    assert "InfoNCE gap (seed 003's measure)" in table and "sup − dot (paired)" in table
    rows = {row["label"]: row for row in study["summary"]}
    per_seed = [r["sup_error"] for run in study["runs"] for r in run["results"] if r["label"] == "kme"]
    assert rows["kme"]["sup_error"] == pytest.approx(sum(per_seed) / 2)
