"""Eval reports that never overwrite each other, and the index of them kept beside an export.

``clipkit eval EXPORT`` with no ``--output`` writes ``EXPORT/eval-<task>-<data>-<label>-<time>.json``
(for a ``.safetensors`` file: in ``FILE-eval/``), taking ``-2``, ``-3``, ... when that name is
taken. The name is *claimed* by creating the file exclusively (``O_EXCL``), so two evaluations
started in the same second — in two processes — never get one name; an evaluation that fails
removes its claim. Every report written for an export (wherever ``--output`` put it) is listed in
``EXPORT/eval-index.json``: its path, when it was written, its tasks, summary and the sha256 of the
weights it scored — and ``clipkit report`` takes the newest listed report of a directory that has
no ``eval.json`` of its own.

The index is read and rewritten under an exclusive lock (``eval-index.lock``, ``fcntl.flock``), so
concurrent evaluations each add their entry. A damaged index (not UTF-8, not JSON, entries of the
wrong type) is never fatal: it is moved aside (``eval-index.damaged-<time>.json``, named in a
warning) and rebuilt from the reports present. A report is indexed only with the weights it scored:
an export replaced while it was evaluated (a ``train --resume`` re-export) is not given the old
weights' numbers (:func:`check_same_weights`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from clipkit.artifacts.files import read_json
from clipkit.artifacts.io import atomic_write_text
from clipkit.errors import ArtifactError, ClipkitError

INDEX_NAME = "eval-index.json"
LOCK_NAME = "eval-index.lock"
#: Longest task-and-data part of a default report name (file systems allow 255 bytes; keep it readable).
MAX_SLUG = 80
log = logging.getLogger("clipkit.eval")


def report_home(source: Path) -> Path:
    """The directory an export's reports and index go to: the export directory itself; for a
    ``.safetensors`` file, ``FILE-eval/`` beside it (a run-like directory ``clipkit report`` reads)."""
    source = Path(source)
    return source.with_name(f"{source.stem}-eval") if source.is_file() else source


def report_slug(tasks: list[dict] | None) -> str:
    """``zero_shot-cifar10-test-category`` from the tasks' names, data and labels; ``recipe`` for
    the recipe's own tasks. Two evaluations of one data on different labels get different names."""
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
        if task.get("label"):
            parts.append(str(task["label"]))
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", "-".join(parts)).strip("-.")
    return slug[:MAX_SLUG].rstrip("-.") or "eval"


def next_report_path(source: Path, tasks: list[dict] | None, now: float | None = None) -> Path:
    """Claim a report path under :func:`report_home` that no report holds:
    ``eval-<slug>-<YYYYmmdd-HHMMSS>.json``, with ``-2``, ``-3``, ... when taken. The (empty) file
    is created exclusively, so no other process gets the same name; :func:`release_claim` removes
    it when no report is written."""
    home = report_home(source)
    home.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    stem = f"eval-{report_slug(tasks)}-{stamp}"
    for count in range(1, 100_000):
        path = home / (f"{stem}.json" if count == 1 else f"{stem}-{count}.json")
        if path.with_suffix(".md").exists():
            continue
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        return path
    raise ClipkitError(f"{home}: no free report name for {stem}; pass --output")


#: An eval report is a few kilobytes (a big suite's, a few megabytes); a larger file is not one.
MAX_REPORT_BYTES = 64 * 2**20


def check_report_target(path: Path) -> None:
    """ClipkitError unless an eval report may be written at ``path``: absent, empty (a name claimed
    for a report) or an earlier clipkit eval report; never a file of another kind (the weights or
    clipkit.json of the export being evaluated, a run's recipe.yaml or metrics.jsonl, a user's
    notes), and never over a Markdown file beside it (``.md``) that is not an earlier report's table.
    Checked before any work."""
    path = Path(path)
    if path.suffix.lower() == ".md":
        raise ClipkitError(f"eval report {path}: name a .json file (its Markdown table is written beside it)")
    earlier = is_eval_report_file(path)
    if path.is_file() and path.stat().st_size > 0 and not earlier:
        raise ClipkitError(
            f"eval report {path}: the file exists and is not a clipkit eval report; it is never "
            "replaced — pick another path (a new .json name)"
        )
    markdown = path.with_suffix(".md")
    if (markdown.exists() or markdown.is_symlink()) and not earlier:
        raise ClipkitError(
            f"eval report {path}: {markdown} exists and is not the table of an earlier report at {path}; "
            "it is never replaced — pick another path"
        )


