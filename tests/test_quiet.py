"""Quiet runs: third-party warnings go to the debug log, clipkit's own are shown; no DeepSpeed
import (nor its accelerator warning) in a run that does not use it."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from clipkit.app import quiet


@pytest.fixture
def routed(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPKIT_DEBUG_LOG", str(tmp_path / "logs" / "debug.log"))
    monkeypatch.delenv("CLIPKIT_DEBUG", raising=False)
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    for handler in list(quiet.logging.getLogger(quiet.LOGGER).handlers):
        quiet.logging.getLogger(quiet.LOGGER).removeHandler(handler)
    quiet.route_third_party_warnings()
    yield tmp_path / "logs" / "debug.log", shown
    for handler in list(quiet.logging.getLogger(quiet.LOGGER).handlers):
        handler.close()
        quiet.logging.getLogger(quiet.LOGGER).removeHandler(handler)


def test_third_party_warnings_go_to_the_debug_log(routed):
    log, shown = routed
    assert not log.exists()  # created with the first warning only
    warnings.showwarning(UserWarning("noisy"), UserWarning, "/site-packages/somelib/x.py", 3)
    assert shown == []
    assert "somelib/x.py:3: UserWarning: noisy" in log.read_text()
    warnings.showwarning(UserWarning("ours"), UserWarning, quiet.__file__, 1)
    assert shown == ["ours"]  # clipkit's own warnings are shown as before


def test_a_run_imports_no_deepspeed():
    """Building a runtime, preparing a model, stepping and saving it (what every run does) leaves
    DeepSpeed unimported: it costs seconds and prints an accelerator warning."""
    code = (
        "import sys, torch\n"
        "from clipkit.train.runtime import Runtime\n"
        "from clipkit.config.recipe import DistributedConfig\n"
        "rt = Runtime(precision='no', seed=0, distributed=DistributedConfig(), global_batch_size=2,"
        " micro_batch_size=0, grad_clip=0.0)\n"
        "model = torch.nn.Linear(2, 2)\n"
        "model, optimizer = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "rt.backward(model(torch.ones(1, 2)).sum(), model)\n"
        "assert rt.step(model, optimizer).applied\n"
        "assert rt.save(model, optimizer, None)['model'] is not None\n"
        "print('deepspeed' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False" and "Setting accelerator" not in result.stdout + result.stderr
