"""Eval and run reports: JSON, a Markdown table and PNG plots (matplotlib, Agg backend).

``write_eval_report`` turns the dict ``clipkit eval`` returns into ``NAME.json``, ``NAME.md``
and, when there is something to draw, ``NAME-accuracy.png`` (per-dataset bars of zero-shot
and linear-probe top-1, with ± std over random-feature seeds and the chance level) and
``NAME-recall.png`` (retrieval recall curves). ``plot_loss_curves`` draws a run's
``metrics.jsonl`` (several runs overlaid to compare methods). Every file is written
atomically. Plot files hold no timestamps, so re-running a report rewrites the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clipkit.artifacts.io import atomic_path, atomic_write_text
from clipkit.errors import ClipkitError

#: Result keys that describe a task rather than measure it (never printed as metrics).
DESCRIPTIVE = {"name", "data", "label", "dataset", "chance", "chance_recall", "baselines"}

#: The classification metrics averaged across datasets in a report's summary.
ACCURACY_KEYS = ("top1", "top5", "mean_per_class_recall")


def summarize(results: Sequence[dict]) -> dict[str, Any]:
    """Averages across datasets: zero-shot and linear-probe top-1 (top-5 and mean per-class recall
    where all have them).

    The mean is over tasks (datasets / label sets), unweighted, as CLIP and the papers average.
    """
    summary: dict[str, Any] = {}
    for task in ("zero_shot", "linear_probe"):
        rows = [r for r in results if r.get("name") == task and "top1" in r]
        if not rows:
            continue
        summary[f"{task}_datasets"] = len(rows)
        for key in ACCURACY_KEYS:
            if all(key in r for r in rows):
                summary[f"{task}_{key}_mean"] = sum(r[key] for r in rows) / len(rows)
    retrieval = [r for r in results if r.get("name") == "retrieval" and "mean_recall" in r]
    if retrieval:
        summary["retrieval_mean_recall"] = sum(r["mean_recall"] for r in retrieval) / len(retrieval)
    return summary


def short_data_name(data: str) -> str:
    """A data URI's name in reports: its file (or folder) with the folder holding it, and its split.

    ``/x/coco/captions.jsonl`` -> ``coco/captions.jsonl`` (two tables in one folder differ),
    ``classes:/x/cifar10/test/`` -> ``cifar10/test``, ``synthetic://shapes?split=heldout&n=8`` ->
    ``shapes[heldout]``, ``holdout:/x/data/pets-1a2b?fraction=0.05`` -> ``data/pets-1a2b[held-out 5%]``.
    """
    from urllib.parse import parse_qsl

    if data.startswith("holdout:"):
        inner, _, query = data[len("holdout:") :].rpartition("?")
        params = dict(parse_qsl(query))
        try:
            share = f"{float(params.get('fraction', 0)) * 100:g}%"
        except ValueError:
            share = params.get("fraction", "?")
        part = "held-out" if params.get("part", "holdout") == "holdout" else "not held-out"
        return f"{short_data_name(inner)}[{part} {share}]"
    path_text, _, query = data.partition("?")
    split = dict(parse_qsl(query)).get("split")
    if "://" in path_text:
        path_text = path_text.split("://", 1)[1]
    elif ":" in path_text:
        path_text = path_text.split(":", 1)[1]
    parts = [part for part in Path(path_text.rstrip("/")).parts if part not in ("/", ".", "..")]
    name = "/".join(parts[-2:]) or data
    return f"{name}[{split}]" if split else name


def task_label(result: dict) -> str:
    """A short name for one result row: task, data (file and split; with the standard ``dataset``
    named first when there is one), and label."""
    from clipkit.eval.clip_benchmark import wds_dataset

    # CLIP_benchmark's wds layout: its dataset name, so clipkit's rows meet its published ones
    where = wds_dataset(result.get("data")) or short_data_name(str(result.get("data", "")))
    dataset = result.get("dataset")
    if dataset:
        where = dataset if not result.get("data") else f"{dataset} {where}"
    label = f":{result['label']}" if result.get("label") not in (None, "label") else ""
    return f"{result.get('name', '?')} {where}{label}".strip()


def number(value: float) -> str:
    """4 decimals, 4 significant digits below 0.01 (a chance of 1/819 is 0.001221), 3 for values
    too small or large for that (λ = 1e-7): :func:`clipkit.eval.metrics.fixed`."""
    from clipkit.eval.metrics import fixed

    return fixed(value)


def format_value(result: dict, key: str) -> str:
    """A metric's value (± std) with its baselines and, for top-1 and mean per-class recall, its
    ratio to the stronger baseline, named: ``0.2010 (0.93× majority class; uniform chance 0.0625,
    majority class 0.2170 ('cat'))``. A result without ``baselines`` (older reports) keeps the old
    ``× chance`` against its uniform ``chance``."""
    from clipkit.eval.metrics import baseline_note, ratio_note

    value = result[key]
    std = result.get(f"{key}_std")
    text = number(value) + (f" ± {number(std)}" if isinstance(std, float) else "")
    if isinstance(result.get("baselines"), dict):
        notes = [note for note in (ratio_note(result, key), baseline_note(result, key)) if note]
        return text + (f" ({'; '.join(notes)})" if notes else "")
    if key == "top1" and result.get("chance"):
        from clipkit.eval.metrics import ratio_text

        text += f" ({ratio_text(value / result['chance'])}× uniform chance)"
    recall_chance = (result.get("chance_recall") or {}).get(key)  # retrieval: per-K chance, this gallery
    if isinstance(recall_chance, float):
        from clipkit.eval.metrics import ratio_text

        ratio = f"{ratio_text(value / recall_chance)}× " if recall_chance > 0 else ""
        text += f" ({ratio}chance {number(recall_chance)})"
    return text


def metric_rows(result: dict) -> list[tuple[str, str]]:
    """(metric, formatted value) for every float metric of a result (std folded into its mean)."""
    return [
        (key, format_value(result, key))
        for key, value in result.items()
        if isinstance(value, float) and key not in DESCRIPTIVE and not key.endswith("_std")
    ]


def markdown_table(report: dict) -> str:
    """The report as Markdown: one row per (task, metric), then the cross-dataset averages."""
    lines = [f"# Evaluation of `{report.get('export', '?')}`", ""]
    lines += [f"**Note:** {note}\n" for note in report.get("notes") or []]
    lines += ["| task | metric | value |", "| --- | --- | --- |"]
    for result in report.get("results", []):
        name = task_label(result)
        if result.get("failed"):
            lines.append(f"| {name} | **failed** | {result['failed']} |")
        for key in ("missing", "not_run"):  # a suite's task with no data here, or none clipkit runs
            if result.get(key):
                lines.append(f"| {name} | {key.replace('_', ' ')} | {result[key]} |")
        for metric, value in metric_rows(result):
            lines.append(f"| {name} | {metric} | {value} |")
            name = ""
        from clipkit.eval.evaluate import result_warnings

        for warning in result_warnings(result):
            lines.append(f"| {name} | *warning* | {warning} |")
    summary = report.get("summary") or {}
    if summary:
        lines += ["", "| average | value |", "| --- | --- |"]
        lines += [
            f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
            for key, value in summary.items()
        ]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as error:  # a core dependency; only a broken install lacks it
        raise ClipkitError("plots need matplotlib: pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> Path:
    """Write a PNG atomically, without a timestamp in its metadata, and close the figure."""
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=120, bbox_inches="tight", metadata={"Software": None})
    pyplot().close(figure)
    return path


def plot_accuracy_bars(results: Sequence[dict], path: Path) -> Path | None:
    """Per-dataset top-1 bars (± std, chance marked) of zero-shot and linear-probe results."""
    rows = [r for r in results if r.get("name") in ("zero_shot", "linear_probe") and "top1" in r]
    if not rows:
        return None
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 3.6))
    positions = list(range(len(rows)))
    errors = [r.get("top1_std", 0.0) for r in rows]
    colours = ["tab:blue" if r["name"] == "zero_shot" else "tab:green" for r in rows]
    axes.bar(positions, [r["top1"] for r in rows], yerr=errors, color=colours, capsize=3)
    for x, row in zip(positions, rows, strict=True):
        if row.get("chance"):
            axes.hlines(row["chance"], x - 0.4, x + 0.4, colors="black", linestyles="dashed", linewidth=1)
        majority = ((row.get("baselines") or {}).get("majority") or {}).get("top1")
        if isinstance(majority, float):
            axes.hlines(majority, x - 0.4, x + 0.4, colors="red", linestyles="dotted", linewidth=1)
    axes.set_xticks(positions, [task_label(r) for r in rows], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("top-1 accuracy")
    axes.set_ylim(0, 1)
    axes.set_title(
        "top-1 per dataset (dashed: uniform chance, dotted red: majority class; "
        "blue zero-shot, green linear probe)",
        fontsize=8,
    )
    return save_figure(figure, path)


def plot_recall_curves(results: Sequence[dict], path: Path) -> Path | None:
    """Recall@K against K for both directions of every retrieval result (dotted grey: chance)."""
    rows = [r for r in results if r.get("name") == "retrieval" and r.get("curves")]
    if not rows:
        return None
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(5.5, 3.6))
    for row in rows:
        curves = row["curves"]
        for direction, style in (("i2t", "-"), ("t2i", "--")):
            axes.plot(curves["k"], curves[direction], style, label=f"{task_label(row)} {direction}")
            if curves.get(f"chance_{direction}"):  # retrieval's chance for this gallery, per K
                axes.plot(curves["k"], curves[f"chance_{direction}"], ":", color="grey", linewidth=1)
    if any(row["curves"].get("chance_i2t") for row in rows):
        axes.set_title("Recall@K (dotted grey: chance for the gallery)", fontsize=9)
    axes.set_xscale("log")
    mark_k_ticks(axes, max(max(row["curves"]["k"]) for row in rows))
    axes.set_xlabel("K")
    axes.set_ylabel("Recall@K")
    axes.set_ylim(0, 1)
    axes.legend(fontsize=7)
    return save_figure(figure, path)


def k_ticks(k_max: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``k_max``: the K of a Recall@K axis, labelled as the integers
    they are."""
    ticks, decade = [], 1
    while decade <= k_max:
        ticks += [step * decade for step in (1, 2, 5) if step * decade <= k_max]
        decade *= 10
    return ticks


