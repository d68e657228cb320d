"""FSDP2's checkpoint files: ``torch.distributed.checkpoint`` (DCP) shards under ``<checkpoint>/fsdp2/``.

Everything that knows their layout is here — what goes in them, how they are checked before DCP
reads them, how they become one full state for export or for a DDP resume — so
:mod:`clipkit.train.checkpoint` never names a DCP file (as :mod:`~clipkit.train.runtime.partitions`
does for DeepSpeed's).

What is saved where. A state dict of an FSDP2 model and its optimiser (``get_state_dict``) holds
tensors (each process's DTensor shards, the similarity's replicated parameters, Adam's step
counts) and plain values (the optimiser's param groups, a ``None`` momentum buffer). The tensors go
into the DCP files under flat keys (``model/<name>``, ``optimizer/<name>/<slot>``); the plain
values go into ``state.pt`` (:func:`split`), which loads with ``weights_only=True``. So the DCP
files hold no pickled object: DCP would load one with the full unpickler.

Why the check (:func:`check_files`): DCP reads its ``.metadata`` file with ``pickle.load``, which
runs whatever code a crafted file names. The file is first read here with an unpickler that only
knows DCP's own metadata classes; a file naming anything else, or declaring a pickled (non-tensor)
entry, is refused before DCP sees it (``--trust-checkpoint`` skips the check).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from clipkit.artifacts.integrity import policy
from clipkit.artifacts.safe_load import first_line
from clipkit.errors import ArtifactError, ClipkitError

DIRECTORY = "fsdp2"  # inside a checkpoint directory
METADATA = ".metadata"  # DCP's index of the shards (a pickle)
MODEL, OPTIMIZER = "model", "optimizer"  # key prefixes in the DCP files


def directory(checkpoint: Path) -> Path:
    """Where a checkpoint keeps its DCP shards (present only for FSDP2 runs)."""
    return Path(checkpoint) / DIRECTORY


def holds(relative_name: str) -> bool:
    """Whether a file of a checkpoint (its path relative to the checkpoint) is a DCP file."""
    return relative_name.startswith(f"{DIRECTORY}/")


def present(checkpoint: Path) -> bool:
    return (directory(checkpoint) / METADATA).is_file()


# ----------------------------------------------------------------------------- tensors vs plain values


def split(model_state: Mapping[str, Any], optimizer_state: Mapping[str, Any]) -> tuple[dict, dict]:
    """(tensors, plain): the flat tensors for DCP and everything else for state.pt.

    model_state:     {name: tensor}; optimizer_state: {"state": {name: {slot: value}},
    "param_groups": [...]} keyed by parameter names (``get_state_dict``'s form).
    """
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise ClipkitError(f"model state `{name}` is not a tensor; FSDP2 checkpoints hold tensors only")
        tensors[f"{MODEL}/{name}"] = value
    for name, slots in optimizer_state.get("state", {}).items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER}/{name}/{slot}"] = value
            else:
                plain_state.setdefault(name, {})[slot] = value
    plain = {"optimizer_plain": plain_state, "param_groups": list(optimizer_state.get("param_groups", []))}
    return tensors, plain


def join(tensors: Mapping[str, torch.Tensor], plain: Mapping[str, Any]) -> tuple[dict, dict]:
    """:func:`split`'s inverse: (model state, optimiser state keyed by parameter names)."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {
        name: dict(slots) for name, slots in (plain.get("optimizer_plain") or {}).items()
    }
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == MODEL:
            model[rest] = value
        elif kind == OPTIMIZER:
            name, _, slot = rest.rpartition("/")
            state.setdefault(name, {})[slot] = value
    return model, {"state": state, "param_groups": [dict(g) for g in plain.get("param_groups") or []]}


# ----------------------------------------------------------------------------- writing and reading


