"""Training checkpoints: everything needed to continue a run exactly.

``RUN/checkpoints/step-00000123/`` holds

- ``state.pt`` (written by the main process): step, schedule, the loss's per-sample state
  (SogCLR/NUCLR: kept out of DeepSpeed's checkpoint on purpose, identical on every process), the
  data position, the fp16 loss scaler, the resolved recipe, the number of processes and — without
  DeepSpeed — the model and optimiser;
- ``rng-<rank>.pt``: every RNG state of each process;
- ``deepspeed/`` (DeepSpeed runs): each process's ZeRO partition of model and optimiser, whose layout
  only :mod:`clipkit.train.runtime.partitions` knows;
- ``fsdp2/`` (FSDP2 runs): each process's shards of model and optimiser, written with
  ``torch.distributed.checkpoint``, whose layout only :mod:`clipkit.train.runtime.dcp_files` knows
  (their plain part, the optimiser's param groups, is in state.pt under ``sharded``);
- ``checkpoint.json`` (written last): the sha256 of every other file, checked on load.

Files hold only tensors and plain types and load with ``weights_only=True``: a checkpoint is never
unpickled (:mod:`clipkit.artifacts.safe_load`), so a crafted one cannot run code on ``--resume`` or export.

The commit protocol (:func:`save_checkpoint`). Every process writes into
``.step-00000123.partial/``; when all are done the main process writes state.pt and the manifest,
then renames the directory to ``step-00000123`` — one atomic rename, so a crash or ``kill -9``
mid-write never leaves a half checkpoint where resume would find it — then prunes all but the
newest ``keep``. A full disk (:func:`clipkit.artifacts.io.writing`) removes the ``.partial`` directory and
keeps the earlier checkpoints. Checkpoints of multi-node runs must be on a filesystem every node sees.

Resuming (:func:`open_checkpoint`, then :meth:`clipkit.train.runtime.Runtime.prepare`, then
:func:`restore_trainer`): the newest complete checkpoint is verified and its process count checked
before anything loads; the runtime loads what it owns (model, optimiser, ZeRO partitions, loss
scale) around wrapping; :func:`restore_trainer` loads the rest into the built trainer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clipkit.artifacts.integrity import describe_files, policy, verify_files, warn_unverified
from clipkit.artifacts.io import directory_bytes, fsync_directory, tensor_bytes, write_durably, writing
from clipkit.artifacts.safe_load import decode_rng, encode_rng, load_file
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.train.ema import ema_checkpoint_state, restore_ema
from clipkit.train.runtime import dcp_files, partitions, rng_state, set_rng_state

if TYPE_CHECKING:
    from clipkit.train.trainer import Trainer

PATTERN = re.compile(r"^step-(\d{8})$")
STATE, MANIFEST = "state.pt", "checkpoint.json"
MANIFEST_FORMAT = "clipkit-checkpoint/1"
#: Keys of ``state.pt`` that resuming reads, with the types they must have.
STATE_KEYS = {"step": int, "schedule": dict, "data": dict}


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
    # Why this order: the shards and state.pt go into a directory resume never reads (".partial");
    # the barriers make every process's files complete before the main process writes the manifest
    # (hashes of everything) and renames — the rename is the commit, so a checkpoint is either
    # complete and verified or absent. fsync before and after the rename: the directory entry must
    # not reach the disk before the files it names.
    building, final = partial_dir(run_dir, step), final_dir(run_dir, step)
    earlier = latest_checkpoint(run_dir)
    sizes: dict[str, int] = {}

    def needed() -> int | None:  # a checkpoint of this run is as large as the one before it
        return directory_bytes(earlier) if earlier is not None else sizes.get("state")

    kept = (
        f"the earlier checkpoint {earlier.name} is intact (resume from it with --resume)"
        if earlier is not None
        else "no earlier checkpoint"
    )
    with writing(final, needed=needed, remove=[building] if is_main else [], kept=kept):
        if is_main:
            shutil.rmtree(building, ignore_errors=True)  # leftovers of a run killed mid-write
            building.mkdir(parents=True)
        barrier()  # nobody writes before the directory exists
        write_shards(building)
        barrier()  # every process's files are complete before the manifest hashes them
        if is_main:
            value = {"step": step, **state()}
            sizes["state"] = tensor_bytes(value)
            # state.pt is what list_checkpoints looks for, but only under the final name: inside
            # ".partial" it marks nothing, so writing it before the manifest is safe.
            _save(building / STATE, value)
            write_manifest(building)  # hashes of every file: resume refuses a changed or missing one
            fsync_directory(building)  # the entries exist on disk before the rename can publish them
            shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a resume
            os.replace(building, final)  # the commit: atomic, the checkpoint is now visible whole
            fsync_directory(final.parent)  # the rename itself survives a power cut
            # Pruning only after the commit: until then the earlier checkpoints are the resume point.
            for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
            # A write a crash or a second Ctrl-C cut short, at another step: never read, now gone.
            for stale in checkpoint_dir(run_dir).glob(".step-*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
    barrier()  # no process returns (and trains on) before the checkpoint is committed
    return final


def _save(path: Path, value: Any) -> None:
    write_durably(path, lambda handle: torch.save(value, handle))


def save_rng(directory: Path, rank: int, state: dict[str, Any]) -> None:
    """One process's RNG states, as tensors and plain types (loadable without unpickling)."""
    _save(rng_file(directory, rank), encode_rng(state))


