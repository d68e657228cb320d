"""benchmarks/measure.py, the helpers the CPU benchmark scripts share (they are scripts, not a package:
the module is loaded from its file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location("benchmark_measure", ROOT / "benchmarks" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleaved_runs_every_call_once_per_round_in_a_seeded_shuffled_order(measure):
    log = []
    calls = {label: (lambda label=label: log.append(label) or f"{label}{len(log)}") for label in "abcd"}
    results = measure.interleaved(calls, 5)
    rounds = [log[4 * r : 4 * r + 4] for r in range(5)]
    assert all(sorted(chunk) == list("abcd") for chunk in rounds)
    assert len({tuple(chunk) for chunk in rounds}) > 1  # the order changes between rounds
    # Each label's values are in round order, and are what its call returned in that round.
    for label, values in results.items():
        assert values == [f"{label}{4 * r + rounds[r].index(label) + 1}" for r in range(5)]
    log.clear()
    measure.interleaved(calls, 5)
    assert [log[4 * r : 4 * r + 4] for r in range(5)] == rounds  # seeded: the same orders again


def test_interleaved_without_shuffle_keeps_the_order(measure):
    log = []
    measure.interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, 3, shuffle=False)
    assert log == ["a", "b"] * 3


def test_spreads_and_within_round_ratios(measure):
    assert measure.spread([3.0, 1.0, 2.0], 2) == "2.00 (1.00–3.00)"
    assert measure.ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    assert measure.ratio_spread([2.0, 9.0, 4.0], [1.0, 3.0, 1.0], 1) == "3.0 (2.0–4.0)"
    with pytest.raises(ValueError):
        measure.ratios([1.0], [1.0, 2.0])  # rounds must pair up


def test_markdown_and_clocks(measure):
    assert measure.markdown_row("a", 1, 2.5) == "| a | 1 | 2.5 |"
    assert measure.markdown_header("x", "y") == "| x | y |\n|---|---|"
    wall, cpu = measure.timed(lambda: sum(range(10_000)))
    assert wall >= 0 and cpu >= 0 and measure.cpu_seconds(lambda: None) >= 0
    line = measure.machine_line(("clipkit", "0"), load=False)
    assert line.startswith("python ") and ", clipkit 0, CPU " in line and "load average" not in line


def test_heap_peak_counts_what_a_call_allocates_and_frees(measure):
    """A call that holds a 16 MiB tensor for a moment peaks at about 16 MiB above its start (the
    sampler sees it after the op that made it), though it frees it before returning; a call that
    allocates nothing peaks near zero."""
    import torch

    def hold_and_free():
        tensor = torch.ones(4 * 2**20)  # 16 MiB of fp32
        return float(tensor[0])

    hold_and_free()  # first-call allocations (thread pools, caches) out of the way
    peak = measure.heap_peak_bytes(hold_and_free)
    assert 16 * 2**20 <= peak <= 18 * 2**20
    assert measure.heap_peak_bytes(lambda: None) <= 2**20
