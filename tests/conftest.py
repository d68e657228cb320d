"""Shared fixtures: a fresh plugin manager per test, CPU only, no network, tmp working dirs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from shared_data_path import SHARED_DATA

# Tests never load third-party plugins that happen to be installed unless they ask to.
os.environ.setdefault("CLIPKIT_DISABLE_PLUGIN_AUTOLOAD", "1")


def _share_the_cores_between_workers() -> None:
    """Under xdist, each worker's torch (and the processes it starts) gets its share of the usable
    CPUs, set before torch is imported: two workers with a thread per CPU each would oversubscribe
    the cores, and OpenMP threads waiting at barriers then burn the CPU time the tests need. A
    user's own OMP_NUM_THREADS wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


_share_the_cores_between_workers()


def _keep_compiled_bytecode() -> None:
    """Write ``.pyc`` files (pytest's rewritten test modules among them) even where
    PYTHONDONTWRITEBYTECODE is set, as container images often do: without them each xdist worker
    parses and assertion-rewrites every test module again at collection (25 s a worker here, 16 s
    with them), and every process a test starts compiles clipkit's modules anew."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_keep_compiled_bytecode()


def pytest_configure(config):
    """As the xdist controller of a run whose tests launch processes, start the warm fork server
    (tests/warm_launch.py) here, once for both workers: it preloads while they start and collect,
    and this process outlives them. A run of other files (or in one process) starts none here."""
    workers = getattr(config.option, "numprocesses", None) or 0
    if os.environ.get("PYTEST_XDIST_WORKER") or not isinstance(workers, int) or workers < 2:
        return
    if config.getoption("dist", "no") == "no" or not _launches_processes(config.args):
        return
    import warm_launch

    warm_launch.start_shared_server()


def _launches_processes(args: list[str]) -> bool:
    """Whether the tests named on the command line may launch processes warm: a directory may; a
    file does when it uses warm_launch, or another test module's helpers (which may)."""
    for arg in args or ["tests"]:
        path = Path(arg.split("::")[0])
        if path.is_dir():
            return True
        text = path.read_text(errors="replace") if path.is_file() else ""
        if "warm_launch" in text or "from test_" in text:
            return True
    return False


@pytest.fixture
def registry():
    """A registry built from a fresh manager holding only the built-in plugins."""
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    return Registry(make_plugin_manager(autoload=False))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty temporary directory (recipes write data/ and runs/ relative to it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def smoke_shards(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, where quickstart@smoke expects them relative to a run's directory): its training
    data sharded once per worker, for the tests that train it where sharding is not the point
    (each would otherwise shard the same 512 images again at the start of training); copy them
    into a test's directory with ``smoke_data.place_smoke_shards``."""
    from clipkit.app import api

    data = api.resolve("quickstart@smoke", [])["data"]
    directory = tmp_path_factory.mktemp("smoke-shards") / "shards"
    api.shard(data["source"], directory)
    return directory, Path(data["shards"])


@pytest.fixture
def shared_data():
    """../shared/data when present (CI has it; a user's clone does not): skip otherwise.
    ``CLIPKIT_TESTS_SHARED_DATA=none`` runs as if it were absent (tests/shared_data_path.py)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _pretrained_image_tower_absent(request, monkeypatch):
    """The own-data defaults switch a tiny recipe to a 224 px ImageNet-pretrained image tower when
    its optional package is installed: the many tiny in-process runs on ``--data`` would then depend
    on what happens to be installed, and cost seconds more each. They see it absent; a test that
    wants it asks with ``@pytest.mark.pretrained_image_tower``."""
    if "pretrained_image_tower" not in request.keywords:
        from clipkit.app import own_data_defaults

        monkeypatch.setattr(own_data_defaults, "has_pretrained_image_tower", lambda: False)


def pytest_collection_modifyitems(config, items):
    import importlib.util

    has_gpu = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


#: Files whose tests are independent and share only cheap module fixtures: under xdist each of
#: their tests is a unit of its own, so the longest file does not set the suite's time.
SPLIT_BY_TEST = {"tests/test_recipes_train.py"}

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist absent: the suite runs in one process, nothing to schedule
    pass
else:

    class _FileScheduling(LoadFileScheduling):
        """``--dist loadfile`` (a file's tests in one worker: module fixtures are made once and a test
        may read what an earlier test of its file wrote), except the files in SPLIT_BY_TEST."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPLIT_BY_TEST else path

    def pytest_xdist_make_scheduler(config, log):
        return _FileScheduling(config, log) if config.getvalue("dist") == "loadfile" else None
