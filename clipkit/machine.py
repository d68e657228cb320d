"""Defaults that fit the machine: loader workers and torch threads from the CPUs this process may use.

``data.num_workers: auto`` and ``train.threads: auto`` (the defaults) are derived from
``os.sched_getaffinity`` — the CPUs the process may run on (a container's or ``taskset``'s limit,
not the host's count) — shared among the processes of this node (``LOCAL_WORLD_SIZE`` under
``torchrun`` / ``accelerate launch``). Training on the CPU, half of a process's CPUs decode images
(at most :data:`MAX_AUTO_WORKERS`) and the rest run torch's intra-op threads. Training on a GPU,
the model's arithmetic is not on the CPU: all but :data:`ACCELERATOR_HOST_THREADS` CPUs decode (at
most :data:`MAX_AUTO_WORKERS_ACCELERATOR`) — measured on an H200 with 16 cores, 8 workers fed a
ViT-B/16 bf16 step at 0.82x of what it consumes, 16 at 1.28x (docs/benchmarks.md, "GPU").
A number set in the recipe is kept.
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


def fit_to_machine(num_workers: int | str, threads: int | str, *, accelerator: bool = False) -> MachineFit:
    """Resolve ``auto`` values of ``data.num_workers`` / ``train.threads`` (see the module docs);
    ``accelerator``: the model trains on a GPU, so the CPUs mostly decode."""
    cpus, processes = usable_cpus(), processes_on_node()
    share = max(1, cpus // processes)
    workers = auto_workers(share, accelerator) if num_workers == AUTO else int(num_workers)
    count = max(1, share - workers) if threads == AUTO else int(threads)
    derived = [f"data.num_workers={workers}"] * (num_workers == AUTO) + [f"train.threads={count}"] * (
        threads == AUTO
    )
    notice = ""
    if derived:
        per = f" ({share} per process of {processes})" if processes > 1 else ""
        notice = f"machine: {cpus} usable CPU(s){per} -> {', '.join(derived)} (set them to override)"
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
