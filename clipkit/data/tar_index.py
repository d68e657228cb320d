"""Where each record of a shard starts: the index clipkit writes beside every shard it makes.

``shard-NNNNNN.tar.idx`` (JSON, ``clipkit-tar-index/1``) lists, for every record of the tar in
order, its key and the byte offset of its first member header, and the tar's size in bytes.
A loader lane that starts or ends inside a shard (:mod:`clipkit.data.epoch_plan`) reads only its
own byte range with it: a local file seeks, HTTP asks for a ``Range``, an fsspec file seeks — so
a streamed epoch fetches each byte once even where lanes cut shards. Without an index (shards
other tools wrote, ``pipe:`` commands) a lane reads the records before its first and drops
them, as a tar stream must; ``clipkit shard DIR --index`` (:func:`index_directory`) writes the
indexes for any directory of tars.

An index is only a shortcut, never trusted for the data
(:func:`clipkit.data.tar_stream.tar_records`): a tar whose size differs from the index's, a record
with another key than the index's, a window that breaks off or holds too few records, or a server
that ignores ``Range``, and the tar is read from its start instead.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from clipkit.data.remote import Patience, ShardUnavailable, read_small, scheme_of
from clipkit.errors import DataError

#: A tar member's name -> (key, field): the key is the path up to the first dot of the file name,
#: as WebDataset groups members into records (``webdataset.tariterators.base_plus_ext``).
MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
INDEX_FORMAT = "clipkit-tar-index/1"
INDEX_SUFFIX = ".idx"
#: Indexes kept per process: a lane enters at most a few shards mid-way per epoch.
CACHED_INDEXES = 64


@dataclass(frozen=True)
class TarIndex:
    """``keys[i]`` and ``offsets[i]``: record i's key and the offset of its first header block;
    ``size``: the tar's bytes (what a stale index is told apart by)."""

    keys: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int

    def __len__(self) -> int:
        return len(self.keys)


def index_path(shard: Path) -> Path:
    """The index beside a local shard: ``shard-000000.tar`` -> ``shard-000000.tar.idx``."""
    return shard.with_name(shard.name + INDEX_SUFFIX)


def index_url(url: str) -> str | None:
    """The index beside the shard at ``url`` (the suffix goes on the path, before a query); None
    for a ``pipe:`` command, which names no file."""
    scheme = scheme_of(url)
    if scheme == "pipe":
        return None
    if scheme == "":
        return url + INDEX_SUFFIX
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path + INDEX_SUFFIX))


def record_starts(tar: tarfile.TarFile) -> Iterator[tuple[str, int]]:
    """(key, offset of its first header block) of each record of ``tar`` (opened ``"r:"``: tarfile
    seeks over the members' data, so only headers are read), grouped as the loader groups them:
    consecutive file members sharing a key."""
    key = None
    while (member := tar.next()) is not None:
        match = MEMBER_NAME.match(member.name)
        if not member.isfile() or match is None or match.group(1) == key:
            continue
        key = match.group(1)
        yield key, member.offset


def index_tar(path: Path) -> TarIndex:
    """The index of the local tar at ``path``, from its headers; ``tarfile.ReadError`` when the tar
    is cut short (inside a member, or where a header or its end blocks should be: tarfile itself
    would end such an archive silently, and the loader refuses it as truncated)."""
    size = path.stat().st_size
    with tarfile.open(path, mode="r:") as tar:
        starts = list(record_starts(tar))
        end = tar.offset  # where the end-of-archive block was read (past the file when cut)
    if size - end < tarfile.BLOCKSIZE:
        raise tarfile.ReadError(
            f"truncated: it ends at byte {size}, where a member or its end blocks should be"
        )
    return TarIndex(tuple(k for k, _ in starts), tuple(o for _, o in starts), size)


