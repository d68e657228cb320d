"""Built-in metrics logger: one JSON object per line in ``RUN/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from clipkit.hookspecs import hookimpl


@hookimpl
def on_metrics(step, metrics, run):
    if not run.is_main:
        return
    record = {"step": step, **metrics}
    path = Path(run.directory) / "metrics.jsonl"
    # Appending one line per call keeps a crash from losing earlier metrics.
    with path.open("a", encoding="utf-8") as stream:
        stream.write(json.dumps(record, sort_keys=True) + "\n")