def write_manifest(directory: Path) -> None:
    """``checkpoint.json``: the sha256 of every file in the checkpoint (the main process, last)."""
    names = [str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.is_file()]
    manifest = {"format": MANIFEST_FORMAT, "files": describe_files(directory, names)}
    text = json.dumps(manifest, indent=1) + "\n"
    write_durably(Path(directory) / MANIFEST, lambda handle: handle.write(text), mode="w")


def verify_checkpoint(path: Path) -> None:
    """Check every file against ``checkpoint.json`` (a one-line warning when there is none)."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        warn_unverified(path, "its files are")
        return
    from clipkit.artifacts.files import read_json

    manifest = read_json(manifest_path, "the checkpoint manifest", "the checkpoint is damaged")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{manifest_path}: not a clipkit checkpoint manifest ({MANIFEST_FORMAT})")
    present = (str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
    loaded = [
        n for n in present if n == STATE or n.startswith("rng-") or partitions.holds(n) or dcp_files.holds(n)
    ]
    verify_files(path, manifest.get("files"), where=manifest_path, what="checkpoint", required=loaded)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of a run (``checkpoints/step-*``), oldest first. Every one was published
    whole (:func:`save_checkpoint` renames a finished directory), so one without ``state.pt`` is
    damaged and listed too: resume and export refuse it (:func:`load_state`) rather than fall back
    to an older step unseen."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if PATTERN.match(p.name) and p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_state(path: Path) -> dict[str, Any]:
    """``state.pt`` of a checkpoint directory (the model only when the run had no DeepSpeed).

    Checks the whole checkpoint first: every file against ``checkpoint.json`` (unless
    ``--no-verify``) and, for DeepSpeed runs, that its ZeRO files hold nothing to unpickle.
    """
    path = Path(path)
    if not (path / STATE).is_file():
        raise ArtifactError(f"{path}: damaged checkpoint: its {STATE} is missing{earlier_remedy(path)}")
    if policy().verify:
        verify_checkpoint(path)
    partitions.check_files(path)
    dcp_files.check_files(path)
    state = load_file(path / STATE, "checkpoint state")
    return check_state(state, path / STATE)


def earlier_remedy(path: Path) -> str:
    """What a user can do about a damaged checkpoint ``path`` of a run: the step before it, if any."""
    if not PATTERN.match(path.name):
        return "; pass a checkpoint directory (checkpoints/step-*)"
    earlier = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    if not earlier:
        return "; the run has no earlier checkpoint"
    return (
        f"; to go on from the one before it ({earlier[-1].name}), move {path.name} out of {path.parent} "
        f"(or export that one with --checkpoint {earlier[-1]})"
    )


def check_state(state: Any, file: Path) -> dict[str, Any]:
    """Refuse a ``state.pt`` without what resuming reads, naming the key (instead of a KeyError later)."""
    if not isinstance(state, dict):
        raise ArtifactError(f"{file}: holds a {type(state).__name__}, not a checkpoint state; it is damaged")
    for key, kind in STATE_KEYS.items():
        if not isinstance(state.get(key), kind):
            found = "missing" if key not in state else f"a {type(state[key]).__name__}"
            raise ArtifactError(
                f"{file}: `{key}` is {found}, expected {kind.__name__}; the checkpoint is damaged"
            )
    position = state["data"]
    if not all(isinstance(position.get(k), int) for k in ("epoch", "batch_in_epoch")):
        raise ArtifactError(
            f"{file}: `data` lacks the integer epoch/batch_in_epoch; the checkpoint is damaged"
        )
    return state


def load_rng(path: Path, rank: int) -> dict[str, Any]:
    file = rng_file(path, rank)
    if not file.is_file():
        raise ClipkitError(
            f"{path}: no RNG state for process {rank}; resume with the run's number of processes"
        )
    return decode_rng(load_file(file, "RNG state"), file)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's state with ``model`` always present: the fp32 weights, consolidated from
    the ZeRO partitions for DeepSpeed runs (any stage) or gathered from the shards for FSDP2 runs
    (with their ``optimizer`` state too, keyed by parameter name); no process group needed."""
    state = load_state(path)
    if state.get("model") is not None and not isinstance(state["model"], dict):
        raise ArtifactError(f"{Path(path) / STATE}: `model` is not a state dict; the checkpoint is damaged")
    if state.get("model") is None and dcp_files.present(Path(path)):
        model, state["optimizer"] = dcp_files.full_state(Path(path), state.get("sharded") or {})
        state["model"] = {key: value.float().contiguous() for key, value in model.items()}
    elif state.get("model") is None:
        state["model"] = partitions.consolidate(Path(path))
    return state


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to resume from: its directory and its verified ``state.pt``."""

    path: Path
    state: dict[str, Any]


def open_checkpoint(run_dir: Path, world_size: int) -> Checkpoint:
    """The newest complete checkpoint of ``run_dir``, verified (:func:`load_state`), refused before
    anything loads when it was written by another number of processes (the data order and the RNG
    streams depend on it)."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise ClipkitError(f"{run_dir}: nothing to resume (no complete checkpoints/step-*)")
    state = load_state(path)
    saved_world = int(state.get("world_size", 1))
    if saved_world != world_size:
        raise ClipkitError(
            f"{path}: the run used {saved_world} process(es), this launch has {world_size}; resume with "
            f"{saved_world} (the data order and RNG streams depend on it)"
        )
    return Checkpoint(path, state)


