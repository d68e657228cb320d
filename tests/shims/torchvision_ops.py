"""Where the installed torchvision cannot import (its compiled ops built for CUDA, beside the CPU
torch), the two op schemas its meta-registrations look for, so that what imports it (open_clip,
transformers, peft through it) imports. Used by tests/interop_support.py in the test processes and
by this folder's ``sitecustomize`` in the processes started with it on ``PYTHONPATH``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path


def ops_fail_to_load() -> bool:
    """torchvision is installed but ``import torchvision`` fails: its compiled ops library does not
    load into this torch. Checked by loading that library as torchvision's own import does (a
    millisecond), not by importing torchvision, whose failed import would leave the process half set
    up (a subprocess importing it cost ~2.4 CPU-s a check)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    folder = Path(spec.origin).parent
    compiled = [folder / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    library = next((path for path in compiled if path.is_file()), None)
    if library is None:
        return False
    import torch

    try:
        torch.ops.load_library(str(library))
    except OSError:
        return True
    return False


def defined() -> bool:
    """The schemas exist in this process already (defined here, or in the process it was forked from)."""
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - the lookup is the test
    except (AttributeError, RuntimeError):
        return False
    return True


def define_schemas():
    """Define ``torchvision::nms`` and ``qnms``; keep the returned library alive (the registration
    lives as long as it does)."""
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
    return library