def is_eval_report_file(path: Path) -> bool:
    """Whether ``path`` is a JSON object with a ``results`` list (a clipkit eval report), read only
    when it is small and starts like one (never a weights file read whole)."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_REPORT_BYTES:
            return False
        with open(path, "rb") as file:
            if file.read(64).lstrip()[:1] != b"{":
                return False
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and isinstance(report.get("results"), list)


def release_claim(path: Path) -> None:
    """Remove a claimed report path that no report was written to (still empty)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()
        if path.parent.name.endswith("-eval"):  # FILE-eval/ made for this claim: removed when empty
            path.parent.rmdir()


@contextlib.contextmanager
def index_lock(home: Path) -> Iterator[None]:
    """Hold the index of ``home`` exclusively (other evaluations wait). A folder clipkit cannot
    write in (a read-only baseline) gets no lock: its index cannot be written either."""
    import fcntl

    try:
        handle = os.open(Path(home) / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing releases the lock


def weights_sha256(source: Path) -> str | None:
    """The sha256 of the weights at ``source``: a clipkit export's recorded checksum of
    ``model.safetensors`` (checked when it loads), else the hash of the weights file(s) — a
    ``.safetensors`` file, or those in an open_clip / Hugging Face directory. None when there are none."""
    import hashlib

    from clipkit.artifacts.integrity import sha256_file

    source = Path(source)
    if source.is_file():
        return sha256_file(source)
    metadata = source / "clipkit.json"
    if metadata.is_file():
        with contextlib.suppress(ClipkitError):
            recorded = read_json(metadata, "the export's metadata", expect=dict).get("files") or {}
            entry = recorded.get("model.safetensors") if isinstance(recorded, dict) else None
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
                return entry["sha256"]
    files = sorted(source.glob("*.safetensors")) if source.is_dir() else []
    if not files:
        return None
    if len(files) == 1:
        return sha256_file(files[0])
    combined = hashlib.sha256("".join(f"{f.name}:{sha256_file(f)};" for f in files).encode())
    return combined.hexdigest()


def check_same_weights(source: Path, scored: str | None, output: Path | None) -> None:
    """Refuse to file a report under an export whose weights changed while it was evaluated (a
    ``train --resume`` re-exported it): the numbers are of the weights ``scored``, not of these."""
    if scored is None:
        return
    now = weights_sha256(source)
    if now == scored:
        return
    where = "" if output is None else f"; the report {output} was not written"
    raise ClipkitError(
        f"{source} was replaced while it was evaluated (the weights scored have sha256 {scored[:16]}…, "
        f"the export now holds {str(now)[:16]}…): its scores are not filed with the new weights{where}; "
        "evaluate the new export again"
    )


def entry_problem(entry: object) -> str | None:
    """Why an index entry is unusable, or None."""
    if not isinstance(entry, dict):
        return f"an entry is a JSON {type(entry).__name__}, not an object"
    expected = {"report": str, "written": str, "tasks": list, "summary": dict}
    for key, kind in expected.items():
        if key in entry and not isinstance(entry[key], kind):
            return f"an entry's `{key}` is not a {kind.__name__}"
    if "report" not in entry:
        return "an entry has no `report`"
    return None


def load_index(home: Path) -> tuple[list[dict], str | None]:
    """(entries, problem): the entries of ``home``/eval-index.json, or ([], why it is damaged)."""
    path = Path(home) / INDEX_NAME
    if not path.exists():
        return [], None
    try:
        value = read_json(path, "the report index", expect=dict)
    except ArtifactError as error:
        return [], str(error).removeprefix(f"{path}: ")
    entries = value.get("reports")
    if not isinstance(entries, list):
        return [], "`reports` is not a list"
    problems = [problem for problem in map(entry_problem, entries) if problem]
    return (entries, None) if not problems else ([], problems[0])


def read_index(home: Path) -> list[dict]:
    """The entries of ``home``/eval-index.json (oldest first); [] when there is none. A damaged
    index is read as the reports present (see :func:`rebuilt_entries`), with a warning naming it."""
    entries, problem = load_index(home)
    if problem is None:
        return entries
    log.warning("%s is damaged (%s); reading the reports present instead", Path(home) / INDEX_NAME, problem)
    return rebuilt_entries(home)


def set_aside_damaged(home: Path, problem: str) -> Path:
    """Move a damaged index out of the way (kept for inspection) and say where, once."""
    index = Path(home) / INDEX_NAME
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = index.with_name(f"eval-index.damaged-{stamp}.json")
    count = 1
    while aside.exists():
        count += 1
        aside = index.with_name(f"eval-index.damaged-{stamp}-{count}.json")
    os.replace(index, aside)
    log.warning("%s was damaged (%s): moved to %s; the index is rebuilt from the reports present",
                index, problem, aside.name)  # fmt: skip
    return aside


def report_files(home: Path) -> list[Path]:
    """clipkit eval reports directly in ``home`` (not the index, damaged indexes or the
    CLIP_benchmark result files written beside each report)."""
    found = []
    for path in sorted(Path(home).glob("eval-*.json")):
        if path.name == INDEX_NAME or path.name.startswith("eval-index.") or "-clip_benchmark-" in path.name:
            continue
        found.append(path)
    return found


def entry_of(home: Path, report_path: Path, report: dict, written: float | None = None) -> dict:
    """The index entry of a report."""
    from clipkit.eval.report import task_label

    home = Path(home)
    report_path = Path(report_path).resolve()
    try:
        shown = str(report_path.relative_to(home.resolve()))
    except ValueError:
        shown = str(report_path)
    results = [r for r in report.get("results", []) if isinstance(r, dict)]
    entry = {
        "report": shown,
        "written": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if written is None else written)
        ),
        "tasks": [task_label(result) for result in results],
        "summary": report.get("summary") if isinstance(report.get("summary"), dict) else {},
    }
    if isinstance(report.get("weights_sha256"), str):
        entry["weights_sha256"] = report["weights_sha256"]
    return entry


