"""Test-only start-up code for processes started with this folder on ``PYTHONPATH`` (the warm fork
server of tests/warm_launch.py, and tests/test_lora.py's launched runs): where the installed
torchvision cannot import (the CUDA build beside the CPU torch), define the two op schemas its
meta-registrations look for (``torchvision_ops``), as tests/interop_support.py does in the test
process, so transformers — and peft through it — import. Nothing happens unless
``CLIPKIT_TESTS_TORCHVISION_OPS=1`` (or ``auto``, and torchvision's compiled ops do not load here),
nor in a process forked from one that defined them already (a namespace is defined once a process)."""

import os

import torchvision_ops

_wanted = os.environ.get("CLIPKIT_TESTS_TORCHVISION_OPS")
_broken = _wanted == "1" or (_wanted == "auto" and torchvision_ops.ops_fail_to_load())
if _broken and not torchvision_ops.defined():
    _library = torchvision_ops.define_schemas()
