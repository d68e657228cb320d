"""Fixtures of the `gpu`-marked tests (issue 25, item 2), and their CPU debug mode.

On a CUDA machine every test here runs at full size. Without CUDA, tests/conftest.py skips them
("needs a CUDA GPU"), unless ``CLIPKIT_GPU_TESTS_ON_CPU=1``: then the skip is lifted for this folder
and every test runs its logic on the CPU at reduced sizes (:data:`ON_GPU` False), with the Triton
kernels under ``TRITON_INTERPRET=1`` when triton is installed. Cases that need CUDA itself (fp16
with the loss scaler, NCCL) skip with a reason in that mode.

Each test prints one timing line (the wall-time budget of the whole folder on a GPU is 150 s), and
the session ends with a table of them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ON_CPU_SWITCH = os.environ.get("CLIPKIT_GPU_TESTS_ON_CPU", "0") not in ("", "0")
ON_GPU = torch.cuda.is_available()
CPU_MODE = ON_CPU_SWITCH and not ON_GPU
if CPU_MODE:
    # Must be set before triton decorates the kernels (plugins/similarities/kme_triton.py, imported lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: The shards every in-process training shares: the synthetic shapes, few enough to shard in ~1 s.
SHAPES_SOURCE = "synthetic://shapes?n=512&split=train&image_size=48"
_TIMINGS: list[tuple[str, float]] = []


def is_cuda_skip(marker) -> bool:
    return marker.name == "skip" and marker.kwargs.get("reason") == "needs a CUDA GPU"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """CPU debug mode: lift tests/conftest.py's "needs a CUDA GPU" skip for this folder's tests."""
    if not CPU_MODE:
        return
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.own_markers = [
                m
                for m in item.own_markers
                if not (m.name == "skip" and m.kwargs.get("reason") == "needs a CUDA GPU")
            ]


def pytest_terminal_summary(terminalreporter):
    if _TIMINGS:
        terminalreporter.section("gpu test timings (wall s)")
        for name, seconds in _TIMINGS:
            terminalreporter.write_line(f"{seconds:7.1f}  {name}")
        terminalreporter.write_line(f"{sum(s for _, s in _TIMINGS):7.1f}  total")


@pytest.fixture(autouse=True)
def _timing_line(request):
    """One line per test as it ends: ``[gpu-timing] <test> <seconds> s`` (not swallowed by capture)."""
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    _TIMINGS.append((request.node.nodeid, seconds))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[gpu-timing] {request.node.nodeid} {seconds:.1f} s")


@pytest.fixture(scope="session")
def gpu_device() -> torch.device:
    """cuda, or cpu in the CPU debug mode (the tests are skipped otherwise, before this runs)."""
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def fp32_matmul_precision():
    """Set torch's fp32 matmul precision for one test ("highest": IEEE fp32; "high": TF32) and restore
    it, with cuDNN's TF32 switch, afterwards: the trainings later in the session must not inherit it."""
    before, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.fixture(scope="session")
def gpu_registry():
    """One registry of the built-in plugins for the session."""
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    return Registry(make_plugin_manager(autoload=False))


@pytest.fixture(scope="session")
def shapes_shards(tmp_path_factory, gpu_registry) -> Path:
    """:data:`SHAPES_SOURCE` sharded once per session, shared by every in-process training."""
    from clipkit.app import api

    directory = tmp_path_factory.mktemp("gpu-data") / "shapes"
    api.shard(SHAPES_SOURCE, directory, registry=gpu_registry)
    return directory


@pytest.fixture(scope="session")
def shapes_overrides(shapes_shards) -> list[str]:
    """Recipe overrides pointing a ``@tiny`` recipe at the shared shards (and their source, which
    must match the shards' manifest)."""
    return [f"data.shards={shapes_shards}", f"data.source={SHAPES_SOURCE}"]


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64; inf when ``got`` holds a NaN or inf (so that never passes)."""
    got, reference = got.detach().double().cpu(), reference.detach().double().cpu()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    norm = float(torch.linalg.vector_norm(reference))
    return float(torch.linalg.vector_norm(got - reference)) / (norm if norm > 0 else 1.0)


@pytest.fixture(scope="session")
def relative_error():
    """The tolerance metric of every test here: ``relative_error(got, reference)`` -> float."""
    return _relative_error
