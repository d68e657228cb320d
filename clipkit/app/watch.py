"""Watching a run: the run-level hooks around training, and the command line's ``logging`` set-up.

:func:`watching` tells plugins that a run starts (``on_run_start``: the resolved recipe, the first
step), hands them the end-of-run eval results (``on_evals``) and says how the run ended
(``on_run_end``: "finished", "stopped" by a signal, or "failed"). Per-step numbers reach plugins
through ``on_metrics``, called by the loop. Experiment trackers (:mod:`clipkit.plugins.loggers.trackers`)
and the plain-text step lines (:mod:`clipkit.plugins.loggers.progress_log`) are plugins on these hooks.
Only the main process calls them, as the loop does for ``on_metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from clipkit.config.dotted import get_path

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class RunEvents:
    """What :func:`watching` yields: ``evals(results)`` passes the final eval results on."""

    trainer: object

    def evals(self, results: list[dict]) -> None:
        trainer = self.trainer
        if trainer.runtime.is_main:
            step = int(get_path(trainer.recipe, "train.steps") or 0)
            trainer.registry.pm.hook.on_evals(step=step, results=results, run=trainer.run)


@contextlib.contextmanager
def watching(trainer) -> Iterator[RunEvents]:
    """``on_run_start`` now, ``on_run_end`` when the block ends (with how it ended)."""
    from clipkit.train.stop import TrainingStopped

    hook, is_main = trainer.registry.pm.hook, trainer.runtime.is_main
    if is_main:
        hook.on_run_start(run=trainer.run, recipe=trainer.recipe, start_step=trainer.start_step)
    status = "failed"
    try:
        yield RunEvents(trainer)
        status = "finished"
    except TrainingStopped:
        status = "stopped"
        raise
    finally:
        if is_main:
            hook.on_run_end(run=trainer.run, status=status)


def configure_logging(level: str = "info") -> None:
    """The command line's logging: ``LEVEL time name: message`` lines on stderr (where SLURM and
    nohup logs collect them), and Python warnings routed through ``logging`` (logger ``py.warnings``),
    so third-party warnings carry a time and obey ``--log-level``."""
    from clipkit.errors import ClipkitError

    if level.lower() not in LOG_LEVELS:
        raise ClipkitError(f"--log-level {level!r}: use one of {', '.join(LOG_LEVELS)}")
    handler = StderrHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "clipkit", False)]:
        root.removeHandler(old)  # configured twice in one process (tests): one handler only
    handler.clipkit = True
    root.addHandler(handler)
    # clipkit's own loggers get the level asked for; other libraries stay at WARNING or above,
    # or `--log-level info` would print every INFO line of Accelerate, DeepSpeed, MLflow...
    number = logging.getLevelName(level.upper())
    root.setLevel(max(number, logging.WARNING))
    logging.getLogger("clipkit").setLevel(number)
    logging.captureWarnings(True)


class RedactingFormatter(logging.Formatter):
    """Log lines with every URL's query values and user info hidden (signed URLs carry tokens)."""

    def format(self, record: logging.LogRecord) -> str:
        from clipkit.errors import redact_text

        return redact_text(super().format(record))


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it per command)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr
