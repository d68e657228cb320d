"""One training run per run directory: an exclusive ``fcntl`` lock on ``RUN/.clipkit.lock``.

Two ``clipkit train`` processes given the same ``--run-dir`` would otherwise write the same
checkpoints and interleave one ``metrics.jsonl``. The first holds the lock for its whole run
(training, export, evaluation) and writes its pid into the file; a second one refuses at once,
naming the run directory and that pid. The kernel drops the lock when its holder exits, kill -9
included (a POSIX record lock: forked DataLoader workers do not inherit it), so a crashed run never
blocks ``--resume``; the file itself stays (deleting it would let two later runs lock two different
files). Under ``accelerate launch``/``torchrun`` only process 0 takes it (the other processes of one
launch belong to the same run). Where the file system cannot lock (some network mounts) the run
goes on unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from clipkit.errors import ClipkitError

LOCK = ".clipkit.lock"
log = logging.getLogger("clipkit.train")


class RunDirectoryBusy(ClipkitError):
    """Another process is training in this run directory."""


@contextlib.contextmanager
def run_directory_lock(run_dir: Path | str, *, enabled: bool = True) -> Iterator[None]:
    """Hold ``RUN/.clipkit.lock`` inside the block (creating ``run_dir``); RunDirectoryBusy when another
    live process holds it. ``enabled=False`` (processes other than 0 of a launch) takes no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX (Windows)
        fcntl = None
    if not enabled or fcntl is None:
        yield
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    handle = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            # A POSIX record lock (lockf), not flock: it belongs to this process alone, so DataLoader
            # workers forked while it is held do not keep it alive after the run ends or fails.
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            holder = os.pread(handle, 64, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunDirectoryBusy(
                f"{run_dir} is in use by another clipkit train (pid {holder}); wait for it to finish "
                "(or stop it), or pick another --run-dir"
            ) from None
        except OSError as error:  # ENOLCK / EOPNOTSUPP: no locks on this file system
            log.warning("%s: cannot lock (%s); nothing stops a second run in this directory",
                        path, error.strerror or error)  # fmt: skip
        else:
            os.ftruncate(handle, 0)
            os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases the lock