def mark_k_ticks(axes, k_max: int) -> None:
    """Integer K ticks on a log axis, without minor ticks: they read as "Recall@5" does, where
    matplotlib's defaults write powers of ten and draw a minor tick at every integer (laying out
    those was much of the figure's drawing time)."""
    from matplotlib.ticker import NullLocator

    ticks = k_ticks(k_max)
    axes.set_xticks(ticks, [str(k) for k in ticks])
    axes.xaxis.set_minor_locator(NullLocator())


def write_eval_report(report: dict, json_path: Path, *, plots: bool = True) -> list[Path]:
    """Write ``json_path`` (the report with its summary), the .md beside it, a CLIP_benchmark result
    file per zero-shot / linear-probe / retrieval result (:mod:`clipkit.eval.clip_benchmark`), and
    the PNGs."""
    json_path = Path(json_path)
    report = {**report, "summary": summarize(report.get("results", []))}
    atomic_write_text(json_path, json.dumps(report, indent=2, default=_jsonable) + "\n")
    markdown = json_path.with_suffix(".md")
    atomic_write_text(markdown, markdown_table(report))
    written = [json_path, markdown]
    from clipkit.eval.clip_benchmark import write_results

    written += write_results(report, json_path, short_data_name)  # CLIP_benchmark's schema, one per task
    if plots:
        stem = json_path.with_suffix("")
        results = report.get("results", [])
        for plot, suffix in ((plot_accuracy_bars, "accuracy"), (plot_recall_curves, "recall")):
            path = plot(results, Path(f"{stem}-{suffix}.png"))
            if path is not None:
                written.append(path)
    return written


