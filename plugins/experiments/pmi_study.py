"""PMI-fidelity study over seeds: mean ± 95 % interval of each similarity's correlation with the
true PMI and its InfoNCE gap to the Bayes optimum (METHODS §8; one run is
:mod:`clipkit.plugins.experiments.pmi`).

One seed proves nothing (single-seed Pearson r moved by 0.1 between seeds in issue 20), so
:func:`run_pmi_study` repeats :func:`clipkit.plugins.experiments.pmi.run_pmi_benchmark` on one fixed task (the
distribution's own ``task_seed``) with training seeds ``seeds`` (encoder init, batches, random
features, held-out pairs) and reports, per similarity, the mean and a Student-t 95 % interval of

- ``pearson``: correlation of the learned similarity with the true PMI on held-out pairs;
- ``infonce_gap``: held-out InfoNCE minus the InfoNCE of the true PMI (the Bayes optimum);

and, against the similarity with the best mean r, the paired difference (same seeds, same data)
with its interval: an entry "leads" only where that interval excludes 0.

CLI: ``clipkit experiment pmi-fidelity --seeds 5 --topics K ...`` writes pmi_study.json, .md, .png.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clipkit.plugins.experiments.pmi import LatentPairDistribution, run_pmi_benchmark

#: Student-t 0.975 quantiles for 1..30 degrees of freedom (two-sided 95 % interval); above 30,
#: the normal 1.96 is within 4 %.
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

#: Metrics aggregated over seeds: (key, higher is better).
METRICS = (("pearson", True), ("infonce_gap", False), ("rmse", False), ("sup_error", False))


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the two-sided 95 % Student-t interval); half-width nan for one value."""
    values = [float(v) for v in values]
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    quantile = T975[len(values) - 2] if len(values) - 1 <= len(T975) else 1.96
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def with_kme_gamma(
    similarities: Sequence[dict | str] | None, init_gamma: float | None, max_gamma: float | None
) -> list[dict | str] | None:
    """The entries with KME's γ start / clamp set on every ``kme`` entry that does not set its own
    (None entries = :data:`clipkit.plugins.experiments.pmi.DEFAULT_SIMILARITIES`). ``max_gamma`` ≤ 0
    means no clamp."""
    from clipkit.plugins.experiments.pmi import DEFAULT_SIMILARITIES

    if init_gamma is None and max_gamma is None:
        return None if similarities is None else list(similarities)
    entries = []
    for item in DEFAULT_SIMILARITIES if similarities is None else similarities:
        spec = {"name": item} if isinstance(item, str) else dict(item)
        if spec["name"] == "kme":
            if init_gamma is not None:
                spec.setdefault("init_gamma", float(init_gamma))
            if max_gamma is not None:
                spec.setdefault("max_gamma", float(max_gamma) if max_gamma > 0 else None)
        entries.append(spec)
    return entries


