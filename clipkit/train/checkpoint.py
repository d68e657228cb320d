"""Training checkpoints: everything needed to continue a run exactly.

``RUN/checkpoints/step-00000123/`` holds

- ``state.pt`` (written by the main process): step, schedule, the loss's per-sample state
  (SogCLR/NUCLR: kept out of DeepSpeed's checkpoint on purpose, identical on every process), the
  data position, the fp16 loss scaler, the resolved recipe, the number of processes and — without
  DeepSpeed — the model and optimiser;
- ``rng-<rank>.pt``: every RNG state of each process;
- ``deepspeed/`` (DeepSpeed runs): each process's ZeRO partition of model and optimiser.

Every process writes into ``.step-00000123.partial/``; when all are done the main process renames
it to ``step-00000123`` — one atomic rename, so a crash or ``kill -9`` mid-write never leaves a
half checkpoint where resume would find it — then prunes all but the newest ``keep``.
Checkpoints of multi-node runs must be on a filesystem every node sees.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clipkit.errors import ClipkitError

PATTERN = re.compile(r"^step-(\d{8})$")
STATE, DEEPSPEED = "state.pt", "deepspeed"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rng-{rank}.pt"


def partial_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f".step-{step:08d}.partial"


def final_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}"


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    is_main: bool,
    barrier: Callable[[], None],
    write_shards: Callable[[Path], None],
    state: Callable[[], dict[str, Any]],
    keep: int = 2,
) -> Path:
    """Write one checkpoint cooperatively; every process calls this.

    ``write_shards(directory)`` runs on every process (its RNG file, DeepSpeed partitions);
    ``state()`` is called on the main process only, after the shards are written.
    """
    building, final = partial_dir(run_dir, step), final_dir(run_dir, step)
    if is_main:
        shutil.rmtree(building, ignore_errors=True)  # leftovers of a run killed mid-write
        building.mkdir(parents=True)
    barrier()
    write_shards(building)
    barrier()
    if is_main:
        _save(building / STATE, {"step": step, **state()})
        _fsync_directory(building)
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a resume
        os.replace(building, final)
        _fsync_directory(final.parent)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def _save(path: Path, value: Any) -> None:
    with open(path, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def save_rng(directory: Path, rank: int, state: dict[str, Any]) -> None:
    _save(rng_file(directory, rank), state)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if PATTERN.match(p.name) and (p / STATE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _load(path: Path) -> Any:
    """Load a file this program wrote (it holds RNG states, hence weights_only=False)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ClipkitError(f"{path}: cannot read checkpoint ({error})") from error


def load_state(path: Path) -> dict[str, Any]:
    """``state.pt`` of a checkpoint directory (the model only when the run had no DeepSpeed)."""
    if not (Path(path) / STATE).is_file():
        raise ClipkitError(f"{path}: not a checkpoint ({STATE} is missing)")
    return _load(Path(path) / STATE)


def load_rng(path: Path, rank: int) -> dict[str, Any]:
    file = rng_file(path, rank)
    if not file.is_file():
        raise ClipkitError(
            f"{path}: no RNG state for process {rank}; resume with the run's number of processes"
        )
    return _load(file)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's state with ``model`` always present: the fp32 weights, consolidated from
    the ZeRO partitions for DeepSpeed runs (any stage; no process group needed)."""
    state = load_state(path)
    if state.get("model") is None:
        state["model"] = consolidate_deepspeed(Path(path) / DEEPSPEED)
    return state


def consolidate_deepspeed(directory: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1/2/3 partitions -> one fp32 state dict (DeepSpeed's zero_to_fp32, run in-process)."""
    if not directory.is_dir():
        raise ClipkitError(
            f"{directory.parent}: the checkpoint holds neither a model nor DeepSpeed partitions"
        )
    from clipkit.train.runtime.zero import consolidate_zero_checkpoint

    return consolidate_zero_checkpoint(directory)


def save_trainer(trainer, step: int) -> Path:
    """Checkpoint a :class:`~clipkit.train.build.Trainer` at ``step``. Every process calls this
    (DeepSpeed partitions and RNG states are per process)."""
    from clipkit.train.runtime import rng_state

    rt = trainer.runtime

    def write_shards(directory: Path) -> None:
        rt.save_sharded(trainer.model, directory / DEEPSPEED)
        save_rng(directory, rt.rank, rng_state())

    def state() -> dict:
        return {
            **rt.strategy.checkpoint_state(trainer.model, trainer.optimizer),
            "schedule": trainer.schedule.state_dict(),
            "loss": trainer.loss.state_dict() if isinstance(trainer.loss, torch.nn.Module) else None,
            "scaler": rt.scaler_state(),
            "data": trainer.stream.position(),
            "skipped_steps": trainer.skipped_steps,
            "world_size": rt.world_size,
            "recipe": trainer.recipe,
        }

    return save_checkpoint(
        trainer.run.directory,
        step,
        is_main=rt.is_main,
        barrier=rt.wait,
        write_shards=write_shards,
        state=state,
        keep=trainer.settings.keep_checkpoints,
    )


def restore_trainer(trainer, path: Path, state: dict) -> None:
    """Load a checkpoint into every stateful piece of a freshly built trainer (the strategy loaded
    the model and optimiser before wrapping them, or loads its partitions here)."""
    from clipkit.train.runtime import set_rng_state

    rt = trainer.runtime
    saved_world = int(state.get("world_size", 1))
    if saved_world != rt.world_size:
        raise ClipkitError(
            f"{path}: the run used {saved_world} process(es), this launch has {rt.world_size}; resume with "
            f"{saved_world} (the data order and RNG streams depend on it)"
        )
    rt.load_sharded(trainer.model, Path(path) / DEEPSPEED)
    trainer.schedule.load_state_dict(state["schedule"])
    if state.get("loss") is not None:
        trainer.loss.load_state_dict(state["loss"])
    rt.load_scaler_state(state.get("scaler"))
    trainer.stream.restore(state["data"])
    trainer.skipped_steps = int(state.get("skipped_steps", 0))
    set_rng_state(load_rng(path, rt.rank))
    trainer.start_step = int(state["step"])
