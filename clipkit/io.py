"""Atomic file writes: a crash leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(temporary)
        os.chmod(temporary, 0o666 & ~current_umask())  # mkstemp makes 0600; give what open() would
        _fsync(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_directory(path: Path | str) -> Iterator[Path]:
    """Build a directory under a temporary name; it replaces ``path`` only when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield temporary
        os.chmod(temporary, 0o777 & ~current_umask())  # mkdtemp makes 0700; give what mkdir() would
        default_permissions(temporary)
        replace_directory(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def default_permissions(directory: Path) -> None:
    """Give every file under ``directory`` the mode ``open()`` would under the umask (executables
    keep their x bits). Writers that go through a temporary file (safetensors) leave 0600."""
    umask = current_umask()
    for root, directories, files in os.walk(directory):
        for name in directories:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            file = os.path.join(root, name)
            executable = os.stat(file).st_mode & 0o100
            os.chmod(file, (0o777 if executable else 0o666) & ~umask)


def replace_directory(finished: Path, target: Path) -> None:
    """Rename ``finished`` to ``target``; an existing ``target`` is moved aside first, so a crash
    between the renames loses neither (the old one survives as ``.NAME.old``)."""
    if target.exists():
        aside = target.with_name(f".{target.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
        os.replace(finished, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(finished, target)


def current_umask() -> int:
    """The process umask (reading it means setting it; it is restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