def save(tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Every process writes its shards (and process 0 the metadata) into ``checkpoint``/fsdp2."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(directory(checkpoint)))


def load_into(tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Fill ``tensors`` (this process's shards, as :func:`split` names them) in place from the
    checkpoint's DCP files; every process calls. A key the files lack is the checkpoint's problem."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(tensors, checkpoint_id=str(directory(checkpoint)))
    except Exception as error:  # DCP raises CheckpointException (per rank), RuntimeError, KeyError
        raise ArtifactError(
            f"{directory(checkpoint)}: its shards do not fit the recipe's model and optimiser "
            f"({first_line(error)}); resume with the recipe the run was trained with"
        ) from error


def read_all(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP files, whole, in this process (no process group needed): the flat
    keys of :func:`split`. The files must have passed :func:`check_files`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    found: dict[str, Any] = {}
    try:
        _load_state_dict(
            found,
            storage_reader=FileSystemReader(str(directory(checkpoint))),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    except Exception as error:
        raise ArtifactError(
            f"{directory(checkpoint)}: cannot read the FSDP2 shards ({first_line(error)}); the checkpoint "
            f"is damaged or incomplete — use another one"
        ) from error
    return found


def full_state(checkpoint: Path, plain: Mapping[str, Any]) -> tuple[dict, dict]:
    """(model state, optimiser state by parameter name), whole, from the DCP files and state.pt's
    plain part (``plain``: what :func:`split` put aside), each tensor in the dtype it was saved in."""
    return join(read_all(checkpoint), plain)


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The DCP shards -> one fp32 model state dict (for export), in one process."""
    model, _ = join(read_all(checkpoint), {})
    if not model:
        raise ArtifactError(f"{directory(checkpoint)}: the FSDP2 shards hold no model weights")
    return {key: value.float().contiguous() for key, value in model.items()}


# ----------------------------------------------------------------------------- the check


def _allowed() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` file names (found by reading one): DCP's metadata
    dataclasses, ``torch.Size``, dtypes, the layout look-up, the memory-format enum and the path of
    the checkpoint. None of them runs code when rebuilt."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(metadata, name)
    }
    classes[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    classes[("torch", "Size")] = torch.Size
    classes[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for path_class in ("PosixPath", "WindowsPath", "PurePosixPath"):
        classes[("pathlib", path_class)] = getattr(pathlib, path_class)
    return classes


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds DCP metadata and refuses every other global."""

    def __init__(self, file, allowed: dict) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def read_metadata(checkpoint: Path):
    """The checkpoint's DCP metadata, read with the restricted unpickler."""
    path = directory(checkpoint) / METADATA
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes()), _allowed()).load()
    except pickle.UnpicklingError as error:
        raise ArtifactError(
            f"{path}: refused to read this FSDP2 checkpoint index ({first_line(error)}): it names code to "
            f"run, which a clipkit checkpoint never does; if you wrote it yourself and trust it, pass "
            f"--trust-checkpoint"
        ) from error
    except Exception as error:
        raise ArtifactError(
            f"{path}: cannot read this FSDP2 checkpoint index ({first_line(error)}); it is damaged"
        ) from error


def check_files(checkpoint: Path) -> None:
    """Refuse DCP files whose metadata names anything but DCP's own classes or declares a pickled
    entry (DCP would unpickle it in full); nothing to check without DCP files."""
    if policy().trust_checkpoint or not directory(checkpoint).is_dir():
        return
    if not present(checkpoint):
        raise ArtifactError(f"{directory(checkpoint)}: {METADATA} is missing; the checkpoint is incomplete")
    metadata = read_metadata(checkpoint)
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise ArtifactError(
            f"{directory(checkpoint) / METADATA}: not DCP metadata; the checkpoint is damaged"
        )
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    pickled = sorted(key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if pickled:
        raise ArtifactError(
            f"{directory(checkpoint) / METADATA}: declares pickled entries ({', '.join(pickled[:3])}), which "
            f"a clipkit checkpoint never holds; refused (pass --trust-checkpoint if you trust it)"
        )
