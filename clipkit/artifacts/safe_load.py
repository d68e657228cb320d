"""Reading checkpoint files without unpickling: ``torch.load(weights_only=True)`` only.

Unpickling lets a file call any Python function (a crafted ``state.pt`` can run a shell command
the moment it is loaded), so clipkit stores nothing but tensors and plain types (dict, list, tuple,
str, int, float, bool, None) and reads them with PyTorch's restricted unpickler, which refuses
every other object. RNG states are stored in that form (:func:`encode_rng`).

DeepSpeed's ZeRO files are read by DeepSpeed itself, which unpickles them; they are checked first
by :mod:`clipkit.train.runtime.partitions`, which owns everything about their layout.
``--trust-checkpoint`` (``LoadPolicy.trust_checkpoint``) skips these checks for files of a source
one trusts (e.g. checkpoints of an older clipkit, which pickled RNG states).
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clipkit.artifacts.integrity import policy
from clipkit.errors import ArtifactError, UnsafeCheckpointError

RNG_FORMAT = 1
TRUST_HINT = (
    "clipkit never unpickles checkpoints, because unpickling runs whatever code a crafted file names; "
    "if you wrote this checkpoint yourself (e.g. with an older clipkit), pass --trust-checkpoint to load it"
)


def load_file(path: Path, what: str = "checkpoint file") -> Any:
    """A file written by :func:`torch.save` holding only tensors and plain types."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the checkpoint is incomplete — resume from another one")
    trusted = policy().trust_checkpoint
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise unsafe_or_damaged(path, error, what) from error
    except Exception as error:  # truncated zip, bad magic, EOF: torch raises several types
        raise ArtifactError(
            f"{path}: cannot read this {what} ({first_line(error)}); it is truncated or damaged — "
            f"resume from another checkpoint"
        ) from error


def unsafe_or_damaged(path: Path, error: Exception, what: str) -> ArtifactError:
    """The restricted unpickler's refusal names a Python global: an unsafe file, not a damaged one."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found or "Weights only load failed" in str(error):
        name = found.group(1) if found else "a Python object"
        return UnsafeCheckpointError(
            f"{path}: this {what} refers to {name}, which only unpickling can load; not loaded. {TRUST_HINT}"
        )
    return ArtifactError(f"{path}: cannot read this {what} ({first_line(error)}); it is damaged")


def first_line(error: Exception) -> str:
    """The gist of an error: its first line, or two when the first only introduces a list
    (``load_state_dict``'s "Error(s) in loading state_dict for X:")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


# ----------------------------------------------------------------------------- RNG states


def encode_rng(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`clipkit.train.runtime.rng_state` as tensors and plain types (numpy's key array -> tensor)."""
    version, internal, gauss = state["python"]
    kind, keys, position, has_gauss, cached = state["numpy"]
    encoded = {
        "format": RNG_FORMAT,
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": state["torch"],
    }
    if "cuda" in state:
        encoded["cuda"] = list(state["cuda"])
    return encoded


def decode_rng(encoded: Any, path: Path) -> dict[str, Any]:
    """The inverse of :func:`encode_rng`, for :func:`clipkit.train.runtime.set_rng_state`."""
    if isinstance(encoded, dict) and "format" not in encoded and "python" in encoded:
        return encoded  # older clipkit pickled the states as they are (loaded with --trust-checkpoint)
    try:
        if encoded["format"] != RNG_FORMAT:
            raise ValueError(f"format {encoded['format']!r}, expected {RNG_FORMAT}")
        python, numpy_ = encoded["python"], encoded["numpy"]
        state = {
            "python": (python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"]),
            "numpy": (
                numpy_["kind"],
                numpy_["keys"].numpy().astype(np.uint32),
                numpy_["position"],
                numpy_["has_gauss"],
                numpy_["cached_gaussian"],
            ),
            "torch": encoded["torch"],
        }
        random.Random().setstate(state["python"])  # refuse a malformed state before it is applied
        np.random.RandomState().set_state(state["numpy"])
        if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
            raise ValueError("torch state is not a byte tensor")
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ArtifactError(f"{path}: not a valid RNG state ({error}); the checkpoint is damaged") from error
    if "cuda" in encoded:
        state["cuda"] = encoded["cuda"]
    return state