def run_pmi_study(
    similarities: Sequence[dict | str] | None = None,
    *,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    topics: int = 8,
    separation: float = 1.0,
    input_dim: int = 8,
    task_seed: int = 0,
    out_dir: Path | str | None = None,
    **benchmark: Any,
) -> dict[str, Any]:
    """Run the benchmark once per seed on one task and aggregate (see the module docstring).

    topics, separation, input_dim, task_seed: the task, :class:`LatentPairDistribution`
        (K latents, means ~ N(0, separation² I) in R^input_dim for x and y, noise 1).
    benchmark: passed to :func:`run_pmi_benchmark` (embed_dim, points, steps, batch_size, hidden,
        lr, eval_batches, registry, ...).

    Returns {"config", "distribution", "runs": [per-seed reports' results], "summary": [per
    similarity, ranked by mean r], "leader"}.
    """
    if len(seeds) < 1:
        raise ValueError("the study needs at least one seed")
    distribution = LatentPairDistribution(topics, input_dim, input_dim, separation=separation, seed=task_seed)
    runs = []
    for seed in seeds:
        report = run_pmi_benchmark(similarities, seed=seed, distribution=distribution, **benchmark)
        runs.append({"seed": seed, "results": report["results"], "reference": report["reference"]})
    summary = summarise(runs)
    study = {
        "config": {**report["config"], "seeds": list(seeds), "task_seed": task_seed},
        "distribution": distribution.config,
        "runs": runs,
        "summary": summary,
        "leader": summary[0]["label"],
    }
    if out_dir is not None:
        write_study(study, Path(out_dir))
    return study


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per similarity: mean and 95 % half-width of each metric, and the paired difference of r and
    of the InfoNCE gap against the best-r entry; ranked by mean r."""
    labels = [result["label"] for result in runs[0]["results"]]
    by_label = [{result["label"]: result for result in run["results"]} for run in runs]
    values = {label: {key: [run[label][key] for run in by_label] for key, _ in METRICS} for label in labels}
    rows = []
    for label in labels:
        row: dict[str, Any] = {"label": label, "seeds": len(runs)}
        for key, _ in METRICS:
            row[key], row[f"{key}_ci95"] = mean_interval(values[label][key])
        rows.append(row)
    rows.sort(key=lambda row: -row["pearson"])
    best = rows[0]["label"]
    for row in rows:
        for key in ("pearson", "infonce_gap"):
            differences = [a - b for a, b in zip(values[row["label"]][key], values[best][key], strict=True)]
            row[f"{key}_vs_best"], row[f"{key}_vs_best_ci95"] = mean_interval(differences)
        row["rank"] = rows.index(row) + 1
    return rows


def _cell(mean: float, half: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def headline_table(study: dict[str, Any]) -> list[str]:
    """The papers' own measures first (see :data:`PAPERS_MEASURES`): sup error (seed 000) and
    InfoNCE gap (seed 003), each with the paired difference to CLIP (``dot``) where it is present."""
    from clipkit.plugins.experiments.pmi_report import PAPERS_MEASURES

    rows = study["summary"]
    clip = next((row["label"] for row in rows if row["label"].startswith("dot")), None)
    lines = [
        *PAPERS_MEASURES,
        "| similarity | sup error (seed 000's measure) ↓ | InfoNCE gap (seed 003's measure) ↓ "
        + (f"| sup − {clip} (paired) | gap − {clip} (paired) |" if clip else "|"),
        "| --- | ---: | ---: |" + (" ---: | ---: |" if clip else ""),
    ]
    for row in sorted(rows, key=lambda row: row["infonce_gap"]):
        cells = [
            _cell(row["sup_error"], row["sup_error_ci95"]),
            _cell(row["infonce_gap"], row["infonce_gap_ci95"]),
        ]
        if clip:
            cells += [_cell(*_paired(study, row["label"], clip, key)) for key in ("sup_error", "infonce_gap")]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _paired(study: dict[str, Any], label: str, other: str, key: str) -> tuple[float, float]:
    """Mean and 95 % half-width of ``key`` of ``label`` minus ``other``, same seeds."""
    values = [{r["label"]: r[key] for r in run["results"]} for run in study["runs"]]
    return mean_interval([v[label] - v[other] for v in values])


def study_table(study: dict[str, Any]) -> str:
    """The summary as Markdown: the papers' measures first, then every metric; mean ± 95 %
    half-width over seeds."""
    config, task = study["config"], study["distribution"]
    best = study["summary"][0]["label"]
    lines = [
        f"PMI study: K = {task['num_latent']} latents, separation {task['separation']}, inputs "
        f"{task['x_dim']}-d; d = {config['embed_dim']}, M = {config['points']}, hidden {config['hidden']}, "
        f"lr {config['lr']}, {config['steps']} steps × batch {config['batch_size']}; "
        f"seeds {config['seeds']} (mean ± 95 % Student-t interval).",
        "",
        *headline_table(study),
        "All metrics, ranked by Pearson r:",
        "",
        f"| rank | similarity | Pearson r with true PMI ↑ | r − {best} (paired) | InfoNCE gap to Bayes ↓ "
        f"| gap − {best} (paired) | RMSE (nats) ↓ |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in study["summary"]:
        lines.append(
            f"| {row['rank']} | {row['label']} | {_cell(row['pearson'], row['pearson_ci95'])} | "
            f"{_cell(row['pearson_vs_best'], row['pearson_vs_best_ci95'])} | "
            f"{_cell(row['infonce_gap'], row['infonce_gap_ci95'])} | "
            f"{_cell(row['infonce_gap_vs_best'], row['infonce_gap_vs_best_ci95'])} | "
            f"{_cell(row['rmse'], row['rmse_ci95'])} |"
        )
    lines.append("")
    return "\n".join(lines)


def write_study(study: dict[str, Any], out_dir: Path) -> None:
    """pmi_study.json, pmi_study.md and pmi_study.png (r and gap with 95 % error bars)."""
    from clipkit.artifacts.io import atomic_path, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "pmi_study.json", json.dumps(study, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "pmi_study.md", study_table(study))
    with atomic_path(out_dir / "pmi_study.png") as temporary:
        _plot(study, temporary)


def _plot(study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = study["summary"]
    labels = [row["label"] for row in rows]
    figure, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(rows) + 2))
    for axis, (key, title) in zip(
        axes,
        (("pearson", "Pearson r with the true PMI ↑"), ("infonce_gap", "InfoNCE gap to Bayes ↓")),
        strict=True,
    ):
        means = [row[key] for row in rows]
        errors = [0.0 if math.isnan(row[f"{key}_ci95"]) else row[f"{key}_ci95"] for row in rows]
        axis.barh(range(len(rows)), means, xerr=errors, capsize=4, color="tab:blue", alpha=0.7)
        for position, run_values in enumerate(
            [
                [{r["label"]: r for r in run["results"]}[label][key] for run in study["runs"]]
                for label in labels
            ]
        ):
            axis.scatter(run_values, [position] * len(run_values), color="black", s=8, zorder=3)
        axis.set_yticks(range(len(rows)), labels)
        axis.invert_yaxis()
        axis.set_title(f"{title}\n(mean, 95 % interval, dots: seeds)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