def _jsonable(value) -> str:
    """Anything json cannot write (a Path, a numpy scalar) is written as its text."""
    return str(value)


def read_metrics(path: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``; a torn last line (from a crash) is ignored."""
    from clipkit.artifacts.files import read_text

    lines = [line for line in read_text(Path(path), "metrics log").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as error:
            if number == len(lines):
                break
            raise ClipkitError(f"{path}:{number}: not a JSON line ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            raise ClipkitError(f"{path}:{number}: not a metrics record (an object with an integer `step`)")
        records.append(record)
    return records


def plot_loss_curves(runs: dict[str, Path], path: Path, metrics: Sequence[str] = ("loss",)) -> Path:
    """Overlay ``metrics`` against step for several runs: ``runs`` maps a label to a run directory."""
    plt = pyplot()
    figure, all_axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.4), squeeze=False)
    for axes, metric in zip(all_axes[0], metrics, strict=True):
        for label, run_dir in runs.items():
            file = Path(run_dir) / "metrics.jsonl"
            if not file.is_file():
                raise ClipkitError(f"{run_dir}: no metrics.jsonl (is it a clipkit run directory?)")
            points = [
                (r["step"], r[metric])
                for r in read_metrics(file)
                if isinstance(r.get(metric), float) and isinstance(r.get("step"), int)
            ]
            if points:
                steps, values = zip(*points, strict=True)
                axes.plot(steps, values, label=label)
        axes.set_xlabel("step")
        axes.set_ylabel(metric)
        axes.legend(fontsize=7)
    return save_figure(figure, Path(path))


#: The step telemetry of metrics.jsonl (clipkit.train.telemetry) that ``clipkit report`` plots.
TELEMETRY_METRICS = (
    "samples_per_s_per_device",
    "mfu",
    "model_tflops_per_s_per_device",
    "data_wait_share",
    "forward_ms",
    "backward_ms",
    "forward_backward_ms",
    "optimizer_ms",
    "gpu_peak_gib",
    "cpu_peak_rss_gib",
)


def telemetry_metrics(runs: dict[str, Path]) -> list[str]:
    """The telemetry fields any of ``runs`` logged, in :data:`TELEMETRY_METRICS` order."""
    logged = logged_metrics(runs)
    return [metric for metric in TELEMETRY_METRICS if metric in logged]


def logged_metrics(runs: dict[str, Path], *, numbers_only: bool = False) -> set[str]:
    """Every field any of ``runs`` logged in its metrics.jsonl (``numbers_only``: those logged as
    a float at least once, what a curve can plot)."""
    logged: set[str] = set()
    for run_dir in runs.values():
        file = Path(run_dir) / "metrics.jsonl"
        if file.is_file():
            logged.update(
                key
                for record in read_metrics(file)
                for key, value in record.items()
                if not numbers_only or isinstance(value, float)
            )
    return logged


def check_metrics_logged(runs: dict[str, Path], metrics: Sequence[str]) -> None:
    """ClipkitError naming each of ``metrics`` (asked for with ``clipkit report --metric``) that no
    run logged as a number, and what they did log (an empty plot otherwise)."""
    plotted = logged_metrics(runs, numbers_only=True)
    unknown = [metric for metric in metrics if metric not in plotted]
    if unknown:
        raise ClipkitError(
            f"no run logged {', '.join(map(repr, unknown))} as a number against step; they logged: "
            f"{', '.join(sorted(plotted)) or 'nothing'}"
        )


def comparison_rows(reports: dict[str, dict]) -> list[tuple[str, str, dict[str, str]]]:
    """(task, metric, {run label: formatted value}) for every metric any run reports."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for label, report in reports.items():
        for result in report.get("results", []):
            for metric, value in metric_rows(result):
                rows.setdefault((task_label(result), metric), {})[label] = value
        for key, value in (report.get("summary") or {}).items():
            if isinstance(value, float):
                rows.setdefault(("average", key), {})[label] = f"{value:.4f}"
    return [(task, metric, values) for (task, metric), values in rows.items()]


def write_comparison(reports: dict[str, dict], json_path: Path) -> list[Path]:
    """Several runs' eval reports side by side: JSON, a Markdown table (one column per run), and
    grouped top-1 bars."""
    json_path = Path(json_path)
    labels = list(reports)
    atomic_write_text(json_path, json.dumps({"runs": reports}, indent=2, default=_jsonable) + "\n")
    lines = ["| task | metric | " + " | ".join(labels) + " |", "|" + " --- |" * (len(labels) + 2)]
    for task, metric, values in comparison_rows(reports):
        lines.append(
            f"| {task} | {metric} | " + " | ".join(values.get(label, "–") for label in labels) + " |"
        )
    markdown = json_path.with_suffix(".md")
    atomic_write_text(markdown, "\n".join(lines) + "\n")
    written = [json_path, markdown]
    bars = plot_grouped_accuracy(reports, Path(f"{json_path.with_suffix('')}-accuracy.png"))
    return written + ([bars] if bars else [])


def plot_grouped_accuracy(reports: dict[str, dict], path: Path) -> Path | None:
    """Top-1 per dataset, one bar per run in each group (± std over feature seeds)."""
    tasks: dict[str, dict[str, tuple[float, float]]] = {}
    for label, report in reports.items():
        for result in report.get("results", []):
            if result.get("name") in ("zero_shot", "linear_probe") and "top1" in result:
                tasks.setdefault(task_label(result), {})[label] = (
                    result["top1"],
                    result.get("top1_std", 0.0),
                )
    if not tasks:
        return None
    plt = pyplot()
    width = 0.8 / len(reports)
    figure, axes = plt.subplots(figsize=(max(4.0, 1.2 * len(tasks) + 2), 3.6))
    for i, label in enumerate(reports):
        xs = [t + i * width for t in range(len(tasks))]
        values = [tasks[task].get(label, (0.0, 0.0)) for task in tasks]
        axes.bar(xs, [v for v, _ in values], width, yerr=[e for _, e in values], label=label, capsize=2)
    axes.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], list(tasks), rotation=30, ha="right")
    axes.set_ylabel("top-1 accuracy")
    axes.set_ylim(0, 1)
    axes.legend(fontsize=7)
    return save_figure(figure, path)
