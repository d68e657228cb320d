"""Test-only start-up code for processes started with this folder on ``PYTHONPATH`` (the warm fork
server of tests/warm_launch.py, and tests/test_lora.py's launched runs): where the installed
torchvision cannot import (the CUDA build beside the CPU torch), define the two op schemas its
meta-registrations look for, as tests/interop_support.py does in the test process, so transformers
— and peft through it — import. Nothing happens unless ``CLIPKIT_TESTS_TORCHVISION_OPS=1``, nor in
a process forked from one that defined them already (a namespace is defined once a process)."""

import os


def _defined() -> bool:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - the lookup is the test
    except (AttributeError, RuntimeError):
        return False
    return True


if os.environ.get("CLIPKIT_TESTS_TORCHVISION_OPS") == "1" and not _defined():
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    _library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
