"""Training checkpoints: everything needed to continue a run exactly.

``RUN/checkpoints/step-00000123.pt`` holds the model, optimizer, schedule, the loss's
per-sample state (if any), the data position and every RNG state. Files are written to a
temporary name and renamed, so a crash mid-write never corrupts the latest checkpoint;
only the newest ``keep`` are kept.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from clipkit.errors import ClipkitError
from clipkit.io import atomic_path

PATTERN = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Atomically write ``state`` for ``step`` and prune all but the newest ``keep`` files."""
    path = checkpoint_dir(run_dir) / f"step-{step:08d}.pt"
    with atomic_path(path) as temporary:
        torch.save({"step": step, **state}, temporary)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if PATTERN.match(p.name))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint this program wrote (it holds RNG states, hence weights_only=False)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ClipkitError(f"{path}: cannot read checkpoint ({error})") from error
