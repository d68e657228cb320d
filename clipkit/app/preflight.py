"""Checks that need only the data, run before a training run starts (``clipkit train --data``).

Training can take hours; finding after it that ``--label`` names no column of the data, or that an
``--eval-data`` location cannot be read, loses the evaluation the run was for. Each of the run's
own-data eval tasks (:mod:`clipkit.app.own_data`) is therefore opened now and its first sample read:
the location must be reachable and, for zero-shot, the label must be one of the sample's columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clipkit.errors import ClipkitError, DataError

HOLDOUT_SCHEME = "holdout:"


def check_eval_data(tasks: list[dict[str, Any]], recipe: dict, registry) -> None:
    """A DataError naming the task, the data and the problem for the first eval task whose data
    cannot be opened, holds no sample, or lacks the task's ``label`` column."""
    checked: dict[str, list[str]] = {}
    for task in tasks:
        data = task.get("data")
        if not isinstance(data, str) or not data:
            continue
        location = readable_location(data, recipe)
        if location is None:
            continue
        if location not in checked:
            checked[location] = first_sample_columns(location, task, registry)
        label = task.get("label")
        if label and label not in checked[location]:
            raise DataError(
                f"eval task {task.get('name')} on {data}: the label column {label!r} is not in the data "
                f"(its columns: {', '.join(checked[location]) or 'none'}); checked before training"
            )


def readable_location(data: str, recipe: dict) -> str | None:
    """What to open to check ``data`` now: itself, or for the held-out split of the training shards
    (``holdout:SHARDS?fraction=F``) those shards when they exist, else the source they are made
    from; None when neither exists yet."""
    if not data.startswith(HOLDOUT_SCHEME):
        return data
    shards = data[len(HOLDOUT_SCHEME) :].rpartition("?")[0]
    if (Path(shards) / "manifest.json").is_file():
        return shards
    source = (recipe.get("data") or {}).get("source")
    return source or None


def first_sample_columns(data: str, task: dict, registry) -> list[str]:
    """The meta-data columns of the first sample of ``data`` (opening and reading it)."""
    from clipkit.data.shard import open_source

    try:
        source = open_source(data, pm=registry.pm)
        sample = next(iter(source), None)
    except ClipkitError as error:
        raise DataError(
            f"eval task {task.get('name')}: cannot read {data} ({error}); checked before training"
        ) from None
    if sample is None:
        raise DataError(f"eval task {task.get('name')}: {data} holds no sample; checked before training")
    return sorted(key for key in sample.meta if key != "index")
