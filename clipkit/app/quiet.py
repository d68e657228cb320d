"""Quiet runs: warnings raised inside third-party packages go to a debug log, not the terminal.

A normal ``clipkit`` command prints only clipkit's own output. Python warnings whose origin is
outside clipkit (torch, webdataset, PIL, accelerate, ...) are written, with their origin, to the
debug log: ``$CLIPKIT_DEBUG_LOG``, else ``$XDG_CACHE_HOME/clipkit/debug.log`` (``~/.cache``),
created on the first one. ``CLIPKIT_DEBUG=1`` shows them on stderr instead. Warnings from
clipkit's own code (and anything it raises) are shown as usual.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

LOGGER = "clipkit.debug"
#: clipkit/ and plugins/ (this file is clipkit/app/quiet.py).
PACKAGE_DIRS = tuple(str(Path(__file__).resolve().parents[2] / name) for name in ("clipkit", "plugins"))


def debug_log_path() -> Path:
    explicit = os.environ.get("CLIPKIT_DEBUG_LOG")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "clipkit" / "debug.log"


class LazyFileHandler(logging.FileHandler):
    """A file handler that creates its directory and file only when the first record arrives."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def is_third_party(filename: str) -> bool:
    return not str(Path(filename).resolve()).startswith(PACKAGE_DIRS)


def route_third_party_warnings() -> logging.Logger:
    """Install the routing (idempotent); returns the debug logger."""
    logger = logging.getLogger(LOGGER)
    if getattr(warnings.showwarning, "clipkit_routed", False):
        return logger
    if not logger.handlers:
        debug = os.environ.get("CLIPKIT_DEBUG", "").lower() in ("1", "true", "yes")
        handler = logging.StreamHandler() if debug else LazyFileHandler(debug_log_path(), delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if is_third_party(filename):
            logger.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            shown(message, category, filename, lineno, file, line)

    showwarning.clipkit_routed = True
    warnings.showwarning = showwarning
    return logger
