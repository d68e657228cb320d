"""Classification metrics and the baselines every score is shown against (zero-shot, linear probe).

The metrics are the field's (CLIP_benchmark, DataComp): top-1 and top-5 accuracy, and the **mean
per-class recall** (balanced accuracy: the recall of each class present in the labels, averaged
with equal weight, as sklearn's ``balanced_accuracy_score``), which a skewed label set cannot
inflate.

A score alone says little on a skewed label set: always guessing the most frequent class may
already score 63 %. So every result carries two baselines, computed on the evaluated labels:

- ``chance``: a guess drawn uniformly from the C classes (top-k: k/C; mean per-class recall: 1/C);
- ``majority``: always answering the most frequent class of the evaluated labels (top-k: the share
  of the k most frequent classes; mean per-class recall: 1/K over the K classes present — any
  constant answer scores that, which is why this metric is the fair one on skewed sets).

A ratio "N× baseline" is only worth printing against the *stronger* of the two and only for top-1
and mean per-class recall (top-5 with few classes is near 1 by construction); :func:`ratio_note`
always names the baseline it divides by.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

#: The metrics whose baselines a result carries, in the order reports show them.
CLASSIFICATION_METRICS = ("top1", "top5", "mean_per_class_recall")
#: The metrics a ratio against a baseline is shown for (see the module docstring).
RATIO_METRICS = ("top1", "mean_per_class_recall")
#: How reports name each baseline.
BASELINE_NAMES = {"chance": "uniform chance", "majority": "majority class"}


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of rows whose label is among the k largest logits. logits [N, C], labels [N]."""
    k = min(k, logits.shape[1])
    hits = (logits.topk(k, dim=1).indices == labels.unsqueeze(1)).any(dim=1)
    return float(hits.double().mean())  # float64: 0.105, not 0.10499999672


def mean_per_class_recall(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """The recall of each class present in ``labels`` [N], averaged with equal weight (balanced
    accuracy; classes that only appear among ``predictions`` [N] do not count, as in sklearn)."""
    labels, predictions = labels.long().cpu(), predictions.long().cpu()
    recalls = [float((predictions[labels == c] == c).double().mean()) for c in labels.unique().tolist()]
    return sum(recalls) / len(recalls)


def classification_scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """top1, top5 (with at least 5 classes) and mean_per_class_recall of logits [N, C] against labels [N]."""
    labels = labels.to(logits.device)
    scores = {"top1": topk_accuracy(logits, labels, 1)}
    if logits.shape[1] >= 5:
        scores["top5"] = topk_accuracy(logits, labels, 5)
    scores["mean_per_class_recall"] = mean_per_class_recall(logits.argmax(dim=1), labels)
    return scores


def class_baselines(labels: Sequence[int] | torch.Tensor, classnames: Sequence) -> dict[str, dict]:
    """The uniform-chance and majority-class baselines of each metric on ``labels`` (class indices
    into ``classnames``); see the module docstring. ``majority`` also names its class, and every
    class tied with it (``tied``) when several are the most frequent."""
    values = labels.tolist() if isinstance(labels, torch.Tensor) else list(labels)
    num_classes, n = len(classnames), len(values)
    counts = Counter(values).most_common()
    chance = {"top1": 1 / num_classes, "mean_per_class_recall": 1 / num_classes}
    majority = {
        "top1": counts[0][1] / n,
        "mean_per_class_recall": 1 / len(counts),
        "class": str(classnames[counts[0][0]]),
    }
    tied = [str(classnames[index]) for index, count in counts if count == counts[0][1]]
    if len(tied) > 1:
        majority["tied"] = tied
    if num_classes >= 5:
        chance["top5"] = 5 / num_classes
        majority["top5"] = sum(count for _, count in counts[:5]) / n
    return {"chance": chance, "majority": majority}


def strongest_baseline(result: dict, metric: str) -> tuple[str, float] | None:
    """(baseline name, value) of the higher baseline of ``metric`` in ``result``, or None. On a tie
    uniform chance is named (the simpler one)."""
    baselines = result.get("baselines")
    if not isinstance(baselines, dict):
        return None
    found = [
        (name, float(entry[metric]))
        for name, entry in baselines.items()
        if isinstance(entry, dict) and isinstance(entry.get(metric), (int, float))
    ]
    if not found:
        return None
    return max(found, key=lambda pair: (pair[1], pair[0] == "chance"))


def baseline_note(result: dict, metric: str) -> str:
    """``uniform chance 0.1000, majority class 0.6300 ('cat')`` for ``metric``, or '' when the result
    has no baselines."""
    baselines = result.get("baselines")
    if not isinstance(baselines, dict):
        return ""
    parts = []
    for name, entry in baselines.items():
        if isinstance(entry, dict) and isinstance(entry.get(metric), (int, float)):
            text = f"{BASELINE_NAMES.get(name, name)} {fixed(entry[metric])}"
            if name == "majority" and metric == "top1" and entry.get("tied"):
                text += f" (a tie of {', '.join(repr(c) for c in entry['tied'])})"
            elif name == "majority" and metric == "top1" and entry.get("class") is not None:
                text += f" ({entry['class']!r})"
            parts.append(text)
    return ", ".join(parts)


def ratio_note(result: dict, metric: str) -> str:
    """``6.9× majority class`` — ``metric``'s value over its stronger baseline, naming it; '' where a
    ratio means nothing (another metric, no baseline, a zero baseline)."""
    strongest = strongest_baseline(result, metric) if metric in RATIO_METRICS else None
    if strongest is None or strongest[1] <= 0 or not isinstance(result.get(metric), (int, float)):
        return ""
    name, value = strongest
    return f"{ratio_text(result[metric] / value)}× {BASELINE_NAMES.get(name, name)}"


def ratio_text(ratio: float) -> str:
    """A ratio to 3 significant digits (6.74, 38.4, 0.932): enough to recompute it from the
    printed value and baseline."""
    return f"{ratio:.3g}"


def fixed(value: float) -> str:
    """A score or baseline: 4 decimals, or 4 significant digits below 0.01 (1/819 is 0.001221, not
    0.0012, so a ratio to it can be recomputed); 3 significant digits outside [1e-6, 1e5)."""
    if value != 0 and not 1e-6 <= abs(value) < 1e5:
        return f"{value:.3g}"
    if value != 0 and abs(value) < 0.01:
        return f"{value:.4g}"
    return f"{value:.4f}"
