"""What every log line says about the step's speed: samples/s per device, MFU, the share of time
spent waiting on the loader, the step split into forward / backward / optimiser, and peak memory.

Fields (means over the ``train.log_every`` steps since the last line; :func:`interval_metrics`):

- ``samples_per_s_per_device``: the contrastive batch over all processes, per step, over the
  interval's wall time, divided by the number of processes.
- ``data_wait_share``: the fraction of the interval's wall time the loop waited for the loader's
  next batch (host time blocked in ``next``; under CUDA the device may still be busy with the
  previous step then, so this bounds the device's idle time from above).
- ``forward_ms``, ``backward_ms``, ``optimizer_ms``: per step. On the CPU from the host clock (CPU
  work is synchronous); on CUDA from CUDA events recorded between the phases, read once per log
  line (no synchronisation per step). Exact accumulation interleaves its passes: it reports
  ``forward_backward_ms`` instead of the two.
- ``model_tflops_per_s_per_device`` and ``mfu``: model FLOPs per sample, counted once by
  ``torch.utils.flop_counter`` on one sample of the first batch (the towers' forward; a training
  sample is 3x that: forward + the backward's two products, the usual convention, not counting the
  recomputation of gradient checkpointing nor the similarity and loss), times samples/s per
  device; MFU divides that by the device's peak (:func:`peak_tflops`). Without a known peak (a CPU,
  an unknown GPU) ``mfu`` is left out and the reason is printed once.
- ``compile_warmup_s`` (``train.compile`` only, on the first log line): the wall time of this
  process's first step, where TorchDynamo traces and Inductor compiles the forward and backward
  graphs (plus one step's work). That step is left out of every other field of its interval
  (samples/s, step split, data wait), so they are the steady state; an interval that held only it
  reports no speed.
- ``gpu_peak_gib`` (CUDA: the allocator's peak) or ``cpu_peak_rss_gib`` (the process's peak
  resident memory).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from clipkit.config.machine import peak_problem
from clipkit.errors import ClipkitError

#: Dense peak TFLOP/s by device-name fragment (first match wins), as (16-bit tensor cores, fp32):
#: the vendors' data sheets, without sparsity. The 16-bit figure applies under bf16/fp16
#: autocast, the fp32 one under ``train.precision: no``.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100", 989.4, 66.9),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L4", 121.0, 30.3),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),
    ("T4", 65.0, 8.1),
)


def looked_up_peak(device_name: str, half: bool) -> float | None:
    """The data-sheet peak for a device name (None: not in :data:`PEAK_TFLOPS`)."""
    for fragment, sixteen_bit, fp32 in PEAK_TFLOPS:
        if fragment in device_name:
            return sixteen_bit if half else fp32
    return None


def measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of a square matmul in ``dtype`` on ``device`` (8192 on CUDA, 1024 on a CPU), best of
    a few: what this device reaches on the operation that dominates the towers."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best / 1e12


def peak_tflops(setting: object, device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device or None, where it comes from / why there is none)."""
    problem = peak_problem(setting)
    if problem:
        raise ClipkitError(problem)
    half = precision in ("bf16", "fp16")
    if isinstance(setting, (int, float)):
        return float(setting), "train.peak_tflops"
    if setting == "measure":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        if device.type != "cuda":
            dtype = torch.float32  # CPU half-precision matmuls are emulated: not the towers' peak
        return measured_peak(device, dtype), f"measured ({str(dtype).removeprefix('torch.')} matmul)"
    if device.type != "cuda":
        return None, "MFU omitted on the CPU: no data-sheet peak; set train.peak_tflops (or measure)"
    name = torch.cuda.get_device_name(device)
    found = looked_up_peak(name, half)
    if found is None:
        return None, f"MFU omitted: {name!r} has no known peak; set train.peak_tflops (or measure)"
    return found, f"data sheet for {name} ({'16-bit tensor cores' if half else 'fp32'})"


@contextlib.contextmanager
def eager_towers(model) -> Iterator[None]:
    """Run ``nn.Module.compile``d sub-modules eagerly inside (a FLOP count must not compile)."""
    stashed = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for module, _ in stashed:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, compiled in stashed:
            module._compiled_call_impl = compiled


def one_sample(batch: dict, size: int) -> dict:
    """The first sample of each per-sample tensor of ``batch`` (leading dimension ``size``)."""
    return {
        key: value[:1]
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == size
        else value
        for key, value in batch.items()
    }


