"""What a ``register_commands`` plugin needs from the host: one error path and the registry.

The CLI's own commands use the same two helpers, so a plugin's command behaves like a built-in
one (a :class:`~clipkit.errors.ClipkitError` is one red line and exit code 2, no traceback).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
import traceback

import click
import typer

from clipkit.errors import ClipkitError, redact_text

#: ``clipkit --debug`` (or CLIPKIT_DEBUG=1): user-facing errors also print their traceback.
DEBUG = {"on": False}


def debugging() -> bool:
    return DEBUG["on"] or os.environ.get("CLIPKIT_DEBUG", "") not in ("", "0")


def fails_cleanly(command):
    """Report user-facing errors as one message and exit code 2 (a graceful stop: 128 + signal),
    without a traceback unless --debug."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ClipkitError as error:
            if debugging():
                traceback.print_exception(error, file=sys.stderr)
            typer.secho(f"error: {redact_text(str(error))}", fg="red", err=True)  # no URL secret shown
            # 2 for bad input; a graceful stop on a signal exits 128 + signal (clipkit.train.stop).
            raise typer.Exit(getattr(error, "exit_code", 2)) from None
        except Exception as error:
            if isinstance(error, typer.Exit | click.exceptions.ClickException):
                raise
            loop = symlink_loop(error)
            if loop is not None:
                typer.secho(
                    f"error: {loop}: a symbolic link loop (a link that leads back to itself); "
                    "fix or remove the link",
                    fg="red",
                    err=True,
                )
                raise typer.Exit(2) from None
            if not interrupted(error):
                raise
            # A second Ctrl-C in the middle of a file write (torch.save turns it into its own
            # RuntimeError as the file is closed): the stop the user asked for, not a crash.
            typer.secho(
                "error: interrupted by a second signal while a file was being written; what was written "
                "whole is intact (checkpoints are published only when complete)",
                fg="red",
                err=True,
            )
            raise typer.Exit(130) from None

    return wrapper


def symlink_loop(error: BaseException) -> str | None:
    """The path of the symbolic link loop ``error`` reports (pathlib's ``RuntimeError("Symlink loop
    from '...'")`` before Python 3.13, an ``OSError`` with ``ELOOP`` from the OS), else None."""
    if isinstance(error, OSError) and error.errno == errno.ELOOP:
        return str(error.filename)
    found = re.fullmatch(r"Symlink loop from '(.*)'", str(error)) if isinstance(error, RuntimeError) else None
    return found.group(1) if found else None


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` was raised while a KeyboardInterrupt was being handled (its cause or
    context chain holds one)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


def registry():
    from clipkit.contract.registry import default_registry

    return default_registry()
