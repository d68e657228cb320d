"""Peak memory of a computation, from torch's own allocator events (CPU or CUDA).

Timing-free and independent of the OS (RSS would also count the Python heap, allocator caching
and pages glibc keeps): torch.profiler with ``profile_memory=True`` records every allocation and
free the tensor allocator makes, with its size; the running sum of those events, in time order,
peaks at the largest number of bytes held at once. Used by tests (memory grows as O(N²), not
O(N²·M²)) and benchmarks/kme.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def peak_allocated_bytes(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` and return (its result, the peak of bytes allocated by torch on ``device`` ("cpu"
    or "cuda") during the call, above what was held when it started). Tensors freed during the call
    that were allocated before it count negatively, so the figure is a peak of *additional* bytes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    wanted = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    events = [
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == wanted
    ]
    held = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        held += nbytes
        peak = max(peak, held)
    return result, peak
