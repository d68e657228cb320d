"""Test-only start-up code for processes a test launches with this folder on ``PYTHONPATH``
(tests/test_lora.py's launched runs): where the installed torchvision cannot import (the CUDA
build beside the CPU torch), define the two op schemas its meta-registrations look for, as
tests/interop_support.py does in the test process, so transformers — and peft through it — import.
Nothing happens unless the launching test set ``CLIPKIT_TESTS_TORCHVISION_OPS=1``."""

import os

if os.environ.get("CLIPKIT_TESTS_TORCHVISION_OPS") == "1":
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    _library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _library.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
