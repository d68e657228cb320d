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
import importlib.util
from pathlib import Path

import pytest

SHIMS = Path(__file__).resolve().parent / "shims"


def _shim():
    """tests/shims/torchvision_ops.py (that folder is not on this process's path)."""
    spec = importlib.util.spec_from_file_location("torchvision_ops", SHIMS / "torchvision_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def torchvision_is_broken() -> bool:
    """torchvision is installed but ``import torchvision`` fails (its compiled ops do not load)."""
    return _shim().ops_fail_to_load()


@functools.cache
def patch_torchvision_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` schemas if torchvision is installed but cannot import."""
    if not torchvision_is_broken():
        return
    shim = _shim()
    if not shim.defined():
        patch_torchvision_ops.library = shim.define_schemas()  # keep the registration alive


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
