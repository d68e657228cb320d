"""The cloob-ablation report: per arm, mean ± 95 % interval over seeds of zero-shot, retrieval and
CLOOB's diagnostics; the paper's ordering claims checked pairwise (same seeds); JSON, Markdown, PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clipkit.plugins.experiments.pmi_study import mean_interval

#: arm label -> (the cloob recipe's variant, loss, Hopfield on). The default recipe is CLOOB itself.
ARMS: dict[str, tuple[str, str, bool]] = {
    "infonce": ("cloob@infonce", "InfoNCE", False),
    "infoloob": ("cloob@infoloob", "InfoLOOB", False),
    "infonce_hopfield": ("cloob@infonce_hopfield", "InfoNCE", True),
    "cloob": ("cloob", "InfoLOOB", True),
}

#: Metrics aggregated over seeds and shown in the table: (task, key, heading, higher is better).
HEADLINE = (
    ("zero_shot", "top1", "zero-shot top-1", True),
    ("zero_shot", "mean_per_class_recall", "zero-shot mean per-class recall", True),
    ("retrieval", "mean_recall", "retrieval mean R@{1,5,10}", True),
    ("retrieval", "i2t_R@1", "image→text R@1", True),
    ("retrieval", "t2i_R@1", "text→image R@1", True),
    ("diagnostics", "effective_eigenvalues_image", "effective eigenvalues (image, 99 %)", True),
    ("diagnostics", "effective_eigenvalues_text", "effective eigenvalues (text, 99 %)", True),
    ("diagnostics", "uniformity_image", "uniformity (image) ↓", False),
    ("diagnostics", "uniformity_text", "uniformity (text) ↓", False),
)


#: The paper's claims (seed 001 Table 3): (better arm, worse arm) on zero-shot top-1.
CLAIMS = (
    ("cloob", "infonce"),
    ("cloob", "infoloob"),
    ("infonce_hopfield", "infonce"),
    ("infoloob", "infonce"),
)


def run_metrics(run: dict[str, Any]) -> dict[str, float]:
    """One run's scalar metrics as ``task.key`` (failed tasks and non-numbers left out)."""
    metrics = {}
    for result in run["evals"]:
        if result.get("failed"):
            continue
        for key, value in result.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[f"{result['name']}.{key}"] = float(value)
    return metrics


def summarise(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """{"summary": per arm {metric: [mean, half-width]}, "claims": the paired checks}."""
    by_arm = {arm: {run["seed"]: run_metrics(run) for run in runs if run["arm"] == arm} for arm in arms}
    summary = {}
    for arm in arms:
        row = {
            "seeds": len(by_arm[arm]),
            "cpu_seconds": mean_interval([r["cpu_seconds"] for r in runs if r["arm"] == arm]),
        }
        for task, key, _, _ in HEADLINE:
            values = [
                metrics[f"{task}.{key}"] for metrics in by_arm[arm].values() if f"{task}.{key}" in metrics
            ]
            if values:
                row[f"{task}.{key}"] = mean_interval(values)
        summary[arm] = row
    claims = [
        _claim(by_arm, better, worse, metric)
        for better, worse in CLAIMS
        if better in by_arm and worse in by_arm
        for metric in ("zero_shot.top1", "retrieval.mean_recall")
    ]
    return {"summary": summary, "claims": [claim for claim in claims if claim is not None]}


def _claim(by_arm, better: str, worse: str, metric: str) -> dict[str, Any] | None:
    seeds = sorted(set(by_arm[better]) & set(by_arm[worse]))
    pairs = [(by_arm[better][s].get(metric), by_arm[worse][s].get(metric)) for s in seeds]
    differences = [a - b for a, b in pairs if a is not None and b is not None]
    if not differences:
        return None
    mean, half = mean_interval(differences)
    if math.isnan(half):
        state = "one seed: no interval"
    elif mean - half > 0:
        state = "holds"
    elif mean + half < 0:
        state = "reversed"
    else:
        state = "not shown (interval includes 0)"
    return {
        "better": better,
        "worse": worse,
        "metric": metric,
        "difference": mean,
        "ci95": half,
        "seeds": len(differences),
        "state": state,
    }


def _cell(pair, digits: int = 3) -> str:
    if pair is None:
        return "—"
    mean, half = pair
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = [
        f"CLOOB 2×2 ablation (seed 001 Table 3) on {config['data']} "
        f"(held-out {config['holdout']:.0%} by key hash"
        f"{', zero-shot over ' + repr(config['label']) if config['label'] else ''}); base {config['base']}, "
        f"{config['steps']} steps × batch {config['batch_size']}, warm-up {config['warmup_steps']} steps "
        f"({config['warmup_fraction']:.1%}), 1/τ = {config['inverse_tau']} fixed, β = {config['beta']}; "
        f"seeds {config['seeds']} (mean ± 95 % Student-t interval).",
        "",
        "| arm | loss | Hopfield | "
        + " | ".join(heading for _, _, heading, _ in HEADLINE)
        + " | CPU s / run |",
        "| --- | --- | --- |" + " ---: |" * (len(HEADLINE) + 1),
    ]
    for arm, row in report["summary"].items():
        _, loss, hopfield = ARMS[arm]
        cells = [_cell(row.get(f"{task}.{key}")) for task, key, _, _ in HEADLINE]
        lines.append(
            f"| {arm} | {loss} | {'on' if hopfield else 'off'} | "
            + " | ".join(cells)
            + f" | {_cell(row['cpu_seconds'], 0)} |"
        )
    lines += ["", "Paper's ordering, paired over seeds (better − worse):", ""]
    for claim in report["claims"]:
        lines.append(
            f"- {claim['better']} > {claim['worse']} on {claim['metric']}: "
            f"{claim['difference']:+.4f} ± {0 if math.isnan(claim['ci95']) else claim['ci95']:.4f} "
            f"— {claim['state']}"
        )
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """cloob_ablation.json, cloob_ablation.md and cloob_ablation.png in ``out_dir``."""
    from clipkit.artifacts.io import atomic_path, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "cloob_ablation.json", json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "cloob_ablation.md", markdown(report))
    with atomic_path(out_dir / "cloob_ablation.png") as temporary:
        _plot(report, temporary)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("zero_shot.top1", "zero-shot top-1"),
        ("retrieval.mean_recall", "retrieval mean recall"),
        ("diagnostics.uniformity_image", "uniformity (image) ↓"),
    ]
    arms = list(report["summary"])
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for axis, (metric, title) in zip(axes, panels, strict=True):
        pairs = [report["summary"][arm].get(metric) or (math.nan, math.nan) for arm in arms]
        errors = [0.0 if math.isnan(half) else half for _, half in pairs]
        axis.bar(
            range(len(arms)), [mean for mean, _ in pairs], yerr=errors, capsize=4, color="tab:blue", alpha=0.7
        )
        for position, arm in enumerate(arms):
            values = [run_metrics(run).get(metric) for run in report["runs"] if run["arm"] == arm]
            axis.scatter([position] * len(values), values, color="black", s=8, zorder=3)
        axis.set_xticks(range(len(arms)), arms, rotation=20, fontsize=8)
        axis.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
