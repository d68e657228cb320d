"""Classification metrics and baselines (clipkit.eval.metrics): against sklearn and by hand."""

from __future__ import annotations

import warnings

import pytest
import torch

from clipkit.eval.metrics import (
    baseline_note,
    class_baselines,
    classification_scores,
    fixed,
    mean_per_class_recall,
    ratio_note,
)
from clipkit.eval.report import format_value, markdown_table


def test_mean_per_class_recall_by_hand():
    # class 0: 3 of 4 right; class 1: 0 of 1; class 2: 1 of 1 -> (0.75 + 0 + 1) / 3
    labels = torch.tensor([0, 0, 0, 0, 1, 2])
    predictions = torch.tensor([0, 0, 0, 2, 0, 2])
    assert mean_per_class_recall(predictions, labels) == pytest.approx(1.75 / 3)
    # plain accuracy would be 4/6; the skew towards class 0 cannot inflate the balanced one
    assert mean_per_class_recall(torch.zeros(6, dtype=torch.long), labels) == pytest.approx(1 / 3)


def test_mean_per_class_recall_ignores_classes_only_predicted():
    labels = torch.tensor([1, 1, 3])
    predictions = torch.tensor([1, 4, 4])  # class 4 is never a label: not averaged over
    assert mean_per_class_recall(predictions, labels) == pytest.approx((0.5 + 0.0) / 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_per_class_recall_matches_sklearn(seed):
    metrics = pytest.importorskip("sklearn.metrics")
    generator = torch.Generator().manual_seed(seed)
    # a skewed label set: class 0 holds most samples, one class is absent
    labels = torch.cat([torch.zeros(60, dtype=torch.long), torch.randint(1, 7, (40,), generator=generator)])
    logits = torch.randn(100, 8, generator=generator)
    logits[torch.arange(100), labels] += torch.rand(100, generator=generator) * 2  # better than chance
    scores = classification_scores(logits, labels)
    predictions = logits.argmax(dim=1)
    with warnings.catch_warnings():  # sklearn warns of predicted classes absent from the labels
        warnings.simplefilter("ignore")
        expected = metrics.balanced_accuracy_score(labels.numpy(), predictions.numpy())
    assert scores["mean_per_class_recall"] == pytest.approx(expected, abs=1e-12)
    assert scores["top1"] == pytest.approx(metrics.accuracy_score(labels.numpy(), predictions.numpy()))
    assert scores["top5"] == pytest.approx(
        metrics.top_k_accuracy_score(labels.numpy(), logits.numpy(), k=5, labels=list(range(8)))
    )


def test_baselines_by_hand():
    # 10 samples over 6 classes: 'cat' x6, 'dog' x2, 'owl' x1, 'ant' x1; 'bee', 'elk' absent
    classnames = ["ant", "bee", "cat", "dog", "elk", "owl"]
    labels = [2] * 6 + [3] * 2 + [5] + [0]
    baselines = class_baselines(labels, classnames)
    assert baselines["chance"] == {"top1": 1 / 6, "top5": 5 / 6, "mean_per_class_recall": 1 / 6}
    majority = baselines["majority"]
    assert majority["class"] == "cat" and majority["top1"] == 0.6
    assert majority["top5"] == 1.0  # the 4 present classes are all among the 5 most frequent
    assert majority["mean_per_class_recall"] == 1 / 4  # recall 1 on 'cat', 0 on the 3 others present


def test_baselines_few_classes_have_no_top5():
    baselines = class_baselines(torch.tensor([0, 1, 1]), ["a", "b"])
    assert "top5" not in baselines["chance"] and "top5" not in baselines["majority"]
    assert baselines["majority"]["top1"] == pytest.approx(2 / 3)


def test_ratio_names_the_stronger_baseline():
    # the case: 20.1 % top-1 on 16 classes whose majority class holds 21.7 %
    result = {
        "top1": 0.201,
        "mean_per_class_recall": 0.125,
        "top5": 0.5,
        "baselines": {
            "chance": {"top1": 1 / 16, "top5": 5 / 16, "mean_per_class_recall": 1 / 16},
            "majority": {"top1": 0.217, "top5": 0.6, "mean_per_class_recall": 1 / 16, "class": "cat"},
        },
    }
    assert ratio_note(result, "top1") == "0.926× majority class"  # 0.201 / 0.217, 3 significant digits
    assert ratio_note(result, "mean_per_class_recall") == "2× uniform chance"  # a tie: chance named
    assert ratio_note(result, "top5") == ""  # no ratio for top-5
    text = format_value(result, "top1")
    assert text == "0.2010 (0.926× majority class; uniform chance 0.0625, majority class 0.2170 ('cat'))"
    assert "×" not in format_value(result, "top5") and "majority class 0.6000" in format_value(result, "top5")


def test_markdown_every_ratio_names_its_baseline():
    labels = torch.tensor([0] * 7 + [1, 2, 3])
    logits = torch.nn.functional.one_hot(torch.tensor([0] * 5 + [1] * 5), 4).float()
    result = {"name": "zero_shot", "data": "d", **classification_scores(logits, labels)}
    result["baselines"] = class_baselines(labels, ["a", "b", "c", "d"])
    text = markdown_table({"export": "e", "results": [result]})
    ratios = [line for line in text.splitlines() if "×" in line]
    assert len(ratios) == 2  # top1 and mean per-class recall
    assert all("× majority class" in line or "× uniform chance" in line for line in ratios)
    assert "0.6000 (0.857× majority class" in text  # 6 of 10 right against always-'a' at 0.7


def test_majority_tie_names_every_tied_class():
    labels = torch.tensor([2, 0, 2, 0, 1])  # 'a' and 'c' both twice
    majority = class_baselines(labels, ["a", "b", "c"])["majority"]
    assert majority["top1"] == pytest.approx(2 / 5)
    assert sorted(majority["tied"]) == ["a", "c"] and majority["class"] in ("a", "c")
    result = {"top1": 0.6, "baselines": {"majority": majority}}
    assert "a tie of 'c', 'a'" in baseline_note(result, "top1") or "a tie of 'a', 'c'" in baseline_note(
        result, "top1"
    )
    assert "tied" not in class_baselines(torch.tensor([0, 0, 1]), ["a", "b"])["majority"]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1 / 819, "0.001221"),
        (0.0625, "0.0625"),
        (0.02, "0.0200"),
        (0.2170, "0.2170"),
        (1e-7, "1e-07"),
        (0.0, "0.0000"),
    ],  # fmt: skip
)
def test_small_baselines_keep_four_significant_digits(value, text):
    assert fixed(value) == text


def test_retrieval_rows_give_the_ratio_to_chance():
    result = {"name": "retrieval", "data": "d", "i2t_R@1": 0.05, "chance_recall": {"i2t_R@1": 1 / 819}}
    assert format_value(result, "i2t_R@1") == "0.0500 (41× chance 0.001221)"  # 0.05 * 819 = 40.95
