"""What the CPU benchmarks in this folder share: clocks, interleaved rounds, median-and-range
summaries of within-round ratios, markdown rows and the line that says what machine ran them.

The measuring rules of docs/benchmarks.md live here once: a warm-up outside the timed rounds;
rounds that run every candidate once, in an order shuffled per round, so load from other processes
hits all candidates alike; process CPU time (waiting for a core shared with other jobs does not
count); a ratio taken between two candidates *of the same round*; and every figure reported as the
median over rounds with the lowest and highest in brackets. (benchmarks/gpu/ has its own helpers,
``benchmarks/gpu/common.py``, for the device.)

Imported by the scripts as ``from measure import ...``: ``python benchmarks/<script>.py`` puts this
folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). With one thread the CPU time counts the work
    done and little of the waiting for a core that other processes hold, so it drifts less."""
    return time.perf_counter(), time.process_time()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of one call of ``fn``."""
    wall, cpu = clocks()
    fn()
    wall_end, cpu_end = clocks()
    return wall_end - wall, cpu_end - cpu


def cpu_seconds(fn: Callable[[], object]) -> float:
    """Process CPU seconds of one call of ``fn``."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def interleaved(
    calls: Mapping[str, Callable[[], T]], repeats: int, *, shuffle: bool = True
) -> dict[str, list[T]]:
    """{label: [what the call returned in each round]}: ``repeats`` rounds, each calling every call
    once. With ``shuffle`` the order is reshuffled every round (seeded by the round index, so a run
    is repeatable); without, it is the mapping's order in every round (a, b, a, b, ...). No warm-up:
    the caller runs that first, since what counts as one differs between benchmarks."""
    results: dict[str, list[T]] = {label: [] for label in calls}
    order = list(calls)
    for round_index in range(repeats):
        if shuffle:
            random.Random(round_index).shuffle(order)
        for label in order:
            results[label].append(calls[label]())
    return results


def ratios(values: Sequence[float], reference: Sequence[float]) -> list[float]:
    """values[r] / reference[r] for every round r: each ratio compares runs of the same round."""
    return [value / ref for value, ref in zip(values, reference, strict=True)]


def spread(values: Sequence[float], digits: int = 3) -> str:
    """'median (min–max)' of ``values`` with ``digits`` decimals."""
    median = statistics.median(values)
    return f"{median:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def ratio_spread(values: Sequence[float], reference: Sequence[float], digits: int = 3) -> str:
    """:func:`spread` of the within-round ratios values / reference."""
    return spread(ratios(values, reference), digits)


def markdown_row(*cells: object) -> str:
    """'| a | b | c |'."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown_header(*columns: str) -> str:
    """The header row and its separator row of a markdown table."""
    return markdown_row(*columns) + "\n" + "|" + "---|" * len(columns)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(*versions: tuple[str, str], threads: bool = True, load: bool = True) -> str:
    """'python …, torch …, <name> <version> …, CPU …, torch threads …, load average …': what a
    figure was measured on. ``versions``: extra (name, version) pairs after python and torch."""
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    parts += [f"{name} {version}" for name, version in versions]
    parts.append(f"CPU {cpu_model()}")
    if threads:
        parts.append(f"torch threads {torch.get_num_threads()}")
    if load and hasattr(os, "getloadavg"):
        parts.append(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return ", ".join(parts)


def heap_bytes() -> int:
    """Bytes of this process's C heap in use (glibc ``mallinfo2``: small blocks in the arenas plus
    mmapped blocks), where torch's CPU allocator takes every tensor's memory from."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                "fordblks", "keepcost",
            )
        ]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def heap_peak_bytes(fn: Callable[[], object]) -> int:
    """The most C-heap bytes in use after any torch operation while ``fn`` ran (forward and
    backward: a TorchDispatchMode samples :func:`heap_bytes` after every op), above what was in use
    before: a CPU stand-in for CUDA's ``max_memory_allocated`` (glibc only)."""
    import gc

    from torch.utils._python_dispatch import TorchDispatchMode

    class Sampler(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, heap_bytes())
            return out

    import torch

    with Sampler():  # the mode's first use allocates its own machinery: not the call's
        torch.zeros(1)
    gc.collect()
    before = heap_bytes()
    with Sampler() as sampler:
        fn()
    return max(sampler.peak - before, 0)
