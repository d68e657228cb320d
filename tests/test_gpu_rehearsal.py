"""The GPU check (benchmarks/gpu/run.sh) rehearsed on the CPU, so a change that breaks it fails here.

A GPU is lent rarely and briefly; the script must then run first time. ``CLIPKIT_GPU_REHEARSAL=1``
runs every step at toy sizes on the CPU: install (into a throwaway target, when a wheel folder is
there), versions, each benchmark part, the gpu tests (skipped without CUDA), and the summary.
These tests check the plumbing, not the figures: every step ends "ok", every part writes
figures, the results folder holds what the device tool can bring back (at most 8 files, none
over 16 MiB, plain names), and the short table comes last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "benchmarks" / "gpu" / "run.sh"
PARTS = ["ceilings", "vit_step", "kme", "batch_wall", "loader", "scaleout"]


def rehearse(results: Path, *parts: str, **budgets: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CLIPKIT_GPU_REHEARSAL": "1",
        "CLIPKIT_GPU_PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
        **budgets,
    }
    env.pop("CLIPKIT_GPU_TESTS_ON_CPU", None)
    return subprocess.run(
        ["bash", str(RUN), str(results), *parts], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def full_rehearsal(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    results = tmp_path_factory.mktemp("gpu-results")
    return results, rehearse(results)


@pytest.mark.slow
def test_every_step_runs_and_writes_its_figures(full_rehearsal):
    results, run = full_rehearsal
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((results / "results.json").read_text())
    steps = {row["step"]: row["status"] for row in record["steps"]}
    assert steps == {name: "ok" for name in ["install", "tests", *PARTS]}, steps
    parts = {part["part"]: part for part in record["parts"]}
    assert set(parts) == set(PARTS)
    for name, part in parts.items():
        assert part["figures"], (name, part.get("skipped"))
        assert part["device"]["rehearsal"] is True
        for fig in part["figures"]:
            assert fig["met"] is None, (name, fig)  # toy sizes judge no goal
            assert isinstance(fig["value"], int | float) and fig["value"] == fig["value"], (name, fig)


@pytest.mark.slow
def test_results_fit_what_the_device_tool_brings_back(full_rehearsal):
    """At most 8 files, none over 16 MiB, names of letters, digits, '.', '_' and '-'; the short
    table is the last thing printed (the device tool's reply carries only the end of the output)."""
    results, run = full_rehearsal
    files = [path for path in results.rglob("*") if path.is_file()]
    assert {path.name for path in files} == {
        "run.log",
        "pytest.log",
        "pytest.xml",
        "results.json",
        "table.md",
    }
    assert all(path.stat().st_size < 16 * 2**20 and re.fullmatch(r"[\w.-]+", path.name) for path in files)
    table = (results / "table.md").read_text()
    assert "| part | figure | value | unit | goal | met |" in table
    tail = run.stdout.rstrip().splitlines()[-40:]
    assert any(line.startswith("| loader |") or line.startswith("| ceilings |") for line in tail), tail
    assert "REHEARSAL" in table


@pytest.mark.slow
def test_a_part_that_hangs_is_cut_and_recorded_and_the_next_part_runs(tmp_path):
    """One hang cannot eat the lease: the part is stopped at its limit, the table says so, and the
    parts after it still run."""
    run = rehearse(tmp_path, "kme", "ceilings", "summary", BUDGET_KME="1")
    assert run.returncode == 0, run.stdout[-3000:]
    record = json.loads((tmp_path / "results.json").read_text())
    steps = {row["step"]: row["status"] for row in record["steps"]}
    assert steps["kme"] == "timed out after 1s"
    assert steps["ceilings"] == "ok"
    assert "| kme | timed out after 1s |" in (tmp_path / "table.md").read_text()


@pytest.mark.slow
def test_the_fused_loss_part_runs_and_writes_its_figures(tmp_path):
    """The named part fused_loss (issue 37): generic tiled and full paths timed at toy sizes; the fused
    kernels (no TRITON_INTERPRET here) and Inf-CL (CUDA only) are recorded as skipped, not faked; so
    is the whole of the named part fused_tiles (the fused kernels' tile sweep)."""
    run = rehearse(tmp_path, "fused_loss", "fused_tiles", "summary")
    assert run.returncode == 0, run.stdout[-3000:]
    record = json.loads((tmp_path / "results.json").read_text())
    steps = {row["step"]: row["status"] for row in record["steps"]}
    assert steps == {"fused_loss": "ok", "fused_tiles": "ok"}
    part, tiles = sorted(record["parts"], key=lambda p: p["part"])
    assert tiles["figures"] == []
    assert any(reason.startswith("fused: triton not installed") for reason in tiles["skipped"])
    names = [fig["name"] for fig in part["figures"]]
    assert any(name.startswith("fused_loss infonce N=32 d=16 tiled fwd+bwd") for name in names), names
    assert any("max rel. difference to tiled" in name for name in names), names
    assert all(fig["met"] is None for fig in part["figures"])
    assert any(reason.startswith("inf-cl") for reason in part["skipped"]), part["skipped"]


def test_the_total_budget_stops_starting_parts(tmp_path):
    run = rehearse(tmp_path, "ceilings", "summary", CLIPKIT_GPU_TOTAL_S="5")
    assert run.returncode == 0, run.stdout[-3000:]
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["steps"] == [{"step": "ceilings", "status": "not run (total budget spent)", "seconds": 0}]


def test_summary_reads_failed_tests_from_the_junit_report(tmp_path):
    """A failing gpu test is named, with its message, in results.json and the table."""
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    suite = ElementTree.Element("testsuite")
    ElementTree.SubElement(suite, "testcase", classname="tests.gpu.test_gpu_kme", name="test_ok")
    failed = ElementTree.SubElement(suite, "testcase", classname="tests.gpu.test_gpu_kme", name="test_bf16")
    ElementTree.SubElement(failed, "failure", message="AssertionError: rel. error 0.04 > 0.01\nmore")
    skipped = ElementTree.SubElement(
        suite, "testcase", classname="tests.gpu.test_gpu_train", name="test_fp16"
    )
    ElementTree.SubElement(skipped, "skipped", message="no scaler")
    ElementTree.SubElement(suite, "testcase", time="0.001")  # pytest stopped by a signal: not a test
    junit = tmp_path / "pytest.xml"
    ElementTree.ElementTree(ElementTree.Element("testsuites")).write(junit)
    root = ElementTree.Element("testsuites")
    root.append(suite)
    ElementTree.ElementTree(root).write(junit)
    tests = summarize.read_junit(junit)
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert tests["failures"] == ["tests.gpu.test_gpu_kme::test_bf16: AssertionError: rel. error 0.04 > 0.01"]
    table = summarize.markdown([], [{"step": "tests", "status": "failed (exit 1)", "seconds": 3}], tests)
    assert "- FAILED tests.gpu.test_gpu_kme::test_bf16" in table
    assert summarize.read_junit(tmp_path / "absent.xml") == {"ran": False}
    cut = summarize.markdown([], [{"step": "tests", "status": "timed out after 150s", "seconds": 150}], tests)
    assert "1 skipped (PARTIAL: the step did not finish" in cut  # counts of a killed run are not a verdict


def test_the_compiled_step_compiles_both_sides_the_same_way(monkeypatch):
    """``CLIPKIT_GPU_VIT_COMPILE``: ``block`` (or 1) compiles each transformer layer of open_clip's
    model, as clipkit's ``train.compile_unit: block`` does its own; ``tower`` the whole model;
    unset or 0 runs no compiled step. Lazy: nothing is compiled here."""
    from interop_support import import_open_clip

    from clipkit.train.compile import is_compiled

    monkeypatch.setenv("CLIPKIT_GPU_REHEARSAL", "1")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import part_vit_step as vit

    for value, unit in (("", None), ("0", None), ("1", "block"), ("block", "block"), ("tower", "tower")):
        monkeypatch.setenv("CLIPKIT_GPU_VIT_COMPILE", value)
        assert vit.compile_unit_asked() == unit, value
    # The tests' own import (its torchvision shim is the process's one registration of those ops).
    open_clip = import_open_clip()
    vision = {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16}
    text = {"context_length": 8, "vocab_size": 50, "width": 32, "heads": 2, "layers": 2}
    for unit in ("block", "tower"):
        model = open_clip.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
        vit.compile_open_clip(model, unit)
        layers = [*model.visual.transformer.resblocks, *model.transformer.resblocks]
        assert len(layers) == 4 and all(is_compiled(layer) == (unit == "block") for layer in layers)
        assert is_compiled(model) == (unit == "tower")
