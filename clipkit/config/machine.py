"""Defaults that fit the machine: loader workers and torch threads from the CPUs this process may use.

``data.num_workers: auto`` and ``train.threads: auto`` (the defaults) are derived from
``os.sched_getaffinity`` — the CPUs the process may run on (a container's or ``taskset``'s limit,
not the host's count) — shared among the processes of this node (``LOCAL_WORLD_SIZE`` under
``torchrun`` / ``accelerate launch``). Training on the CPU, half of a process's CPUs decode images
(at most :data:`MAX_AUTO_WORKERS`) and the rest run torch's intra-op threads. Training on a GPU,
the model's arithmetic is not on the CPU: all but :data:`ACCELERATOR_HOST_THREADS` CPUs decode (at
most :data:`MAX_AUTO_WORKERS_ACCELERATOR`) — measured on an H200 with 16 cores, 8 workers fed a
ViT-B/16 bf16 step at 0.82x of what it consumes, 16 at 1.28x (docs/benchmarks.md, "GPU").
A number set in the recipe is kept. ``train.threads: auto`` takes a thread count the environment
sets (``OMP_NUM_THREADS``, else ``MKL_NUM_THREADS``: what torch itself reads, and what ``torchrun``
and ``accelerate launch`` set per process) before deriving one.

The main process prints one line at start: how many processes really run, with how many torch
threads and loader workers each (:func:`fit_to_machine`), and a warning when the launcher was asked
for more processes than started (:func:`launch_warning`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AUTO = "auto"
#: More loader workers than this rarely pay off and multiply memory (each holds a copy of the stream).
MAX_AUTO_WORKERS = 8
#: On a GPU: CPUs left to the training process itself (kernel launches, collation, logging).
ACCELERATOR_HOST_THREADS = 2
#: On a GPU the workers are the only CPU work; past this many, each one's copy of the stream costs
#: more memory than its decoding gains.
MAX_AUTO_WORKERS_ACCELERATOR = 32


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def processes_on_node() -> int:
    """Training processes sharing this machine (``LOCAL_WORLD_SIZE``, set by the launchers), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


#: Thread counts the environment sets, in the order torch honours them.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def environment_threads() -> tuple[int, str] | None:
    """(count, variable) of the first of :data:`THREAD_VARIABLES` set to a positive integer."""
    for name in THREAD_VARIABLES:
        try:
            count = int(os.environ.get(name, "").strip())
        except ValueError:
            continue
        if count >= 1:
            return count, name
    return None


def requested_processes() -> int | None:
    """How many processes ``accelerate launch`` was asked for, read off its command line (this
    process's parent) where it can be; None where it cannot."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as stream:
            words = stream.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return None
    for i, word in enumerate(words):
        for flag in ("--num_processes", "--num-processes"):
            value = words[i + 1] if word == flag and i + 1 < len(words) else None
            value = word.split("=", 1)[1] if word.startswith(flag + "=") else value
            if value is not None and value.strip().isdigit():
                return int(value)
    return None


def launch_warning(world_size: int) -> str | None:
    """A one-line warning when the launcher was asked for several processes but ``world_size``
    (the processes that really run) is 1: ``accelerate launch`` with ``--cpu`` (or without
    ``--multi_gpu``) runs its single-process launcher, which sets ``MASTER_ADDR`` for the processes
    it was asked for but starts one, without ``WORLD_SIZE``."""
    launched_by_accelerate = "ACCELERATE_USE_CPU" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ
    if world_size != 1 or "WORLD_SIZE" in os.environ or not launched_by_accelerate:
        return None
    if "MASTER_ADDR" not in os.environ:
        return None
    asked = requested_processes()
    count = str(asked) if asked else "N"
    return (
        f"warning: accelerate launch was asked for {asked or 'several'} processes but started 1 (with "
        f"--cpu, or without --multi_gpu, it runs a single process); for {count} CPU processes run "
        f"`accelerate launch --multi_gpu --num_processes {count} -m clipkit train ...` (no --cpu; it "
        "uses the CPUs where there is no GPU)"
    )


@dataclass(frozen=True)
class MachineFit:
    """The loader workers and torch threads a run uses, and a one-line notice of what was derived."""

    workers: int
    threads: int
    notice: str


def auto_workers(share: int, accelerator: bool) -> int:
    """Loader workers for a process that may use ``share`` CPUs (see the module docs)."""
    if accelerator:
        return min(MAX_AUTO_WORKERS_ACCELERATOR, max(share // 2, share - ACCELERATOR_HOST_THREADS))
    return min(MAX_AUTO_WORKERS, share // 2)


def fit_to_machine(
    num_workers: int | str, threads: int | str, *, accelerator: bool = False, processes: int | None = None
) -> MachineFit:
    """Resolve ``auto`` values of ``data.num_workers`` / ``train.threads`` (see the module docs);
    ``accelerator``: the model trains on a GPU, so the CPUs mostly decode. ``processes``: how many
    training processes really run (the world size; default: the launcher's ``LOCAL_WORLD_SIZE``).
    The notice says what each process runs with and where the numbers came from."""
    cpus, on_node = usable_cpus(), processes_on_node()
    share = max(1, cpus // on_node)
    workers = auto_workers(share, accelerator) if num_workers == AUTO else int(num_workers)
    environment = environment_threads()
    derived = [f"data.num_workers={workers}"] * (num_workers == AUTO)
    if threads == AUTO and environment is not None:
        count = environment[0]
        derived.append(f"train.threads={count} (from {environment[1]})")
    elif threads == AUTO:
        count = max(1, share - workers)
        derived.append(f"train.threads={count}")
    else:
        count = int(threads)
    processes = on_node if processes is None else processes
    notice = (
        f"machine: {processes} process(es), each with {count} torch thread(s) and {workers} loader "
        f"worker(s); {cpus} usable CPU(s)" + (f" ({share} per process of {on_node})" if on_node > 1 else "")
    )
    if derived:
        notice += f" -> {', '.join(derived)} (set them to override)"
    if threads != AUTO and environment is not None and environment[0] != count:
        notice += f"; train.threads={count} from the recipe overrides {environment[1]}={environment[0]}"
    return MachineFit(workers, count, notice)


def apply(fit: MachineFit, *, announce: bool) -> None:
    """Set torch's intra-op thread count, and print the notice on stderr when ``announce``."""
    import sys

    import torch

    if torch.get_num_threads() != fit.threads:
        torch.set_num_threads(fit.threads)
    if announce and fit.notice:
        print(fit.notice, file=sys.stderr)


def check(value, key: str, minimum: int) -> str | None:
    """A recipe error for ``key`` unless ``value`` is ``auto`` or an int >= ``minimum``."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        return None
    return f"{key}: must be auto or an integer >= {minimum}, got {value!r}"


#: ``train.peak_tflops`` words (clipkit.train.telemetry): look the GPU up by name, or time a matmul.
PEAK_CHOICES = ("auto", "measure")


def peak_problem(value: object) -> str | None:
    """``train.peak_tflops``: "auto" (look up the GPU by name), "measure" (time a matmul at start)
    or a number > 0 (TFLOP/s of one device); a message when it is none of these."""
    if value in PEAK_CHOICES:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return None
    return f"train.peak_tflops: must be auto, measure or a number > 0 (TFLOP/s per device), got {value!r}"