def training_flops_per_sample(model, batch: dict, batch_size: int, autocast) -> float:
    """3 x the towers' forward FLOPs on one sample of ``batch`` (torch.utils.flop_counter), counted
    without changing what training does (RNG streams, BatchNorm statistics, modes, caches)."""
    from torch.utils.flop_counter import FlopCounterMode

    from clipkit.train.memory_fit import leaving_no_trace

    sample = one_sample(batch, batch_size)
    devices = [torch.cuda.current_device()] if any(p.is_cuda for p in model.parameters()) else []
    counter = FlopCounterMode(display=False)
    with leaving_no_trace(model), torch.random.fork_rng(devices=devices), eager_towers(model):
        model.eval()
        with torch.no_grad(), autocast, counter:
            model(sample)
    return 3.0 * counter.get_total_flops()


class PhaseClock:
    """Time per step phase: host clock on the CPU, CUDA events on a GPU (read at :meth:`totals_ms`).

    ``start()`` opens a step, ``mark(name)`` closes the phase ``name`` since the previous mark.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []  # CUDA: (phase, start event, end event)
        self.totals: dict[str, float] = {}
        self.last: object = None

    def now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.last = self.now()

    def mark(self, phase: str) -> None:
        if self.last is None:
            return
        now = self.now()
        if self.cuda:
            self.pending.append((phase, self.last, now))
        else:
            self.totals[phase] = self.totals.get(phase, 0.0) + (now - self.last) * 1e3
        self.last = now

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last call (CUDA: waits for the last event once)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for phase, began, ended in self.pending:
                self.totals[phase] = self.totals.get(phase, 0.0) + began.elapsed_time(ended)
        totals, self.totals, self.pending = self.totals, {}, []
        return totals


class NoClock:
    """A :class:`PhaseClock` that measures nothing (callers of ``train_step`` outside the loop)."""

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


@dataclass
class Telemetry:
    """The loop's measurements between two log lines (see the module docstring)."""

    device: torch.device
    world_size: int
    peak: float | None = None  # TFLOP/s of one device, None: MFU omitted
    flops_per_sample: float | None = None  # model FLOPs of one training sample
    clock: PhaseClock = field(init=False)
    data_wait_s: float = 0.0
    steps: int = 0
    compile_warmup_s: float | None = None  # the warm compile's step, until the next log line reports it

    def __post_init__(self) -> None:
        self.clock = PhaseClock(self.device)

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.data_wait_s += time.perf_counter() - began

    def warm_compile(self, seconds: float) -> None:
        """The step that compiled the graphs took ``seconds``: reported apart (``compile_warmup_s``),
        and the interval restarted after it, so its speed fields are the steady state."""
        self.compile_warmup_s = seconds
        self.data_wait_s, self.steps = 0.0, 0
        self.clock.totals_ms()  # drop its phases

    def interval_metrics(self, samples: int, elapsed_s: float) -> dict[str, float]:
        """The telemetry fields for ``samples`` (global) trained in ``elapsed_s`` over ``self.steps``
        steps; resets the interval."""
        warmup = {} if self.compile_warmup_s is None else {"compile_warmup_s": self.compile_warmup_s}
        self.compile_warmup_s = None
        if warmup and not self.steps:  # the interval held only the warm compile: no steady speed
            return {**warmup, **peak_memory(self.device)}
        elapsed_s, steps = max(elapsed_s, 1e-9), max(self.steps, 1)
        per_device = samples / elapsed_s / self.world_size
        metrics = {
            "samples_per_s_per_device": per_device,
            "step_ms": elapsed_s * 1e3 / steps,
            "data_wait_share": min(self.data_wait_s / elapsed_s, 1.0),
        }
        metrics.update({f"{phase}_ms": ms / steps for phase, ms in self.clock.totals_ms().items()})
        if self.flops_per_sample:
            achieved = self.flops_per_sample * per_device / 1e12
            metrics["model_tflops_per_s_per_device"] = achieved
            if self.peak:
                metrics["mfu"] = achieved / self.peak
        metrics.update(peak_memory(self.device))
        self.data_wait_s, self.steps = 0.0, 0
        return {**warmup, **metrics}


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak: the CUDA allocator's, else the resident set's (ru_maxrss)."""
    if device.type == "cuda":
        return {"gpu_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cpu_peak_rss_gib": rss * (1 if sys.platform == "darwin" else 1024) / 2**30}
