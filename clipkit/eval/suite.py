"""Benchmark suites whose data is the user's: run the tasks whose data is here, list the others.

A tasks file (``clipkit eval --tasks FILE``) may be a mapping with ``eval:`` (the task list) and:

- ``root:`` a folder the tasks' data URIs interpolate (``data: "wds:${root}/wds_cifar10"``);
  ``clipkit eval --tasks FILE --data ROOT`` sets it;
- ``missing: skip`` — a task whose local data path does not exist is not run but listed in the
  report as ``missing`` (DataComp's 38 tasks: few users hold all of them), instead of refusing the
  whole suite;

and each task an ``about:`` mapping (its title and the benchmark's main metric; ``unsupported:``
says why clipkit cannot run it) that is carried into its result, never passed to the task.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: The task key holding what a suite says about a task (not a task argument).
ABOUT = "about"


def task_arguments(config: Any) -> Any:
    """A task's configuration without the suite's ``about`` entry (what its factory gets)."""
    if not isinstance(config, dict):
        return config
    return {key: value for key, value in config.items() if key != ABOUT}


def local_data_path(data: Any) -> Path | None:
    """The local path a data URI names (``wds:P``, ``classes:P``, ``idx:P``, ``P?query``), or None
    for a URI with a ``://`` scheme (synthetic data, remote sets) or no string."""
    if not isinstance(data, str) or "://" in data:
        return None
    path = data.partition("?")[0]
    scheme = re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", path)
    return Path(path[scheme.end() :] if scheme else path)


def split_suite(tasks: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the tasks to run, result rows of those that cannot run): ``missing`` where the local data
    path does not exist, ``not_run`` where the suite marks the task ``unsupported``."""
    runnable, skipped = [], []
    for task in tasks:
        about = task.get(ABOUT) or {}
        described = {key: task[key] for key in ("name", "data", ABOUT) if key in task}
        path = local_data_path(task.get("data"))
        if path is not None and not path.exists():
            skipped.append({**described, "missing": f"no data at {path}"})
        elif about.get("unsupported"):
            skipped.append({**described, "not_run": str(about["unsupported"])})
        else:
            runnable.append(task)
    return runnable, skipped


def skipped_summary(results: list[dict], total: int) -> str | None:
    """``37 of the 38 tasks have no data under ROOT (wds_cars, ...)`` for a suite's missing tasks."""
    missing = [r for r in results if r.get("missing")]
    if not missing:
        return None
    folders = sorted(
        {str(Path(str(local_data_path(r.get("data")) or r.get("data"))).parent) for r in missing}
    )
    names = ", ".join(Path(str(local_data_path(r.get("data")) or r.get("data"))).name for r in missing[:8])
    more = f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
    return f"{len(missing)} of the {total} tasks have no data under {', '.join(folders)}: {names}{more}"
