"""Atomic file writes: a crash leaves either the old file or the new one, never half of one.

Every file clipkit writes goes through this module, so a full disk is handled in one place
(:func:`writing`): whatever the writer was (``torch.save``, safetensors, a tar shard, a JSON file),
running out of space becomes one :class:`DiskFullError` line naming the path, the bytes it needs
and the bytes free there (``shutil.disk_usage``), after the half-written files are removed. What
was complete before (the old file, earlier checkpoints, finished shards) is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from clipkit.errors import ClipkitError

#: errno values that mean "no room left": the disk (ENOSPC) or the user's quota (EDQUOT).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
#: How writers that hide the errno say it: the OS's text, Rust's io::ErrorKind (safetensors).
DISK_FULL_WORDS = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28")
#: torch.save's C++ writer may drop the errno (to a path: "unexpected pos ... basic_ios::clear");
#: such an error is taken for a full disk only when the filesystem has less than NEARLY_FULL left.
ERRNO_LOST = ("unexpected pos", "iostream error", "file write failed")
NEARLY_FULL = 1 << 20


class DiskFullError(ClipkitError):
    """The disk (or quota) filled while writing; the message names the path and the space needed."""


@contextlib.contextmanager
def writing(
    path: Path | str,
    *,
    needed: int | Callable[[], int | None] | None = None,
    remove: Iterable[Path | str] | Callable[[], Iterable[Path | str]] = (),
    kept: str | Callable[[], str] = "",
) -> Iterator[None]:
    """The one disk-full handler: run the block that writes ``path``; if the disk fills, delete
    ``remove`` (the half-written files or directories) and raise :class:`DiskFullError` with the
    bytes ``needed`` (a number or a function estimating it; None: unknown) against the bytes free.
    ``kept`` is appended to the message (what survived, what rerunning does). ``remove`` and
    ``kept`` may be functions, asked only when the disk is full."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not is_disk_full(error, path):
            raise
        leftovers = [Path(p) for p in (remove() if callable(remove) else remove)]
        written = sum(_size(p) for p in leftovers)
        for leftover in leftovers:
            _remove(leftover)
        estimate = needed() if callable(needed) else needed
        note = kept() if callable(kept) else kept
        raise DiskFullError(disk_full_message(path, estimate, written, note)) from error


def is_disk_full(error: BaseException, path: Path | str) -> bool:
    """Whether ``error`` (or an error it wraps) means the filesystem of ``path`` is full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        text = str(current).lower()
        if any(words in text for words in DISK_FULL_WORDS):
            return True
        if any(words in text for words in ERRNO_LOST):  # torch.save's C++ writer: errno lost
            free = free_bytes(path)
            if free is not None and free < NEARLY_FULL:
                return True
        current = current.__cause__ or current.__context__
    return False


def free_bytes(path: Path | str) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def disk_full_message(path: Path | str, needed: int | None, written: int, kept: str = "") -> str:
    free = free_bytes(path)
    have = "an unknown amount" if free is None else human_bytes(free)
    if needed is not None and needed > 0:
        want = f"it needs about {human_bytes(needed)}, {have} free there"
    else:
        want = f"it needs more than the {human_bytes(written)} it had written, {have} free there"
    removed = "; the partial files were removed" if written else ""
    tail = f"; {kept}" if kept else ""
    return f"{path}: no space left on the device: {want}{removed}{tail}"


def human_bytes(count: int) -> str:
    """``123456789`` -> ``"117.7 MiB (123456789 bytes)"``: readable, with the exact figure."""
    value, unit = float(count), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, name
    return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({count} bytes)"


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a (nested) state: what ``torch.save``/safetensors will write,
    give or take headers; tensors sharing storage count once."""
    import torch

    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            key = (item.untyped_storage().data_ptr(), item.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def directory_bytes(path: Path | str) -> int:
    return _size(Path(path))


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: Path | str, *, needed: int | Callable[[], int | None] | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` if the block succeeds
    (a full disk: :class:`DiskFullError`, the temporary removed, the old ``path`` kept)."""
    path = Path(path)
    with writing(path, needed=needed):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        try:
            with writing(path, needed=needed, remove=[Path(temporary)]):
                yield Path(temporary)
                os.chmod(temporary, 0o666 & ~current_umask())  # mkstemp makes 0600; give what open() would
                _fsync(temporary)
                os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path, needed=len(text.encode("utf-8"))) as temporary:
        temporary.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_directory(
    path: Path | str, *, needed: int | Callable[[], int | None] | None = None, kept: str = ""
) -> Iterator[Path]:
    """Build a directory under a temporary name; it replaces ``path`` only when complete (a full
    disk: :class:`DiskFullError`, the temporary removed, an old ``path`` kept)."""
    path = Path(path)
    with writing(path, needed=needed, kept=kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            with writing(path, needed=needed, remove=[temporary], kept=kept):
                yield temporary
                os.chmod(temporary, 0o777 & ~current_umask())  # mkdtemp makes 0700; give what mkdir() would
                default_permissions(temporary)
                replace_directory(temporary, path)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)


def write_durably(path: Path | str, write: Callable[[object], None], mode: str = "wb") -> None:
    """Open ``path``, ``write(stream)``, flush and fsync: for files inside a directory that is
    itself renamed into place when complete (checkpoints), under the disk-full handler of that
    directory's writer."""
    with open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as stream:
        write(stream)
        stream.flush()
        os.fsync(stream.fileno())


def fsync_directory(directory: Path | str) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories can't be opened."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


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


def check_output_path(
    path: Path | str, what: str = "output", *, file: bool = False, directory: bool = False
) -> None:
    """The one check of an output path before any work starts: every existing part of ``path``
    above it is a directory, and the directory it will be created in (or ``path`` itself, when it
    is an existing directory) accepts a new file. A ClipkitError naming the path otherwise — a file
    where a folder is needed (``file.txt/sub``), a read-only folder or file system; with ``file``,
    a directory where the file is to be written; with ``directory``, a file where the folder is to be."""
    path = Path(path)
    if file and path.is_dir():
        raise ClipkitError(f"{what} {path} is a directory; name a file to write")
    if directory and path.exists() and not path.is_dir():
        raise ClipkitError(f"{what} {path} is a file, not a directory; pick another path")
    probe = path if path.is_dir() else path.parent
    missing = []
    while not probe.exists():
        if probe.is_symlink():
            raise ClipkitError(f"{what} {path}: {probe} is a broken symbolic link; pick another path")
        missing.append(probe)
        if probe == probe.parent:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ClipkitError(
            f"{what} {path}: {probe} is a file, not a directory, so nothing can be written under it; "
            "pick another path"
        )
    if path.exists() and not path.is_dir() and not os.access(path, os.W_OK):
        raise ClipkitError(f"{what} {path}: the file is read-only; pick another path")
    problem = not_writable(probe)
    if problem:
        raise ClipkitError(f"{what} {path}: cannot write in {probe} ({problem}); pick another path")


def not_writable(directory: Path) -> str | None:
    """Why a new file cannot be created in ``directory`` (read-only file system, no permission),
    found by creating (and removing) one, or None."""
    try:
        handle, name = tempfile.mkstemp(prefix=".clipkit-probe-", dir=directory)
    except OSError as error:
        if error.errno in DISK_FULL_ERRNOS:
            return None  # room is the disk-full handler's business (it names the bytes needed)
        return error.strerror or str(error)
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def current_umask() -> int:
    """The process umask (reading it means setting it; it is restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
