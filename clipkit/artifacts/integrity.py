"""sha256 checksums of artifact files, recorded when written and checked when read.

Exports record their weight files in ``clipkit.json``; checkpoints record every file in
``checkpoint.json``. Checksums detect damage (a flipped byte, a truncated copy, a file from another
run), not tampering: whoever can rewrite a file can rewrite its checksum too. Safety against crafted
files comes from never unpickling them (:mod:`clipkit.artifacts.safe_load`).

What a load does is set once per command by :func:`loading` (the CLI's ``--no-verify`` and
``--trust-checkpoint``), so the code between the command and the file need not pass flags along.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from clipkit.errors import ArtifactError, IntegrityError

log = logging.getLogger(__name__)
CHUNK = 1 << 20


@dataclass(frozen=True)
class LoadPolicy:
    """How artifacts are read: ``verify`` checksums; ``trust_checkpoint`` allows unpickling."""

    verify: bool = True
    trust_checkpoint: bool = False


DEFAULT = LoadPolicy()
_POLICY: contextvars.ContextVar[LoadPolicy | None] = contextvars.ContextVar(
    "clipkit_load_policy", default=None
)


def policy() -> LoadPolicy:
    """The policy of the current command (verify, never unpickle, unless a caller said otherwise)."""
    return _POLICY.get() or DEFAULT


@contextlib.contextmanager
def loading(*, verify: bool | None = None, trust_checkpoint: bool | None = None) -> Iterator[LoadPolicy]:
    """Read artifacts under this policy inside the block; None keeps the enclosing block's choice
    (``api.train`` exports and evaluates under the policy its caller chose)."""
    current = policy()
    token = _POLICY.set(
        LoadPolicy(
            verify=current.verify if verify is None else verify,
            trust_checkpoint=current.trust_checkpoint if trust_checkpoint is None else trust_checkpoint,
        )
    )
    try:
        yield policy()
    finally:
        _POLICY.reset(token)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (weights can be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict]:
    """``{name: {"sha256": ..., "bytes": ...}}`` for files relative to ``directory``."""
    directory = Path(directory)
    return {
        name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
        for name in sorted(names)
    }


def verify_files(
    directory: Path, recorded: dict, *, where: Path, what: str, required: Iterable[str] = ()
) -> None:
    """Raise :class:`IntegrityError` naming the first file that is missing, resized or altered, or
    that is ``required`` (a file the reader will load) but has no checksum in ``recorded``.

    ``where`` is the file holding the checksums (named in the message); ``what`` says what the
    directory is ("export", "checkpoint") for the advice. Only an artifact with no checksum record
    at all (written before checksums existed) may load unverified: see :func:`warn_unverified`.
    """
    if not isinstance(recorded, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) for entry in recorded.values()
    ):
        raise IntegrityError(f"{where}: its file checksums are malformed; the {what} cannot be verified")
    for name in sorted(set(required) - set(recorded)):
        listed = ", ".join(sorted(recorded)) or "none"
        raise IntegrityError(
            f"{Path(directory) / name}: no checksum in {where.name} (files listed: {listed}); the {what} "
            f"cannot be verified: write it again, or pass --no-verify to load it anyway"
        )
    directory = Path(directory)
    for name, entry in sorted(recorded.items()):
        path = contained(directory, name, where=where, entry="files entry", what=what)
        if not path.is_file():
            raise IntegrityError(f"{path}: missing (listed in {where.name}); the {what} is incomplete")
        size = path.stat().st_size
        if "bytes" in entry and size != entry["bytes"]:
            raise IntegrityError(
                f"{path}: {size} bytes, {entry['bytes']} when written (truncated or replaced); "
                f"the {what} is damaged: copy it again or use another {what}"
            )
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise IntegrityError(
                f"{path}: sha256 mismatch (recorded {entry['sha256'][:16]}…, found {actual[:16]}…): the file "
                f"was damaged or edited after it was written; copy it again, use another {what}, or pass "
                f"--no-verify to load it anyway"
            )


def contained(root: Path, name: str, *, where: Path, entry: str, what: str) -> Path:
    """``root / name``, refused unless it stays inside ``root`` once resolved (``..``, absolute paths
    and symlinks leading out included): a crafted export or checkpoint must not make clipkit read,
    hash or print anything of another file. ``where`` (the file naming it) and ``entry`` are named."""
    root = Path(root)
    base = root.resolve()
    target = (root / name).resolve() if isinstance(name, str) and name and "\0" not in name else None
    if target is None or not (target == base or base in target.parents):
        raise ArtifactError(
            f"{where}: {entry} {name!r} points outside the {what} ({root}); refused — every file "
            f"an {what} names must be inside it"
        )
    return root / name


_ARTIFACT: contextvars.ContextVar[tuple[Path, Path] | None] = contextvars.ContextVar(
    "clipkit_artifact", default=None
)


@contextlib.contextmanager
def reading_artifact(root: Path, where: Path) -> Iterator[None]:
    """Inside the block plugins build from an artifact's metadata (``where``, e.g. an export's
    ``clipkit.json``): the files their arguments name are read from inside ``root`` only
    (:func:`plugin_file`)."""
    token = _ARTIFACT.set((Path(root), Path(where)))
    try:
        yield
    finally:
        _ARTIFACT.reset(token)


def artifact_root() -> Path | None:
    """The artifact being read (:func:`reading_artifact`), or None."""
    current = _ARTIFACT.get()
    return current[0] if current else None


def plugin_file(value: str, argument: str) -> Path:
    """The file a plugin argument (e.g. a tokenizer's ``vocab``) names: as given (``~`` expanded)
    from a recipe; relative to the export and contained in it while one is read."""
    current = _ARTIFACT.get()
    if current is None:
        return Path(value).expanduser()
    root, where = current
    return contained(root, value, where=where, entry=argument, what="export")


def warn_unverified(path: Path, what: str) -> None:
    """One line on stderr (through logging) for artifacts written before checksums existed."""
    log.warning("warning: %s has no checksums (written by an older clipkit); %s not verified", path, what)
