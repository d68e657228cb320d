"""What ``clipkit eval TARGET ...`` evaluates: an export, a run directory, or ``latest``.

README's own-data commands name runs by a glob (``runs/clip-tiny-*/export``); once there are two
runs the glob gives two paths, so ``clipkit eval`` takes any number of targets and evaluates each.
A target is an export directory (or any layout a reader converts), a run directory (its
``export/`` is evaluated) or ``latest``: the run under ``runs/`` whose export was written last.
"""

from __future__ import annotations

import os
from pathlib import Path

from clipkit.errors import ClipkitError

LATEST = "latest"
#: Where ``clipkit train`` puts runs by default (``runs/<recipe>-<time>``).
RUNS_DIR = Path("runs")
EXPORT_METADATA = "clipkit.json"


def run_export(path: Path) -> Path | None:
    """A run directory's export (``RUN/export`` holding clipkit.json), or None."""
    export = Path(path) / "export"
    return export if (export / EXPORT_METADATA).is_file() else None


def latest_export(runs: Path | None = None) -> Path:
    """The export of the run under ``runs`` (default ``$CLIPKIT_RUNS_DIR`` or ``runs/``) written
    last; an error naming the folder when none has one."""
    runs = Path(runs or os.environ.get("CLIPKIT_RUNS_DIR") or RUNS_DIR)
    exports = [e for e in (run_export(p) for p in sorted(runs.glob("*")) if p.is_dir()) if e is not None]
    if not exports:
        raise ClipkitError(
            f"latest: no run in {runs}/ has an export (clipkit train writes {runs}/<recipe>-<time>/export); "
            "name the run or export directory instead"
        )
    return max(exports, key=lambda e: ((e / EXPORT_METADATA).stat().st_mtime_ns, str(e)))


def resolve_target(target: str | Path) -> Path:
    """The export to evaluate for one ``clipkit eval`` argument."""
    if str(target) == LATEST and not Path(target).exists():
        return latest_export()
    path = Path(target)
    if path.is_dir() and not (path / EXPORT_METADATA).is_file():
        export = run_export(path)
        if export is not None:
            return export
    return path


def resolve_targets(targets: list[str], output: Path | None) -> list[Path]:
    """The exports to evaluate, each once and in order; ``--output`` names one report, so it takes
    one target."""
    exports = {}
    for target in targets:
        export = resolve_target(target)
        exports.setdefault(export.resolve(), export)  # a run named twice (two spellings) runs once
    exports = list(exports.values())
    if output is not None and len(exports) > 1:
        raise ClipkitError(
            f"--output names one report but {len(exports)} exports were given; drop --output (each "
            "export gets its own report) or name one export"
        )
    return exports
