"""Atomic file writes: a crash leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from clipkit.errors import ClipkitError


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


@dataclass(frozen=True)
class OutputKind:
    """What clipkit writes into one kind of output directory: ``names`` (fnmatch patterns) are its
    files; ``marker``, when set, must be there too. A directory holding only these is clipkit's own
    output of this kind (a re-export, a re-shard) and may be replaced; anything else is the user's."""

    what: str
    names: tuple[str, ...]
    marker: str | None = None

    def foreign(self, directory: Path) -> list[str]:
        """The entries of ``directory`` clipkit did not write (all of them when the marker is missing)."""
        entries = {entry.name: entry.is_file() for entry in directory.iterdir()}
        if self.marker is not None and not entries.get(self.marker):
            return sorted(entries)
        own = lambda name: entries[name] and any(fnmatch.fnmatchcase(name, p) for p in self.names)  # noqa: E731
        return sorted(name for name in entries if not own(name))


@dataclass(frozen=True)
class Kept:
    """A path an output directory never replaces: the directory may not be it or hold it, nor (when
    ``inside``) lie inside it."""

    path: Path | str
    what: str
    inside: bool = True


#: What a refused output directory's message tells the user to do (commands with ``--overwrite``).
OVERWRITE_REMEDY = (
    "pick another output directory, or pass --overwrite to replace the folder and everything in it"
)


def claim_output_directory(
    path: Path | str,
    kind: OutputKind,
    *,
    overwrite: bool = False,
    protect: Iterable[Kept] = (),
    remedy: str = OVERWRITE_REMEDY,
) -> None:
    """The one check before an output directory is (re)written: ClipkitError unless ``path`` is
    absent, empty, clipkit's own output of ``kind`` or ``overwrite`` is set. ``remedy`` ends the
    message (a command without ``--overwrite`` says what to do instead).

    ``protect``: paths never replaced, ``--overwrite`` or not (the run being exported, its
    checkpoints, the source being sharded); see :class:`Kept`.
    """
    path = Path(path)
    target = path.resolve()
    for kept in protect:
        kept_path = Path(kept.path).resolve()
        relation = (
            "is" if target == kept_path
            else "contains" if target in kept_path.parents
            else "is inside" if kept.inside and kept_path in target.parents
            else None
        )  # fmt: skip
        if relation:
            raise ClipkitError(
                f"{path} {relation} {kept.what} ({kept_path}): the {kind.what} is never written there, "
                "--overwrite or not; pick another output directory"
            )
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise ClipkitError(f"{path} exists and is not a directory; pick another output directory")
    foreign = kind.foreign(path)
    if foreign and not overwrite:
        listed = ", ".join(foreign[:3]) + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
        raise ClipkitError(
            f"{path} already exists and holds files that are not a clipkit {kind.what} ({listed}); "
            f"writing the {kind.what} would delete them: {remedy}"
        )


def current_umask() -> int:
    """The process umask (reading it means setting it; it is restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