def index_directory(directory: Path) -> list[Path]:
    """Write the index beside every ``.tar`` in ``directory`` (shards another tool, or a clipkit
    before indexes, wrote); the indexes written. Every readable tar is indexed (each index whole or
    not at all); the unreadable ones — cut short, damaged, compressed — are then an
    :class:`UnindexedTars` naming each, as ``--verify`` names every problem, not only the first."""
    from clipkit.errors import DataError

    if not Path(directory).is_dir():
        raise DataError(f"{directory}: not a directory (--index writes the indexes of the tars in one)")
    tars = sorted(path for path in Path(directory).glob("*.tar") if path.is_file())
    if not tars:
        raise DataError(f"{directory}: no .tar files to index")
    written, problems = [], []
    for tar in tars:
        try:
            index = index_tar(tar)
        except (tarfile.TarError, OSError, EOFError) as error:
            problems.append(unreadable_tar(tar, error))
            continue
        written.append(write_index(tar, list(index.keys), list(index.offsets), index.size))
    if problems:
        raise UnindexedTars(Path(directory), len(tars), written, problems)
    return written


def unreadable_tar(tar: Path, error: BaseException) -> str:
    """Why ``tar`` has no index: what a compressed one is (the loader cannot read it either), or
    the reader's error."""
    from clipkit.data.tar_members import compressed_tar_message, local_compression

    kind = local_compression(str(tar))
    if kind is not None:
        return f"{compressed_tar_message(str(tar), kind)}; not indexed"
    return f"{tar}: not a readable tar ({type(error).__name__}: {error}); not indexed"


class UnindexedTars(DataError):
    """Tars ``--index`` could not read; ``written``: the indexes of the others, ``problems``: one
    line per unreadable tar, naming it."""

    def __init__(self, directory: Path, total: int, written: list[Path], problems: list[str]) -> None:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        super().__init__(
            f"{directory}: {len(problems)} of {total} tar(s) not indexed: {shown} "
            f"(the other {len(written)} are: their indexes were written)"
        )
        self.written, self.problems = written, problems


def encode_index(keys: list[str], offsets: list[int], size: int) -> str:
    return json.dumps({"format": INDEX_FORMAT, "size": size, "keys": keys, "offsets": offsets}) + "\n"


def write_index(shard: Path, keys: list[str], offsets: list[int], size: int) -> Path:
    """Write the index of ``shard`` (``size`` bytes) durably, through a temporary file renamed into
    place; the writer does so before it renames the shard itself into place, so a finished shard
    always has its index."""
    target = index_path(shard)
    temporary = target.with_name(target.name + ".tmp")
    try:
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(encode_index(keys, offsets, size))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk: nothing half-written stays behind
        raise
    return target


def parse_index(body: bytes) -> TarIndex | None:
    """The index in ``body``; None when it is not a well-formed one (then it is not used)."""
    try:
        data = json.loads(body)
        keys, offsets, size = data["keys"], data["offsets"], data["size"]
    except (ValueError, TypeError, KeyError):
        return None
    well_formed = (
        data.get("format") == INDEX_FORMAT
        and isinstance(size, int)
        and isinstance(keys, list)
        and isinstance(offsets, list)
        and len(keys) == len(offsets)
        and all(isinstance(key, str) for key in keys)
        and all(isinstance(offset, int) for offset in offsets)
        and all(0 <= a < b for a, b in zip(offsets, offsets[1:] + [size], strict=True))
    )
    return TarIndex(tuple(keys), tuple(offsets), size) if well_formed else None


_cache: collections.OrderedDict[str, TarIndex | None] = collections.OrderedDict()


def forget() -> None:
    """Drop the indexes loaded so far (the next use fetches them again)."""
    _cache.clear()


def load_index(url: str, patience: Patience, meter) -> TarIndex | None:
    """The index beside the shard at ``url`` (fetched once per process; its bytes counted as
    fetched), or None where there is none, it cannot be fetched or is malformed."""
    if url in _cache:
        _cache.move_to_end(url)
        return _cache[url]
    where = index_url(url)
    try:
        body = read_small(where, patience) if where is not None else None
    except (ShardUnavailable, OSError):
        body = None
    if body is not None:
        meter("fetched", len(body))
    index = parse_index(body) if body is not None else None
    _cache[url] = index
    if len(_cache) > CACHED_INDEXES:
        _cache.popitem(last=False)
    return index
