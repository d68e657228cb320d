"""The kme-mixture report: error vs K per similarity (mean ± 95 % interval over seeds), the trend
from the smallest to the largest K (paired over seeds), the verdict line, Markdown and a plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clipkit.plugins.experiments.pmi_study import mean_interval

#: Per-run metrics aggregated over seeds (all lower is better).
METRICS = ("sup_error", "rms_error", "off_support")


def summarise(runs: list[dict[str, Any]], labels: list[str], classes: list[int]) -> dict[str, Any]:
    """{"summary": per (label, K) mean ± half-width of each metric, "trend": per label the paired
    change of sup_error from min K to max K, "verdict": one line}."""
    summary = []
    for label in labels:
        for k in classes:
            chosen = [run for run in runs if run["label"] == label and run["classes"] == k]
            row: dict[str, Any] = {"label": label, "classes": k, "seeds": len(chosen)}
            for key in METRICS:
                row[key], row[f"{key}_ci95"] = mean_interval([run[key] for run in chosen])
            summary.append(row)
    trend = [_trend(runs, label, min(classes), max(classes)) for label in labels]
    return {"summary": summary, "trend": trend, "verdict": verdict(trend, summary, max(classes))}


def _trend(runs, label: str, low: int, high: int) -> dict[str, Any]:
    """sup_error at K = high minus at K = low, paired by seed, with its 95 % interval."""
    by_seed = {(run["classes"], run["seed"]): run["sup_error"] for run in runs if run["label"] == label}
    seeds = sorted({seed for k, seed in by_seed if k == low} & {seed for k, seed in by_seed if k == high})
    change, half = mean_interval([by_seed[high, s] - by_seed[low, s] for s in seeds])
    grows = not math.isnan(half) and change - half > 0
    return {"label": label, "from": low, "to": high, "change": change, "change_ci95": half, "grows": grows}


def verdict(trend: list[dict[str, Any]], summary: list[dict[str, Any]], high: int) -> str:
    """One line: does CLIP's (dot) sup error grow with K while KME's stays flat, and who is lower at
    the largest K. 'grows' = the paired 95 % interval of the change lies above 0."""
    by_label = {row["label"]: row for row in trend}
    clip = next((row for row in trend if row["label"].startswith("dot")), None)
    kme = next((row for row in trend if row["label"].startswith("kme")), None)
    if clip is None or kme is None or clip["from"] == clip["to"]:
        return "verdict: needs dot and kme at two or more K to say"
    at_high = {row["label"]: row["sup_error"] for row in summary if row["classes"] == high}

    def says(row):
        state = "grows" if row["grows"] else "does not grow"
        change = _cell(row["change"], row["change_ci95"])
        return f"{row['label']} {state} ({change} nats from K = {row['from']} to {row['to']})"

    holds = clip["grows"] and not kme["grows"] and at_high[kme["label"]] < at_high[clip["label"]]
    head = "HOLDS" if holds else "NOT SHOWN"
    others = [says(row) for label, row in by_label.items() if row not in (clip, kme)]
    return (
        f"verdict: {head} — sup error {says(clip)}; {says(kme)}"
        + (f"; {'; '.join(others)}" if others else "")
        + f"; at K = {high}: "
        + ", ".join(f"{label} {value:.3f}" for label, value in at_high.items())
    )


def _cell(mean: float, half: float, digits: int = 3) -> str:
    return f"{mean:+.{digits}f}" if math.isnan(half) else f"{mean:+.{digits}f} ± {half:.{digits}f}"


def _value(mean: float, half: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def markdown(study: dict[str, Any]) -> str:
    """The report: settings, the error table (one row per similarity, one column per K), the
    RMS and off-support tables, the verdict."""
    config = study["config"]
    classes = config["classes"]
    lines = [
        f"K-mixture model (seed 003 §4.2, Assumption 5): K = {classes}; equal budget {config['budget']} "
        f"floats per datapoint (dot: d = {config['budget']}; point sets: M = {config['points']}); "
        f"{config['steps']} Adam steps (lr {config['lr']}) × batch {config['batch_size']}; seeds "
        f"{config['seeds']} (mean ± 95 % Student-t interval); CPU {study.get('cpu_seconds', 0):.0f} s.",
        "",
    ]
    titles = {
        "sup_error": "sup over the support of |s − PMI − C|, best C (nats; the theorems' measure) ↓",
        "rms_error": "p(x, y)-weighted RMS of s − PMI − C, best C (nats) ↓",
        "off_support": "share of off-support pairs above their row's weakest support pair ↓",
    }
    for key in METRICS:
        lines += [
            f"**{titles[key]}**",
            "",
            "| similarity | " + " | ".join(f"K = {k}" for k in classes) + " |",
            "| --- |" + " ---: |" * len(classes),
        ]
        for label in dict.fromkeys(row["label"] for row in study["summary"]):
            cells = [
                _value(row[key], row[f"{key}_ci95"])
                for k in classes
                for row in study["summary"]
                if row["label"] == label and row["classes"] == k
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [study["verdict"], ""]
    return "\n".join(lines)


def write_study(study: dict[str, Any], out_dir: Path) -> None:
    """kme_mixture.json, kme_mixture.md and kme_mixture.png (sup error vs K, 95 % error bars)."""
    from clipkit.artifacts.io import atomic_path, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "kme_mixture.json", json.dumps(study, indent=2) + "\n")
    atomic_write_text(out_dir / "kme_mixture.md", markdown(study))
    with atomic_path(out_dir / "kme_mixture.png") as temporary:
        _plot(study, temporary)


def _plot(study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key in zip(axes, ("sup_error", "rms_error"), strict=True):
        for label in dict.fromkeys(row["label"] for row in study["summary"]):
            rows = [row for row in study["summary"] if row["label"] == label]
            errors = [0.0 if math.isnan(row[f"{key}_ci95"]) else row[f"{key}_ci95"] for row in rows]
            axis.errorbar(
                [row["classes"] for row in rows],
                [row[key] for row in rows],
                yerr=errors,
                marker="o",
                capsize=3,
                label=label,
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("classes K")
        axis.set_ylabel("nats")
        axis.set_title(
            {"sup_error": "sup |s − PMI − C| (theorems' measure)", "rms_error": "RMS (p-weighted)"}[key]
        )
        axis.legend(fontsize=8)
    figure.suptitle(
        f"K-mixture model, budget {study['config']['budget']} floats (mean, 95 % interval)", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