def rebuilt_entries(home: Path, listed: set[str] = frozenset()) -> list[dict]:
    """Index entries of the reports in ``home`` not in ``listed`` (by their time on disk): what
    rebuilds a damaged index, and what adds reports an earlier index write missed (a full disk)."""
    entries = []
    for path in report_files(home):
        if path.name in listed:
            continue
        try:
            report = read_json(path, "eval report", expect=dict)
        except ArtifactError:
            continue  # an empty claim of a running evaluation, or a damaged report: not listed
        if not isinstance(report.get("results"), list):
            continue
        entries.append((path.stat().st_mtime, entry_of(home, path, report, path.stat().st_mtime)))
    return [entry for _, entry in sorted(entries, key=lambda item: item[0])]


def record_report(
    source: Path, report_path: Path, report: dict, now: float | None = None, *, locked: bool = False
) -> Path:
    """Add ``report_path`` to the index beside the export ``source``, under the index lock (taken
    here unless the caller holds it: ``locked``), written atomically; a report listed before at the
    same path is listed once, with its newest entry. A damaged index is set aside and rebuilt;
    reports present but missing from it are added."""
    home = report_home(source)
    index = home / INDEX_NAME
    with contextlib.nullcontext() if locked else index_lock(home):
        entries, problem = load_index(home)
        if problem is not None:
            set_aside_damaged(home, problem)
            entries = []
        entry = entry_of(home, report_path, report, now)
        listed = {str(e.get("report")) for e in entries} | {entry["report"]}
        entries = [e for e in entries if e.get("report") != entry["report"]]
        entries += rebuilt_entries(home, listed) + [entry]
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
    report = read_json(path, "eval report", "pass a report clipkit eval wrote, or move the file away")
    if is_benchmark_result(report):
        return read_as_report(path)
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise ArtifactError(f"{path}: neither a clipkit eval report nor a CLIP_benchmark result")
    check_report(report, path)
    return report


#: Result fields read as numbers when a report is shown or compared.
NUMERIC_FIELDS = ("top1", "top1_std", "top5", "mean_per_class_recall", "chance", "mean_recall")


def check_report(report: dict, path: Path) -> None:
    """An ArtifactError naming ``path`` unless every result row is one ``clipkit report`` can show:
    an object with a string ``name`` and numbers where numbers are read — checked by rendering it,
    so whatever the table reads is covered."""
    from clipkit.artifacts.files import require
    from clipkit.eval.report import metric_rows, task_label

    what = "eval report"
    for i, row in enumerate(report["results"]):
        require(row, f"results[{i}]", dict, path, what)
        require(row.get("name"), f"results[{i}].name", str, path, what)
        for key in NUMERIC_FIELDS:
            if row.get(key) is not None:
                require(row[key], f"results[{i}].{key}", (int, float), path, what)
        try:
            task_label(row), metric_rows(row)
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as error:
            raise ArtifactError(
                f"{path}: {what}: results[{i}] cannot be shown ({type(error).__name__}: {error}); "
                "it was edited or damaged"
            ) from None
    if report.get("summary") is not None:
        summary = require(report["summary"], "summary", dict, path, what)
        for key, value in summary.items():
            require(value, f"summary.{key}", (int, float), path, what)


def read_eval_reports(runs: dict[str, Path]) -> dict[str, dict]:
    """label -> the eval report (:func:`read_eval_report`) of each run that has one."""
    reports = {}
    for label, run in runs.items():
        report = read_eval_report(Path(run))
        if report is not None:
            reports[label] = report
    return reports
