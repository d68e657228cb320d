"""Graceful stop: SIGTERM or SIGINT during training finishes the step, checkpoints and exits.

SLURM (``#SBATCH --signal=TERM@120``), Kubernetes and most schedulers send SIGTERM some time before
they kill a job; Ctrl-C sends SIGINT. The first such signal only sets a flag; the loop checks it
after each optimiser step (:func:`requested`), and all processes of a launch agree on it through
one collective, so they stop after the same step even if the signal reached only some of them.
:func:`stop` then writes a checkpoint for that step (unless one was just written), tells how to
resume, and raises :class:`TrainingStopped` (exit code 128 + signal: 143 for SIGTERM, 130 for
SIGINT). A second signal stops at once: SIGINT raises ``KeyboardInterrupt``, SIGTERM kills the
process as if no handler were installed.

Handlers are installed only around the loop (:func:`handling_signals`) and only in the main
thread (Python delivers signals there); elsewhere the flag simply never rises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from clipkit.errors import ClipkitError

log = logging.getLogger("clipkit.train.loop")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: The first signal received while handlers are installed (None: none yet).
_received: int | None = None
#: The process that installed the handlers; data-loader workers forked from it inherit them.
_owner: int | None = None
#: A signal the loop never acted on: it came after the last step's check (see :func:`after_the_loop`).
_unanswered: int | None = None


class TrainingStopped(ClipkitError):
    """Training stopped on a signal after writing a checkpoint; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int, step: int, checkpoint: Path) -> None:
        super().__init__(message)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum


def received() -> int | None:
    """The signal number that asked this process to stop, or None."""
    return _received


def _handle(signum: int, frame) -> None:
    global _received
    if os.getpid() != _owner:
        return  # a forked data-loader worker: the main process stops and shuts it down
    if _received is None:
        _received = signum
        log.warning(
            "received %s: finishing this step, then writing a checkpoint and stopping "
            "(send it again to stop at once, without a checkpoint)",
            signal.Signals(signum).name,
        )
        return
    # Second signal: give up on a clean stop.
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """Inside the block, SIGTERM/SIGINT request a graceful stop; the previous handlers come back
    afterwards. A no-op outside the main thread."""
    global _received, _owner, _unanswered
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _received, _owner, _unanswered = None, os.getpid(), None
    for signum in SIGNALS:
        signal.signal(signum, _handle)
    try:
        yield
        _unanswered = _received  # the block ended normally: a signal it got was never acted on
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received = None


def after_the_loop(run_dir: Path, step: int) -> None:
    """Raise :class:`TrainingStopped` when a stop signal came after the loop's last check (during
    its last step): the run's final checkpoint is written, and the export and evaluation that
    would follow are skipped, as the signal asked (a scheduler's SIGTERM gives little time)."""
    from clipkit.train.checkpoint import latest_checkpoint

    global _unanswered
    signum, _unanswered = _unanswered, None
    if signum is None:
        return
    path = latest_checkpoint(run_dir)
    raise TrainingStopped(
        f"training finished its last step ({step}) as {signal.Signals(signum).name} arrived; checkpoint "
        f"{path}. The export and evaluation were skipped: run `clipkit export {shlex.quote(str(run_dir))} "
        f"{shlex.quote(str(Path(run_dir) / 'export'))}` for them",
        signum,
        step,
        path,
    )


def requested(runtime) -> bool:
    """Whether any process of the launch received a stop signal. Every process must call this
    after the same step (it is one small all-reduce under several processes)."""
    return not runtime.all_true(_received is None)


def stop(trainer, step: int, save: Callable[[object, int], Path]) -> None:
    """Checkpoint ``step`` with ``save(trainer, step)`` unless that checkpoint exists, say how to
    resume, and raise :class:`TrainingStopped`. Every process calls this (checkpoints are
    collective)."""
    from clipkit.train.checkpoint import final_dir

    path = final_dir(trainer.run.directory, step)
    if not path.is_dir():
        path = save(trainer, step)
    # A process the signal did not reach stops with its peers, as if it had got SIGTERM.
    signum = _received or signal.SIGTERM
    message = (
        f"training stopped by {signal.Signals(signum).name} after step {step}; checkpoint {path}. "
        f"Resume with: {resume_command(trainer.run.recipe, trainer.run.directory)}"
    )
    raise TrainingStopped(message, signum, step, path)


def resume_command(recipe: str, run_dir: Path) -> str:
    """The command line that continues the run (``--resume`` reads the saved recipe)."""
    program = "clipkit" if Path(sys.argv[0]).name == "clipkit" else "python -m clipkit"
    return f"{program} train {shlex.quote(recipe)} --resume --run-dir {shlex.quote(str(run_dir))}"
