"""What every part of the GPU check shares: the device, rehearsal sizes, timing, and the result file.

A part is ``python benchmarks/gpu/part_NAME.py --out DIR``. It measures on CUDA, or — with
``CLIPKIT_GPU_REHEARSAL=1`` — on the CPU at toy sizes, so that its plumbing, parsing and table
writing run in CI (tests/test_gpu_rehearsal.py). It writes ``DIR/NAME.json`` through
:func:`write_part` with a list of figures, each::

    {"name": "KME fwd+bwd triton, N=256 197x77", "value": 123.4, "unit": "TFLOP/s",
     "goal": ">= 50 % of bf16 peak", "met": true | false | None, "note": "..."}

``met`` is ``None`` where a figure has no goal, or in a rehearsal (toy sizes prove nothing).
Nothing is estimated: a figure that could not be measured is left out and its reason given in
``skipped`` instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def rehearsal() -> bool:
    """True for the CPU rehearsal (toy sizes, no goals judged)."""
    return os.environ.get("CLIPKIT_GPU_REHEARSAL", "") not in ("", "0")


def device() -> torch.device:
    """CUDA where present; the CPU only in a rehearsal (a real run without CUDA is an error)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if rehearsal():
        return torch.device("cpu")
    raise SystemExit(
        "no CUDA device: run on a GPU machine, or set CLIPKIT_GPU_REHEARSAL=1 for the CPU rehearsal"
    )


def pick(real, toy):
    """``real`` on a GPU, ``toy`` in a rehearsal."""
    return toy if rehearsal() else real


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5) -> list[float]:
    """Milliseconds per call of ``fn``, one value per repeat, after ``warmup`` untimed calls.

    CUDA events around each call on a GPU (device work is asynchronous); the process clock around a
    synchronised call on the CPU."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def interleaved_ms(
    runs: dict[str, Callable[[], object]], *, warmup: int = 2, rounds: int = 5
) -> dict[str, list[float]]:
    """Per-call milliseconds of every runner, measured in interleaved rounds (one call of each
    runner per round, same order), so drifting clocks or load hit all runners alike."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            out[name].extend(time_ms(fn, warmup=0, repeats=1))
    return out


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def spread(values: list[float]) -> dict[str, float]:
    """median, min and max of a list of timings."""
    return {"median": median(values), "min": float(min(values)), "max": float(max(values))}


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Bytes torch's CUDA allocator held at most while ``fn`` ran, above what it held before; None on
    the CPU (the rehearsal does not measure memory)."""
    if not torch.cuda.is_available():
        fn()
        return None
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def device_description() -> dict[str, object]:
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rehearsal": rehearsal(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info["gpu"] = None
    return info


def figure(
    name: str, value: float, unit: str, *, goal: str | None = None, met: bool | None = None, note: str = ""
) -> dict:
    """One measured figure; ``met`` is forced to None in a rehearsal (toy sizes judge nothing)."""
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "goal": goal,
        "met": None if rehearsal() else met,
        "note": note,
    }


def parse_out() -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="results folder (the part writes NAME.json)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out


def write_part(
    out: Path, name: str, figures: list[dict], *, skipped: list[str] = (), extra: dict | None = None
) -> Path:
    """Write ``out/NAME.json`` atomically (a part killed by its timeout leaves no half file)."""
    record = {
        "part": name,
        "device": device_description(),
        "figures": figures,
        "skipped": list(skipped),
        **(extra or {}),
    }
    path = out / f"{name}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1, default=str))
    partial.replace(path)
    return path


def read_ceilings(out: Path) -> dict[str, float]:
    """The device's measured ceilings written by part_ceilings.py (``bf16_tflops``,
    ``fp32_tflops``, ``copy_gb_s``); empty when that part did not run."""
    path = out / "ceilings.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {f["key"]: f["value"] for f in record["figures"] if "key" in f}


def _age_at_import() -> float:
    """This process's age when common was imported (Linux /proc: the interpreter's and torch's
    start-up count against a part's budget); 0 where /proc is missing or gives an implausible age."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    return age if 0.0 <= age < 600.0 else 0.0


_IMPORTED = time.monotonic()
_AGE_AT_IMPORT = _age_at_import()


def process_seconds() -> float:
    """Seconds since this process started (as far as /proc tells; else since common's import)."""
    return _AGE_AT_IMPORT + time.monotonic() - _IMPORTED


def is_oom(error: BaseException) -> bool:
    """An allocation failure: torch's OutOfMemoryError, or cuBLAS/CUDA's in a RuntimeError."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "alloc_failed" in text)


def free_memory() -> None:
    """Drop what the last attempt left: Python garbage, then the CUDA allocator's cached blocks.
    Without CUDA (the rehearsal, which measures no memory) nothing: a full collection there costs
    ~0.3 s once Dynamo is imported, a dozen times a part."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
