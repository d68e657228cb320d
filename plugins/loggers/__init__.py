"""Built-in metrics logger: one JSON object per line in ``RUN/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from clipkit.artifacts.io import DiskFullError, writing
from clipkit.contract.hookspecs import hookimpl


@hookimpl
def on_run_start(run, recipe, start_step):
    """A resumed run logs its steps after ``start_step`` again: the lines a run killed after its last
    checkpoint had written for them go (atomically), so the log holds each step once."""
    path = Path(run.directory) / "metrics.jsonl"
    if not run.is_main or not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if not logged_after(line, start_step)]
    if kept and not is_record(kept[-1]):
        kept.pop()  # a line torn by a crash: appended to, it would sit mid-file
    if len(kept) != len(lines):
        from clipkit.artifacts.io import atomic_write_text

        atomic_write_text(path, "".join(kept))


def is_record(line: str) -> bool:
    try:
        return line.endswith("\n") and isinstance(json.loads(line), dict)
    except ValueError:
        return False


def logged_after(line: str, step: int) -> bool:
    """Whether ``line`` is a record of a step after ``step`` (a torn or foreign line is kept: the
    report names it)."""
    try:
        logged = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return False
    return isinstance(logged, int) and not isinstance(logged, bool) and logged > step


@hookimpl
def on_metrics(step, metrics, run):
    if not run.is_main:
        return
    record = {"step": step, **metrics}
    path = Path(run.directory) / "metrics.jsonl"
    line = json.dumps(record, sort_keys=True) + "\n"
    size = path.stat().st_size if path.is_file() else 0
    # Appending one line per call keeps a crash from losing earlier metrics.
    try:
        guard = writing(path, needed=len(line.encode("utf-8")), kept="its earlier lines are kept")
        with guard, path.open("a", encoding="utf-8") as out:
            out.write(line)
    except DiskFullError:
        with open(path, "r+b") as stream:  # no torn line for a resumed run to append to
            stream.truncate(size)
        raise