def save_trainer(trainer: Trainer, step: int) -> Path:
    """Checkpoint a :class:`~clipkit.train.trainer.Trainer` at ``step``. Every process calls this
    (DeepSpeed partitions and RNG states are per process)."""
    rt = trainer.runtime
    runtime_part: dict[str, Any] = {}

    def write_shards(directory: Path) -> None:
        runtime_part.update(rt.save(trainer.step, trainer.optimizer, directory))
        save_rng(directory, rt.rank, rng_state())

    def state() -> dict:
        return {
            **runtime_part,  # model, optimizer, scaler (None under DeepSpeed/FSDP2: in their shards)
            "schedule": trainer.schedule.state_dict(),
            "loss": trainer.loss.state_dict() if isinstance(trainer.loss, torch.nn.Module) else None,
            "data": trainer.stream.position(),
            "skipped_steps": trainer.skipped_steps,
            **ema_checkpoint_state(trainer.ema),  # train.ema: the fp32 average, alike on every process
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


def restore_trainer(trainer: Trainer, checkpoint: Checkpoint) -> None:
    """Load a checkpoint into the trainer's own stateful pieces (the runtime has loaded the model,
    optimiser and loss scale in :meth:`~clipkit.train.runtime.Runtime.prepare`): the schedule, the
    loss's per-sample state, the weight EMA, the data position, the skipped-step count, this
    process's RNGs and the step to start from."""
    state = checkpoint.state
    trainer.schedule.load_state_dict(state["schedule"])
    if state.get("loss") is not None:
        trainer.loss.load_state_dict(state["loss"])
    restore_ema(trainer.ema, state, str(checkpoint.path / STATE))
    trainer.stream.restore(state["data"])
    trainer.skipped_steps = int(state.get("skipped_steps", 0))
    set_rng_state(load_rng(checkpoint.path, trainer.runtime.rank))
    trainer.start_step = int(state["step"])
