"""Built-in metrics logger: one JSON object per line in ``RUN/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from clipkit.artifacts.io import DiskFullError, writing
from clipkit.contract.hookspecs import hookimpl


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
