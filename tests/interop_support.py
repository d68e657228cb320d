"""Import open_clip and transformers for the interop tests, on machines where torchvision is broken.

The only torchvision build for this CPU torch is a CUDA build: ``import torchvision`` fails with
``operator torchvision::nms does not exist`` because its compiled ops cannot load, and both
open_clip (its transforms) and transformers (image utilities, when torchvision is installed) import
it. Defining the two op *schemas* its meta-registrations look for lets the pure-Python parts import
(``/work/shared/ECOSYSTEM.md``); nothing here calls those ops. Where torchvision imports by itself
(checked in a subprocess, so a failed import leaves this process clean) nothing is patched.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

import pytest


@functools.cache
def torchvision_is_broken() -> bool:
    """torchvision is installed but ``import torchvision`` fails (probed in a subprocess)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, timeout=120)
    return probe.returncode != 0


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
