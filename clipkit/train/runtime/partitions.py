"""DeepSpeed's checkpoint files: the ZeRO partitions under ``<checkpoint>/deepspeed/``.

Everything that knows their layout is here — where they go, how they are checked before DeepSpeed
unpickles them, how they become one fp32 state dict for export — so :mod:`clipkit.train.checkpoint`
and :mod:`clipkit.artifacts.safe_load` never name a DeepSpeed file or type. The engine itself writes and
reads them (:meth:`~clipkit.train.runtime.zero.DeepSpeedStrategy.save` and ``load_after_wrapping``).

Why the check: DeepSpeed loads its files with the full unpickler, which runs whatever code a
crafted file names. :func:`check_files` first loads each with PyTorch's restricted unpickler and an
allow-list of the few DeepSpeed types they hold; only files that pass are given to DeepSpeed, so the
full unpickler then meets nothing but those types. ``--trust-checkpoint`` skips the check.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from clipkit import install_hint
from clipkit.artifacts.integrity import policy
from clipkit.artifacts.safe_load import first_line, unsafe_or_damaged
from clipkit.errors import ArtifactError, ClipkitError

DIRECTORY = "deepspeed"  # inside a checkpoint directory
TAG = "zero"  # DeepSpeed's checkpoint tag (one sub-directory per tag)


def directory(checkpoint: Path) -> Path:
    """Where a checkpoint keeps its ZeRO partitions (present only for DeepSpeed runs)."""
    return Path(checkpoint) / DIRECTORY


def holds(relative_name: str) -> bool:
    """Whether a file of a checkpoint (its path relative to the checkpoint) is a ZeRO partition file."""
    return relative_name.startswith(f"{DIRECTORY}/")


def deepspeed_safe_globals() -> list:
    """The DeepSpeed types ZeRO optimiser files hold besides tensors and plain types (found by
    loading them with nothing allowed): the ZeRO stage enum, the loss scaler, fragment addresses.
    Each is plain data (no ``__reduce__``/``__setstate__`` that runs code)."""
    import importlib

    found = []
    for module, names in (
        ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
        ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
        ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
    ):
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return found


def check_files(checkpoint: Path) -> None:
    """Refuse ZeRO files the restricted unpickler (with DeepSpeed's types allowed) cannot load;
    nothing to check for a checkpoint without partitions."""
    if policy().trust_checkpoint or not directory(checkpoint).is_dir():
        return
    allowed = deepspeed_safe_globals()
    for path in sorted(directory(checkpoint).rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as error:
            raise unsafe_or_damaged(path, error, "DeepSpeed checkpoint file") from error
        except Exception as error:
            raise ArtifactError(
                f"{path}: cannot read this DeepSpeed checkpoint file ({first_line(error)}); it is damaged"
            ) from error


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1/2/3 partitions -> one fp32 state dict (DeepSpeed's zero_to_fp32, in-process; no
    process group needed). The files must have passed :func:`check_files`."""
    found = directory(checkpoint)
    if not found.is_dir():
        raise ClipkitError(f"{checkpoint}: the checkpoint holds neither a model nor DeepSpeed partitions")
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as error:
        raise ClipkitError(
            f"{checkpoint} is a DeepSpeed checkpoint; install deepspeed ({install_hint('deepspeed')})"
        ) from error
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(str(found), tag=TAG)
    except Exception as error:  # DeepSpeed raises ValueError, KeyError, FileNotFoundError, asserts
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ArtifactError(
            f"{found}: cannot consolidate the ZeRO partitions ({first}); the checkpoint is "
            f"damaged or incomplete — export another one (--checkpoint)"
        ) from error
    return {key: value.float().contiguous() for key, value in state.items()}
