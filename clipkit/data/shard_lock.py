"""One writer per shard directory: an exclusive ``fcntl`` lock on ``OUT.lock``, beside ``OUT``.

Two ``clipkit shard`` (or ``clipkit train``, which shards its recipe's source on first use) runs
given the same output would otherwise both write ``OUT.partial/`` and tear each other's files
away. With the lock the second waits for the first, then finds ``OUT`` complete and reuses it
(after checking it against its manifest) instead of writing it again.

The lock file stays after the run (deleting it would let a third process lock a file the second
one has already opened and lose mutual exclusion). The kernel drops the lock when its holder
exits, kill -9 included, so a crashed writer never leaves the directory locked. Where the file
system does not support ``flock`` (some network mounts), the run continues unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("clipkit.data.shard")


def lock_path(out_dir: Path) -> Path:
    """``OUT.lock``: a sibling of ``OUT`` (not inside it: ``OUT`` is replaced by a rename)."""
    return out_dir.with_name(out_dir.name + ".lock")


@contextlib.contextmanager
def output_lock(out_dir: Path | str) -> Iterator[bool]:
    """Hold the exclusive lock of ``out_dir`` inside the block; yields whether another process
    held it first (and this one waited for it to finish)."""
    try:
        import fcntl
    except ImportError:  # not POSIX (Windows): no flock
        log.warning("no fcntl on this platform: %s is written without a lock", out_dir)
        yield False
        return
    path = lock_path(Path(out_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        waited = acquire(handle, path, fcntl)
        yield waited
    finally:
        os.close(handle)  # closing the descriptor releases the lock


def acquire(handle: int, path: Path, fcntl) -> bool:
    """Take the lock, waiting (and saying so) while another process holds it; True if it waited."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        pass
    except OSError as error:  # ENOLCK / EOPNOTSUPP: no locks on this file system
        log.warning("%s: cannot lock (%s); continuing without protection from concurrent writers",
                    path, error.strerror or error)  # fmt: skip
        return False
    log.warning("%s is held by another process writing the same shards; waiting for it to finish", path)
    started = time.monotonic()
    fcntl.flock(handle, fcntl.LOCK_EX)
    log.info("%s: lock acquired after %.1f s", path, time.monotonic() - started)
    return True
