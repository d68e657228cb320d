"""Eval metrics on hand-made cases, feature seeds, reports (JSON, Markdown, PNG), eval during training."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from smoke_data import place_smoke_shards

from clipkit.app import api
from clipkit.errors import ClipkitError, DataError
from clipkit.eval.evaluate import (
    MIN_EVAL_SAMPLES,
    feature_seeds,
    mean_and_std,
    small_set_warning,
    topk_accuracy,
)
from clipkit.eval.report import markdown_table, read_metrics, short_data_name, summarize, write_eval_report
from clipkit.plugins.evals.retrieval import (
    chance_curves,
    chance_recalls,
    positives_of,
    recall_curves,
    recalls,
    retrieval_ties,
)
from clipkit.plugins.evals.zero_shot import ZeroShot

SMOKE = ["train.steps=4", "train.log_every=2", "train.checkpoint_every=4", "data.num_workers=0"]


def fresh_registry():
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    return Registry(make_plugin_manager(autoload=False))


# --- top-k and Recall@K by hand ---------------------------------------------------------------


def test_topk_accuracy_by_hand():
    logits = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.3, 0.5], [0.1, 0.7, 0.2], [0.3, 0.2, 0.1]])
    labels = torch.tensor([0, 1, 1, 2])
    # Row 0 right; row 1: label 1 ranked 2nd; row 2 right; row 3: label 2 ranked 3rd.
    assert topk_accuracy(logits, labels, 1) == 0.5
    assert topk_accuracy(logits, labels, 2) == 0.75
    assert topk_accuracy(logits, labels, 3) == 1.0
    assert topk_accuracy(logits, labels, 99) == 1.0  # k larger than the classes: every row hits


def test_recall_with_several_captions_per_image_by_hand():
    # 2 images, 4 texts: texts 0, 1 describe image 0; texts 2, 3 describe image 1.
    owner = torch.tensor([0, 0, 1, 1])
    logits = torch.tensor(
        [
            [0.1, 0.8, 0.9, 0.0],  # image 0: best text 2 (wrong), 2nd text 1 (its own) -> i2t rank 2
            [0.5, 0.2, 0.1, 0.6],  # image 1: best text 3 (its own) -> rank 1
        ]
    )
    # t2i: text 0 -> image 1 (0.5 > 0.1), own image 0 at rank 2; text 1 -> image 0 rank 1;
    # text 2 -> image 0 (0.9 > 0.1): rank 2; text 3 -> image 1 rank 1.
    result = recalls(logits, owner, [1, 2])
    assert result["i2t_R@1"] == 0.5 and result["i2t_R@2"] == 1.0
    assert result["t2i_R@1"] == 0.5 and result["t2i_R@2"] == 1.0
    assert result["mean_recall"] == pytest.approx((0.5 + 1 + 0.5 + 1) / 4)
    i2t, t2i = retrieval_ties(logits, owner)
    assert i2t.expected_rank().tolist() == [2, 1]
    assert t2i.expected_rank().tolist() == [2, 1, 2, 1]
    curves = recall_curves(logits, owner, 50)
    assert curves == {"k": [1, 2], "i2t": [0.5, 1.0], "t2i": [0.5, 1.0]}


def test_recall_against_a_naive_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 20, generator=generator)
    owner = torch.randint(0, 7, (20,), generator=generator)
    result = recalls(logits, owner, [1, 3, 5])
    for k in (1, 3, 5):
        i2t = sum(
            any(owner[t] == i for t in logits[i].argsort(descending=True)[:k].tolist()) for i in range(7)
        )
        t2i = sum(int(owner[t]) in logits[:, t].argsort(descending=True)[:k].tolist() for t in range(20))
        assert result[f"i2t_R@{k}"] == pytest.approx(i2t / 7)
        assert result[f"t2i_R@{k}"] == pytest.approx(t2i / 20)


def naive_recall_over_tie_breaks(logits: torch.Tensor, positives: torch.Tensor, k: int) -> float:
    """Mean hit rate at k over *every* order of the candidates that respects the scores (each
    permutation of the columns used as the tie-breaker of a stable sort): the tie policy, by brute force."""
    queries, candidates = logits.shape
    hits, orders = 0.0, 0
    for tie_breaker in itertools.permutations(range(candidates)):
        permuted = logits[:, list(tie_breaker)]
        order = torch.tensor(tie_breaker)[permuted.argsort(dim=1, descending=True, stable=True)]
        hits += positives.gather(1, order[:, :k]).any(dim=1).float().sum().item()
        orders += 1
    return hits / (orders * queries)


@pytest.mark.parametrize("seed", range(4))
def test_tied_recall_is_the_mean_over_every_tie_break(seed):
    """Heavy ties (scores in {0, 1, 2}), several captions per image: both directions equal the
    brute-force average over all tie-breaking orders, at every K."""
    generator = torch.Generator().manual_seed(seed)
    n_images, n_texts = 4, 6
    owner = torch.cat([torch.arange(n_images), torch.randint(0, n_images, (2,), generator=generator)])
    logits = torch.randint(0, 3, (n_images, n_texts), generator=generator).float()
    positives = positives_of(owner, n_images)
    for k in range(1, n_texts + 1):
        result = recalls(logits, owner, [k])
        assert result[f"i2t_R@{k}"] == pytest.approx(naive_recall_over_tie_breaks(logits, positives, k))
        if k <= n_images:
            expected = naive_recall_over_tie_breaks(logits.t(), positives.t(), k)
            assert result[f"t2i_R@{k}"] == pytest.approx(expected)


def test_duplicate_captions_tie_instead_of_going_to_the_first_listed():
    """Images 0 and 1 share the caption "a dog" (identical scores); image 2 has its own caption."""
    owner = torch.tensor([0, 1, 2])
    logits = torch.tensor([[0.9, 0.9, 0.1], [0.8, 0.8, 0.2], [0.1, 0.1, 0.7]])
    result = recalls(logits, owner, [1, 2])
    # Images 0 and 1: their caption ties with the other's copy -> a hit at 1 with probability 1/2.
    assert result["i2t_R@1"] == pytest.approx((0.5 + 0.5 + 1) / 3)
    assert result["i2t_R@2"] == 1.0
    i2t, _ = retrieval_ties(logits, owner)
    assert i2t.expected_rank().tolist() == [1.5, 1.5, 1.0]
    # Ranked in candidate order, image 0 would get R@1 = 1 and image 1 R@1 = 0: the same mean here,
    # but the policy must not depend on the order: swapping the two copies changes nothing.
    swapped = recalls(logits[:, [1, 0, 2]], owner[[1, 0, 2]], [1, 2])
    assert swapped == result


def test_chance_recall_by_hand_and_equal_to_a_constant_scorer():
    # 2 images x 5 captions: an image->text query hits at 1 with 5/10, at 5 unless all 5 slots
    # go to the other image's captions: 1 - C(5,5)/C(10,5) = 1 - 1/252.
    owner = torch.arange(2).repeat_interleave(5)
    chance = chance_recalls(owner, 2, [1, 5])
    assert chance["i2t_R@1"] == pytest.approx(0.5)
    assert chance["i2t_R@5"] == pytest.approx(1 - 1 / 252)
    assert chance["t2i_R@1"] == pytest.approx(0.5) and chance["t2i_R@5"] == 1.0
    # Uneven captions: 3 images with 1, 1, 2 captions (4 texts), K = 1: (1/4 + 1/4 + 2/4) / 3.
    uneven = torch.tensor([0, 1, 2, 2])
    assert chance_recalls(uneven, 3, [1])["i2t_R@1"] == pytest.approx(1 / 3)
    assert chance_recalls(uneven, 3, [2])["t2i_R@2"] == pytest.approx(2 / 3)
    # A scorer that ties everything scores exactly chance, at every K; the curves agree.
    ks = [1, 2, 3]
    assert recalls(torch.zeros(3, 4), uneven, ks) == pytest.approx(chance_recalls(uneven, 3, ks))
    curves = chance_curves(uneven, 3, 3)
    by_k = chance_recalls(uneven, 3, ks)
    assert curves["chance_i2t"] == pytest.approx([by_k[f"i2t_R@{k}"] for k in ks])
    assert curves["chance_t2i"] == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_retrieval_report_shows_the_chance_of_each_recall():
    result = {"name": "retrieval", "data": "d", "i2t_R@1": 0.25, "mean_recall": 0.3,
              "chance_recall": {"i2t_R@1": 0.02, "mean_recall": 0.05}}  # fmt: skip
    text = markdown_table({"export": "e", "results": [result]})
    assert "| retrieval d | i2t_R@1 | 0.2500 (12.5× chance 0.0200) |" in text  # 0.25 / 0.02
    assert "| mean_recall | 0.3000 (6× chance 0.0500) |" in text


def test_mean_and_std_over_seeds():
    summary = mean_and_std([{"top1": 0.5}, {"top1": 0.7}, {"top1": 0.6}])
    assert summary["top1"] == pytest.approx(0.6)
    assert summary["top1_std"] == pytest.approx(0.1)
    assert mean_and_std([{"top1": 0.5}]) == {"top1": 0.5}  # one run: no std


# --- zero-shot prompts and feature seeds --------------------------------------------------------


class _FakeSimilarity:
    def __init__(self, random_features: bool) -> None:
        self.uses_random_features = random_features


class _FakeModel:
    def __init__(self, random_features: bool, eval_seed: int = 3) -> None:
        self.similarity, self.eval_seed = _FakeSimilarity(random_features), eval_seed


def test_feature_seeds_repeat_only_random_feature_similarities():
    assert feature_seeds(_FakeModel(True), None) == [3, 4, 5, 6, 7]
    assert feature_seeds(_FakeModel(True), 2) == [3, 4]
    assert feature_seeds(_FakeModel(False), None) == [3]
    assert feature_seeds(_FakeModel(False), 5) == [3]  # deterministic: one run says everything
    with pytest.raises(ClipkitError, match="feature_seeds"):
        feature_seeds(_FakeModel(True), 0)


def test_zero_shot_prompt_precedence():
    info = {"labels": {"label": {"classes": ["a", "b"], "templates": ["a {}"]}}}
    assert ZeroShot("x").prompts(info) == (["a", "b"], ["a {}"])
    assert ZeroShot("x", classnames=["c", "d"], templates=["t {}"]).prompts(info) == (["c", "d"], ["t {}"])
    # A given class list must be the data's: as many classes, none of its names at another index.
    with pytest.raises(DataError, match="2 classes in the data but 1 in classnames"):
        ZeroShot("x", classnames=["c"]).prompts(info)
    with pytest.raises(DataError, match="class 0 is 'a' in the data but 'b' in classnames"):
        ZeroShot("x", classnames=["b", "a"]).prompts(info)
    # No class list anywhere: the label's distinct values in the data are the classes.
    with pytest.raises(DataError, match="no sample has meta-data 'colour'"):
        ZeroShot("x", label="colour").prompts(info)
    # A standard dataset's shipped names and CLIP's per-dataset templates beat the source's own.
    cifar = {"labels": {"label": {"classes": ["plane", *"bcdefghij"], "templates": ["a {}"]}}}
    classes, templates = ZeroShot("x", dataset="cifar10").prompts(cifar)
    assert classes[:2] == ["airplane", "automobile"] and len(classes) == 10
    assert len(templates) == 18 and templates[0] == "a photo of a {}."
    assert len(ZeroShot("x", dataset="cifar10", templates="clip7").prompts(cifar)[1]) == 7
    with pytest.raises(DataError, match="2 classes in the data but 10 in dataset 'cifar10'"):
        ZeroShot("x", dataset="cifar10").prompts(info)
    assert len(ZeroShot("x", dataset="imagenet", templates="clip80").prompts({})[1]) == 80


# --- reports ----------------------------------------------------------------------------------


def _report():
    return {
        "export": "e",
        "results": [
            {"name": "zero_shot", "data": "d1", "dataset": "cifar10", "top1": 0.5, "top1_std": 0.1,
             "top5": 0.9, "chance": 0.1, "n": 10},
            {"name": "zero_shot", "data": "d2", "label": "colour", "top1": 0.3, "chance": 0.25},
            {"name": "retrieval", "data": "d3", "i2t_R@1": 0.2, "mean_recall": 0.4,
             "curves": {"k": [1, 2], "i2t": [0.2, 0.5], "t2i": [0.1, 0.4]}},
        ],
    }  # fmt: skip


def test_summary_averages_over_datasets():
    summary = summarize(_report()["results"])
    assert summary["zero_shot_datasets"] == 2
    assert summary["zero_shot_top1_mean"] == pytest.approx(0.4)
    assert "zero_shot_top5_mean" not in summary  # not every dataset has a top-5
    assert summary["retrieval_mean_recall"] == pytest.approx(0.4)


def test_markdown_table_folds_std_and_chance():
    text = markdown_table({**_report(), "summary": summarize(_report()["results"])})
    assert "| zero_shot cifar10 d1 | top1 | 0.5000 ± 0.1000 (5× uniform chance) |" in text
    assert "| zero_shot d2:colour | top1 | 0.3000 (1.2× uniform chance) |" in text
    assert "| zero_shot_top1_mean | 0.4000 |" in text
    assert "top1_std" not in text and "chance |" not in text


def test_scores_over_too_few_samples_carry_a_warning_into_the_report():
    few = {"name": "retrieval", "data": "holdout:x?fraction=0.05", "n_images": 1, "i2t_R@1": 1.0}
    assert "only 1 sample(s)" in small_set_warning(few) and "--holdout" in small_set_warning(few)
    assert small_set_warning({**few, "n_images": MIN_EVAL_SAMPLES}) is None
    assert "only 4 sample(s): each moves a score by 25%" in small_set_warning({"n": 4, "top1": 0.5})
    assert small_set_warning({"n_train": 3, "n_test": 50}) is None  # the test set is what is scored
    assert small_set_warning({"top1": 0.5}) is None  # no count, no claim
    text = markdown_table({"results": [{**few, "warning": small_set_warning(few)}]})
    assert "| retrieval x[held-out 5%] | i2t_R@1 | 1.0000 |\n|  | *warning* | only 1 sample(s)" in text


def test_write_eval_report_writes_json_markdown_and_plots(tmp_path):
    written = write_eval_report(_report(), tmp_path / "eval.json")
    names = sorted(p.name for p in written)
    assert names == [
        "eval-accuracy.png",
        # one CLIP_benchmark-schema file per zero-shot / retrieval result (tests/test_clip_benchmark.py)
        "eval-clip_benchmark-cifar10-zeroshot_classification.json",
        "eval-clip_benchmark-d2-zeroshot_classification.json",
        "eval-clip_benchmark-d3-zeroshot_retrieval.json",
        "eval-recall.png",
        "eval.json",
        "eval.md",
    ]
    for png in ("eval-accuracy.png", "eval-recall.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "eval.json").read_text())["summary"]["zero_shot_datasets"] == 2
    first = (tmp_path / "eval-accuracy.png").read_bytes()
    write_eval_report(_report(), tmp_path / "eval.json")
    assert (tmp_path / "eval-accuracy.png").read_bytes() == first  # no timestamps: reproducible
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_recall_curves_mark_k_as_integers_without_minor_ticks(monkeypatch, tmp_path):
    """The K axis (log) is labelled 1, 2, 5, 10, 20, ... up to the largest K, as Recall@K is written,
    with no minor tick at every integer."""
    from clipkit.eval import report as report_module

    assert report_module.k_ticks(1) == [1]
    assert report_module.k_ticks(32) == [1, 2, 5, 10, 20]
    assert report_module.k_ticks(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    seen = {}
    monkeypatch.setattr(report_module, "save_figure", lambda figure, path: seen.setdefault("figure", figure))
    k = list(range(1, 51))
    curves = {"k": k, "i2t": [x / 50 for x in k], "t2i": [x / 50 for x in k]}
    report_module.plot_recall_curves(
        [{"name": "retrieval", "data": "d", "curves": curves}], tmp_path / "r.png"
    )
    axes = seen["figure"].axes[0]
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["1", "2", "5", "10", "20", "50"]
    assert list(axes.xaxis.get_minorticklocs()) == []
    report_module.pyplot().close(seen["figure"])


def test_read_metrics_ignores_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ClipkitError, match="metrics.jsonl:1"):
        read_metrics(path)


# --- a real run: eval during training, reports, comparison -------------------------------------


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, smoke_shards):
    root = tmp_path_factory.mktemp("evalrun")
    place_smoke_shards(root, smoke_shards)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        result = api.train(
            "quickstart@smoke",
            [*SMOKE, "train.eval_every=2"],
            run_dir=root / "run",
            registry=fresh_registry(),
        )
    finally:
        os.chdir(cwd)
    return root, result


def test_eval_during_training_logs_the_export_eval(evaluated_run):
    root, result = evaluated_run
    records = read_metrics(result.run_dir / "metrics.jsonl")
    during = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in during] == [2]  # every 2 steps, the final step is the export's eval
    assert 0 <= during[0]["eval/zero_shot shapes[heldout]:colour/top1"] <= 1
    assert "eval/retrieval shapes[heldout]/mean_recall" in during[0]


def test_short_data_names():
    # Each names the data file (with its folder) and the split: never the folder alone (issue 17).
    assert short_data_name("synthetic://shapes?split=heldout&n=64") == "shapes[heldout]"
    assert short_data_name("classes:/data/cifar10/test/") == "cifar10/test"
    assert short_data_name("idx:../mnist/t10k-images-idx3-ubyte.gz") == "mnist/t10k-images-idx3-ubyte.gz"
    assert short_data_name("/data/coco-mini/captions.jsonl") == "coco-mini/captions.jsonl"
    assert short_data_name("/data/coco-mini/val.jsonl") == "coco-mini/val.jsonl"
    assert short_data_name("captions.jsonl") == "captions.jsonl"
    assert short_data_name("shards/coco") == "shards/coco"
    assert short_data_name("holdout:/x/data/pets-1a2b?fraction=0.05") == "data/pets-1a2b[held-out 5%]"


def test_eval_during_training_does_not_change_training(evaluated_run, tmp_path):
    root, result = evaluated_run
    cwd = os.getcwd()
    os.chdir(root)
    try:
        plain = api.train("quickstart@smoke", SMOKE, run_dir=tmp_path / "plain", registry=fresh_registry())
    finally:
        os.chdir(cwd)
    losses = [r["loss"] for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    plain_losses = [r["loss"] for r in read_metrics(plain.run_dir / "metrics.jsonl")]
    assert losses == plain_losses
    assert result.evals == plain.evals


def test_training_writes_loss_plot_and_eval_markdown(evaluated_run):
    root, result = evaluated_run
    for name in ("loss.png", "eval.json", "eval.md", "eval-accuracy.png", "eval-recall.png"):
        assert (result.run_dir / name).is_file(), name


def test_report_compares_runs(evaluated_run, tmp_path):
    root, result = evaluated_run
    written = api.report([result.run_dir], tmp_path / "cmp")
    expected = ["eval-accuracy.png", "eval.json", "eval.md", "loss.png", "telemetry.png"]
    assert sorted(p.name for p in written) == expected
    table = (tmp_path / "cmp" / "eval.md").read_text()
    assert table.splitlines()[0] == "| task | metric | run |"
    with pytest.raises(ClipkitError, match="no metrics.jsonl"):
        api.report([tmp_path], tmp_path / "cmp2")


def test_cli_eval_with_a_tasks_file(evaluated_run, tmp_path):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    root, result = evaluated_run
    suite = tmp_path / "suite.yaml"
    data = "synthetic://shapes?split=heldout&n=40&seed=1&image_size=48"
    suite.write_text(
        f"- {{name: zero_shot, data: '{data}', label: colour}}\n"
        f"- {{name: zero_shot, data: '{data}', label: shape}}\n"
    )
    output = tmp_path / "out" / "suite.json"
    app = make_app(make_plugin_manager(autoload=False))
    outcome = CliRunner().invoke(
        app, ["eval", str(result.export_dir), "--tasks", str(suite), "--output", str(output)]
    )
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(output.read_text())
    assert [r["label"] for r in report["results"]] == ["colour", "shape"]
    assert report["summary"]["zero_shot_datasets"] == 2
    assert (tmp_path / "out" / "suite.md").is_file() and (tmp_path / "out" / "suite-accuracy.png").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: zero_shot\n")
    outcome = CliRunner().invoke(app, ["eval", str(result.export_dir), "--tasks", str(bad)])
    assert outcome.exit_code != 0 and "bad.yaml: expected a list of tasks" in outcome.output


# --- every similarity through zero-shot and retrieval --------------------------------------------

HELDOUT = "synthetic://shapes?split=heldout&n=40&seed=1&image_size=48"


@pytest.mark.parametrize("spec", ["wpse@tiny", "kme_clip@tiny", "cloob@tiny"])
def test_zero_shot_and_retrieval_score_every_similarity(spec, tmp_path):
    """Untrained tiny exports of the point-set and Hopfield similarities evaluate through their own
    similarity; WPSE (random features) is repeated over 5 feature seeds with a spread."""
    from clipkit.artifacts.export import write_export
    from clipkit.artifacts.reader import load_export
    from clipkit.eval.evaluate import run_evals
    from clipkit.model import build_model

    registry = fresh_registry()
    recipe = api.resolve(spec, [], registry)
    torch.manual_seed(0)
    write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)
    model, _ = load_export(tmp_path / "export", registry)
    tasks = [
        {"name": "zero_shot", "data": HELDOUT, "label": "colour"},
        {"name": "retrieval", "data": HELDOUT},
    ]
    zero_shot, retrieval = run_evals(model, tasks, registry)
    random_features = spec.startswith("wpse")
    assert zero_shot["feature_seeds"] == retrieval["feature_seeds"] == (5 if random_features else 1)
    assert ("top1_std" in zero_shot) == random_features
    assert 0 <= zero_shot["top1"] <= 1 and 0 <= retrieval["mean_recall"] <= 1
    if random_features:  # different feature draws really give different logits
        from clipkit.eval.evaluate import encode_images, encode_texts, image_text_logits, load_samples

        samples, _ = load_samples(HELDOUT, 8, registry=registry)
        images = encode_images(model, samples)
        texts = encode_texts(model, [s.captions[0] for s in samples])
        first, second = (image_text_logits(model, images, texts, seed=seed) for seed in (0, 1))
        assert not torch.equal(first, second)
        assert torch.equal(first, image_text_logits(model, images, texts, seed=0))


@pytest.mark.parametrize(
    "task, options, message",
    [
        ("retrieval", {"ks": [0]}, r"ks\[0\] must be an integer >= 1, got 0"),
        ("retrieval", {"ks": []}, "ks must list the K"),
        ("retrieval", {"batch_size": 0}, "batch_size must be an integer >= 1"),
        ("retrieval", {"limit": -1}, "limit must be an integer >= 1"),
        ("zero_shot", {"feature_seeds": 0}, "feature_seeds must be an integer >= 1"),
        ("zero_shot", {"limit": 2.5}, "limit must be an integer >= 1"),
        ("diagnostics", {"batch_size": True}, "batch_size must be an integer >= 1"),
    ],
)
def test_counts_of_eval_tasks_are_checked_when_the_task_is_built(registry, task, options, message):
    # Before: R@0 reported as 0.0000, `ks: []` fell back to the defaults, batch_size 0 failed
    # with range()'s ValueError after the model loaded, limit -1 read as "no samples".
    from clipkit.model import build_slot

    with pytest.raises(ClipkitError, match=message):
        build_slot(registry, "eval", {"name": task, "data": "synthetic://shapes?n=4", **options}, "eval.0")


def test_retrieval_reports_each_k_once_in_the_order_given(registry):
    from clipkit.model import build_slot

    task = build_slot(registry, "eval", {"name": "retrieval", "data": "x", "ks": [5, 1, 5]}, "eval.0")
    assert task.ks == [5, 1]


@pytest.mark.parametrize("text", ["", "[]\n", "eval: []\n"])
def test_a_tasks_file_with_no_tasks_is_refused_before_a_model_loads(tmp_path, text):
    # It loaded the model, then said the export's recipe had no `eval:` section.
    from clipkit.app.cli import read_tasks_file

    path = tmp_path / "suite.yaml"
    path.write_text(text)
    with pytest.raises(ClipkitError, match="the tasks file lists no tasks"):
        read_tasks_file(path)
