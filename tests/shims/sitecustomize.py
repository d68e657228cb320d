"""Test-only start-up code for processes started with this folder on ``PYTHONPATH`` (the warm fork
server of tests/warm_launch.py, and tests/test_lora.py's launched runs): where the installed
torchvision cannot import (the CUDA build beside the CPU torch), define the two op schemas its
meta-registrations look for, as tests/interop_support.py does in the test process, so transformers
— and peft through it — import. Nothing happens unless ``CLIPKIT_TESTS_TORCHVISION_OPS=1`` (or
``auto``, and torchvision's compiled ops do not load here), nor in a process forked from one that
defined them already (a namespace is defined once a process)."""

import os


def _defined() -> bool:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - the lookup is the test
    except (AttributeError, RuntimeError):
        return False
    return True


def _torchvision_ops_fail_to_load() -> bool:
    """torchvision is installed but its compiled ops library does not load into this torch (as
    tests/interop_support.torchvision_is_broken checks)."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    folder = Path(spec.origin).parent
    compiled = [folder / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    library = next((path for path in compiled if path.is_file()), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
    except OSError:
        return True
    return False


_wanted = os.environ.get("CLIPKIT_TESTS_TORCHVISION_OPS")
if (_wanted == "1" or (_wanted == "auto" and _torchvision_ops_fail_to_load())) and not _defined():
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    _library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
