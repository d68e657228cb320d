"""Plain-text step lines for runs nobody watches on a terminal (SLURM, nohup, CI logs).

On a terminal the command line draws a progress bar; otherwise each ``on_metrics`` call (every
``train.log_every`` steps) becomes one INFO line of the logger ``clipkit.progress``::

    step 200/1000  loss 3.2011  lr 0.000125  samples/s 812.4  samples/s/device 406.2  MFU 41.3%
    data wait 2.1%  step 315 ms (fwd 98 / bwd 190 / opt 21)  peak 12.3 GiB  ETA 0:05:12

(one line in the log; wrapped here)
(the telemetry fields of :mod:`clipkit.train.telemetry`, those the run logged: MFU only with a
known device peak).

Evaluations during training (``eval/...`` metrics) get a line of their own. The ETA extrapolates
this process's pace since its first step (a resumed run counts from where it resumed).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from clipkit.config.dotted import get_path
from clipkit.contract.hookspecs import hookimpl

log = logging.getLogger("clipkit.progress")
#: Per run directory: total steps, first step of this process, when it started.
_runs: dict[str, dict[str, Any]] = {}


def to_terminal() -> bool:
    """Whether stderr is a terminal (then the progress bar shows the same numbers)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


@hookimpl
def on_run_start(run, recipe, start_step):
    steps = int(get_path(recipe, "train.steps") or 0)
    _runs[str(run.directory)] = {"total": steps, "first": start_step, "started": time.monotonic()}


@hookimpl
def on_run_end(run, status):
    _runs.pop(str(run.directory), None)


@hookimpl
def on_metrics(step, metrics, run):
    if not run.is_main or to_terminal() or not log.isEnabledFor(logging.INFO):
        return
    if "loss" in metrics:
        log.info(step_line(step, metrics, _runs.get(str(run.directory))))
    elif evals := {k: v for k, v in metrics.items() if k.startswith("eval/")}:
        log.info("step %d  %s", step, "  ".join(f"{k} {number(v)}" for k, v in evals.items()))


def step_line(step: int, metrics: dict[str, Any], run: dict[str, Any] | None) -> str:
    """``step S/T  loss L  lr R  samples/s N  ETA H:MM:SS`` (total and ETA when known)."""
    total = run["total"] if run else 0
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for key, label in (("loss", "loss"), ("lr", "lr"), ("samples_per_s", "samples/s")):
        if key in metrics:
            parts.append(f"{label} {number(metrics[key])}")
    parts += telemetry_parts(metrics)
    if run and total and step > run["first"]:
        per_step = (time.monotonic() - run["started"]) / (step - run["first"])
        parts.append(f"ETA {duration(per_step * max(total - step, 0))}")
    return "  ".join(parts)


#: The step's phases in the log line: (telemetry key without ``_ms``, label).
PHASES = (("forward", "fwd"), ("backward", "bwd"), ("forward_backward", "fwd+bwd"), ("optimizer", "opt"))


def telemetry_parts(metrics: dict[str, Any]) -> list[str]:
    """The step telemetry, short: samples/s/device, MFU, data wait, step split, peak memory."""
    parts = []
    if isinstance(metrics.get("compile_warmup_s"), float):
        parts.append(f"compile warm-up {metrics['compile_warmup_s']:.1f} s")
    if isinstance(metrics.get("samples_per_s_per_device"), float):
        parts.append(f"samples/s/device {metrics['samples_per_s_per_device']:.4g}")
    for key, label in (("mfu", "MFU"), ("data_wait_share", "data wait")):
        if isinstance(metrics.get(key), float):
            parts.append(f"{label} {100 * metrics[key]:.1f}%")
    if isinstance(metrics.get("step_ms"), float):
        phases = [(label, metrics.get(f"{key}_ms")) for key, label in PHASES]
        split = " / ".join(f"{label} {value:.0f}" for label, value in phases if isinstance(value, float))
        parts.append(f"step {metrics['step_ms']:.0f} ms" + (f" ({split})" if split else ""))
    for key in ("gpu_peak_gib", "cpu_peak_rss_gib"):
        if isinstance(metrics.get(key), float):
            parts.append(f"peak {metrics[key]:.3g} GiB")
    return parts


def number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
