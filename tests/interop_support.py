"""Import open_clip and transformers for the interop tests, on machines where torchvision is broken.

The only torchvision build for this CPU torch is a CUDA build: ``import torchvision`` fails with
``operator torchvision::nms does not exist`` because its compiled ops cannot load, and both
open_clip (its transforms) and transformers (image utilities, when torchvision is installed) import
it. Defining the two op *schemas* its meta-registrations look for lets the pure-Python parts import
(``/work/shared/ECOSYSTEM.md``); nothing here calls those ops. Where torchvision imports by itself
(its compiled library loads: :func:`torchvision_is_broken`) nothing is patched.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from pathlib import Path

import pytest


@functools.cache
def torchvision_is_broken() -> bool:
    """torchvision is installed but ``import torchvision`` fails: its compiled ops library does not
    load into this torch (a CUDA build beside the CPU torch). Checked by loading that library as
    torchvision's own import does (a millisecond), not by importing torchvision, whose failed import
    would leave this process half set up; a subprocess importing it cost ~2.4 CPU-s a check."""
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


@functools.cache
def patch_torchvision_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` schemas if torchvision is installed but cannot import."""
    if not torchvision_is_broken():
        return
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
    patch_torchvision_ops.library = library  # keep the registration alive


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # e.g. a module blocked as sys.modules[name] = None
        return False


def import_open_clip():
    """open_clip, or skip the test when the ``interop`` extra is not installed."""
    if not installed("open_clip"):
        pytest.skip("open_clip_torch is not installed (pip install '.[interop]')")
    patch_torchvision_ops()
    return pytest.importorskip("open_clip")


def import_transformers():
    """transformers with CLIP importable, or skip the test when it is not installed."""
    if not installed("transformers"):
        pytest.skip("transformers is not installed (pip install '.[interop]')")
    patch_torchvision_ops()
    return pytest.importorskip("transformers")
