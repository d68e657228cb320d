"""Eval reports that never overwrite each other, and the index of them kept beside an export.

``clipkit eval EXPORT`` with no ``--output`` writes ``EXPORT/eval-<tasks>-<data>-<time>.json`` (for a
``.safetensors`` file: in ``FILE-eval/``), taking ``-2``, ``-3``, ... when that name is taken, so a
second evaluation of the same export keeps the first report. Every report written for an export
(wherever ``--output`` put it) is listed in ``EXPORT/eval-index.json``: its path, when it was
written, its tasks and summary — and ``clipkit report`` takes the newest listed report of a
directory that has no ``eval.json`` of its own.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from clipkit.artifacts.io import atomic_write_text
from clipkit.errors import ClipkitError

INDEX_NAME = "eval-index.json"
#: Longest task-and-data part of a default report name (file systems allow 255 bytes; keep it readable).
MAX_SLUG = 60


def report_home(source: Path) -> Path:
    """The directory an export's reports and index go to: the export directory itself; for a
    ``.safetensors`` file, ``FILE-eval/`` beside it (a run-like directory ``clipkit report`` reads)."""
    source = Path(source)
    return source.with_name(f"{source.stem}-eval") if source.is_file() else source


def report_slug(tasks: list[dict] | None) -> str:
    """``zero_shot-cifar10-test`` from the tasks' names and data; ``recipe`` for the recipe's own tasks."""
    if not tasks:
        return "recipe"
    from clipkit.eval.clip_benchmark import wds_dataset
    from clipkit.eval.report import short_data_name

    parts: list[str] = []
    for task in tasks:
        parts.append(str(task.get("name", "task")))
        data = task.get("dataset") or wds_dataset(task.get("data"))
        data = data or (short_data_name(str(task["data"])) if task.get("data") else "")
        if data:
            parts.append(str(data))
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", "-".join(parts)).strip("-.")
    return slug[:MAX_SLUG].rstrip("-.") or "eval"


def next_report_path(source: Path, tasks: list[dict] | None, now: float | None = None) -> Path:
    """A report path under :func:`report_home` that no report holds yet:
    ``eval-<slug>-<YYYYmmdd-HHMMSS>.json``, with ``-2``, ``-3``, ... when taken."""
    home = report_home(source)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    stem = f"eval-{report_slug(tasks)}-{stamp}"
    path, count = home / f"{stem}.json", 1
    while path.exists() or path.with_suffix(".md").exists():
        count += 1
        path = home / f"{stem}-{count}.json"
    return path


def read_index(home: Path) -> list[dict]:
    """The entries of ``home``/eval-index.json (oldest first); [] when there is none."""
    path = Path(home) / INDEX_NAME
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text(encoding="utf-8")).get("reports")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ClipkitError(
            f"{path}: not a clipkit report index ({error}); move it away to start a new one"
        ) from None
    if not isinstance(entries, list):
        raise ClipkitError(f"{path}: `reports` must be a list; move the file away to start a new index")
    return entries


def record_report(source: Path, report_path: Path, report: dict, now: float | None = None) -> Path:
    """Add ``report_path`` to the index beside the export ``source`` (written atomically); a report
    listed before at the same path is listed once, with its newest entry."""
    from clipkit.eval.report import task_label

    home = report_home(source)
    report_path = Path(report_path).resolve()
    try:
        shown = str(report_path.relative_to(home.resolve()))
    except ValueError:
        shown = str(report_path)
    entry = {
        "report": shown,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now)),
        "tasks": [task_label(result) for result in report.get("results", [])],
        "summary": report.get("summary") or {},
    }
    entries = [e for e in read_index(home) if e.get("report") != shown] + [entry]
    index = home / INDEX_NAME
    atomic_write_text(index, json.dumps({"reports": entries}, indent=2) + "\n")
    return index


def newest_report(home: Path) -> Path | None:
    """The newest report listed in ``home``'s index that still exists, or None."""
    for entry in reversed(read_index(home)):
        path = Path(entry.get("report", ""))
        path = path if path.is_absolute() else Path(home) / path
        if path.is_file():
            return path
    return None


def eval_report_path(run: Path) -> Path | None:
    """The eval report of a run or export directory: its ``eval.json`` (a training run's), else the
    newest report in its ``eval-index.json`` (``clipkit eval``'s); None when it has none."""
    run = Path(run)
    if (run / "eval.json").is_file():
        return run / "eval.json"
    return newest_report(run) if run.is_dir() else None


def read_eval_report(run: Path) -> dict | None:
    """The eval report of ``run``: a run or export directory's (:func:`eval_report_path`), a clipkit
    report file, or CLIP_benchmark result files (one, or a folder of them) read as a report
    (:func:`clipkit.eval.clip_benchmark.read_as_report`); None when it has none."""
    from clipkit.eval.clip_benchmark import is_benchmark_result, read_as_report

    run = Path(run)
    path = run if run.is_file() else eval_report_path(run)
    if path is None:
        return read_as_report(run)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ClipkitError(f"{path}: not valid JSON ({error})") from None
    if is_benchmark_result(report):
        return read_as_report(path)
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise ClipkitError(f"{path}: neither a clipkit eval report nor a CLIP_benchmark result")
    return report


def read_eval_reports(runs: dict[str, Path]) -> dict[str, dict]:
    """label -> the eval report (:func:`read_eval_report`) of each run that has one."""
    reports = {}
    for label, run in runs.items():
        report = read_eval_report(Path(run))
        if report is not None:
            reports[label] = report
    return reports
