"""WebDataset records of one tar read as a stream (no seeking), from wherever it lives.

A record is ``{"__key__", "__url__", field: bytes, ...}``: consecutive members sharing a key (the
path up to the first dot of the file name, as WebDataset groups them) with their extensions as
fields. A shard that cannot be opened, breaks off, or is not a valid tar raises
:class:`~clipkit.data.remote.ShardUnavailable` with the reason it is counted under.

Traffic is counted as it happens (:class:`Traffic`): bytes *fetched* from the source (file, HTTP
body, pipe, object store: what came in below the read buffer, read-ahead included) and bytes
*read* by the tar reader (headers, members, padding). A tar read to its end is drained to the end
of the stream, so a whole shard counts exactly its size.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from clipkit.data.remote import (
    FSSPEC_BLOCK,
    OPENING,
    TRANSPORT_ERRORS,
    Patience,
    RangeIgnored,
    ShardUnavailable,
    open_shard,
    redact,
    scheme_of,
    stream_size,
    transport_fault,
)
from clipkit.data.tar_index import MEMBER_NAME, load_index, record_starts
from clipkit.data.tar_members import (
    CompressedTar,
    TarMembers,
    compressed_tar_message,
    local_compression,
)
from clipkit.errors import DataError

READ_BUFFER = 1 << 20

#: ``meter(kind, count)``: ``count`` more bytes of ``kind`` ("read" or "fetched").
Meter = Callable[[str, int], None]


class Traffic:
    """Bytes read and fetched per source (an int: the source's place in the mixture) by this
    process (one loader worker) so far; :meth:`take` hands over what came since the last take."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def meter(self, source: int) -> Meter:
        def count(kind: str, number: int) -> None:
            self.counts[(source, kind)] += number

        return count

    def take(self) -> dict[int, dict[str, int]]:
        """{source: {"read": bytes, "fetched": bytes}} since the last take."""
        taken: dict[int, dict[str, int]] = {}
        for (source, kind), number in self.counts.items():
            taken.setdefault(source, {"read": 0, "fetched": 0})[kind] = number
        self.counts.clear()
        return taken


class CountedSource(io.RawIOBase):
    """A readable stream whose bytes are counted as ``fetched`` as they come in; for an fsspec
    file, the bytes its block cache asked the store for (read-ahead included). ``limit``: the
    bytes it gives at most (a window of the file), None: to its end."""

    def __init__(self, inner, meter: Meter, limit: int | None = None) -> None:
        self.inner, self.meter, self.requested, self.left = inner, meter, 0, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.left is not None:
            if self.left <= 0:
                return 0
            buffer = memoryview(buffer)[: self.left]
        count = self.inner.readinto(buffer)
        if self.left is not None:
            self.left -= count or 0
        # A block cache counts what it asked the store for; without one ("none"), what is read was
        # fetched.
        cache = getattr(self.inner, "cache", None)
        requested = getattr(cache, "total_requested_bytes", None)
        if isinstance(requested, int) and getattr(cache, "name", "none") != "none":
            self.meter("fetched", requested - self.requested)
            self.requested = requested
        else:
            self.meter("fetched", count or 0)
        return count

    def close(self) -> None:
        if not self.closed:
            self.inner.close()
        super().close()


class CountedReader:
    """The buffered stream the tar reader reads, its bytes counted as ``read``."""

    def __init__(self, inner, meter: Meter) -> None:
        self.inner, self.meter = inner, meter

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.meter("read", len(data))
        return data

    def drain(self) -> None:
        """Read to the end of the stream (the tar's end blocks and padding)."""
        while self.read(READ_BUFFER):
            pass

    def close(self) -> None:
        self.inner.close()


def ignore(kind: str, count: int) -> None:
    del kind, count


def seekable(url: str) -> bool:
    """A local file: a segment starting mid-shard without an index finds its first member by
    reading the headers before it (:func:`member_offset`)."""
    return scheme_of(url) == ""


@dataclass(frozen=True)
class Window:
    """The bytes [start, end) of a tar to read (``end`` None: to its end) and ``keys``, the keys of
    the records expected there in order, as far as known (each is checked); ``drop``: records to
    read and drop first (where no offset is known); ``size``: the tar's bytes the offsets were
    taken from; ``records``: how many it holds when ``end`` is set."""

    start: int = 0
    end: int | None = None
    keys: tuple[str, ...] = ()
    drop: int = 0
    size: int | None = None
    records: int | None = None

    @property
    def located(self) -> bool:
        """Entered or left mid-tar by offsets (a shortcut that is checked as it is read)."""
        return self.start > 0 or self.end is not None

    def expects(self, position: int, key: str) -> bool:
        return position >= len(self.keys) or self.keys[position] == key


def locate(url: str, skip: int, stop: int | None, patience: Patience, meter: Meter) -> Window | None:
    """Where records [skip, stop) of the tar at ``url`` lie: from its index
    (:mod:`clipkit.data.tar_index`) when it has one, else, for a local tar, from its headers
    (the start only); else the records before ``skip`` are read and dropped. None: a local tar
    with fewer records than ``skip`` (nothing to give)."""
    if skip == 0 and stop is None:
        return Window()
    index = load_index(url, patience, meter) if scheme_of(url) != "pipe" else None
    if index is not None and skip < len(index):
        bounded = stop is not None and stop < len(index)
        end, records = (index.offsets[stop], stop - skip) if bounded else (None, None)
        return Window(index.offsets[skip], end, index.keys[skip:], size=index.size, records=records)
    if skip and seekable(url):
        return member_offset(url, skip, meter)
    return Window(drop=skip)


def tar_records(
    url: str, patience: Patience = Patience(), meter: Meter = ignore, skip: int = 0, stop: int | None = None
) -> Iterator[dict[str, Any]]:
    """The records [skip, stop) of the tar at ``url`` (``stop`` None: to its end), in tar order
    (close the generator to stop early); ``meter`` counts the bytes fetched and read. Only the
    records' own bytes are read where :func:`locate` knows where they lie; with ``stop``, the
    caller takes at most stop - skip records.

    Offsets are a shortcut, checked as the records come: where the tar does not match its index
    (another size, a record with another key, a window that breaks off or holds too few records)
    or the server ignores ``Range``, the tar is read again from its start and the records already
    given are dropped — so a stale index costs bytes, never samples.

    Every failure — opening, the transport (any of :data:`~clipkit.data.remote.TRANSPORT_ERRORS`),
    the archive itself, a ``pipe:`` command's exit status — is a ShardUnavailable. A tar read to
    its end is read to the end of its stream too, so a ``pipe:`` command's exit status (and an
    HTTP body's true length) is always checked, also after a complete archive, and the whole file
    is counted."""
    try:
        window = locate(url, skip, stop, patience, meter)
    except TRANSPORT_ERRORS as error:
        raise transport_fault(url, error, OPENING) from None
    if window is None:
        return
    given = 0
    if window.located:
        records = window_records(url, patience, meter, window)
        try:
            for record in records:
                if not window.expects(given, record["__key__"]):
                    break  # another record than the index says: the index is stale
                given += 1
                yield record
            else:
                if window.records is None or given >= window.records:
                    return  # the window held what was located there
        except ShardUnavailable as error:
            if not isinstance(error, RangeIgnored) and error.reason != "corrupt_tar":
                raise  # the transport failed: not the index's doing
        finally:
            records.close()
        window = Window(drop=skip + given)  # read from the start; what was given is dropped
    records = window_records(url, patience, meter, window)
    try:
        yield from itertools.islice(records, window.drop, None)
    finally:
        records.close()


def window_records(url: str, patience: Patience, meter: Meter, window: Window) -> Iterator[dict[str, Any]]:
    """The records in ``window`` of the tar at ``url`` (see :func:`tar_records`)."""
    try:
        raw = open_shard(url, patience, window.start, window.end)
    except TRANSPORT_ERRORS as error:
        raise transport_fault(url, error, OPENING) from None
    if window.size is not None and stream_size(raw) not in (None, window.size):
        raw.close()  # the tar changed since its index was written: nothing located is valid
        raise RangeIgnored(url, "corrupt_tar", "the tar does not match its index")
    # fsspec backends raise their own types mid-read (botocore, aiohttp): all are transport faults.
    faults = (Exception,) if hasattr(raw, "fs") else TRANSPORT_ERRORS
    limit = None if window.end is None else window.end - window.start
    # An fsspec window without a cache: each buffer fill is one request, so fill a block at a time.
    buffer = FSSPEC_BLOCK if hasattr(raw, "fs") and window.end is not None else READ_BUFFER
    stream = CountedReader(io.BufferedReader(CountedSource(raw, meter, limit), buffer), meter)
    try:
        yield from group_members(url, stream, bounded=window.end is not None)
        stream.drain()  # only reached once the tar's last record is taken: count the whole file
    except ShardUnavailable:
        raise
    except CompressedTar as error:
        raise compressed_tar(url, error.kind) from None
    except (tarfile.TarError, EOFError) as error:
        raise ShardUnavailable(
            url, "corrupt_tar", f"not a readable tar ({type(error).__name__}: {error})"
        ) from error
    except faults as error:
        raise transport_fault(url, error) from error
    finally:
        with contextlib.suppress(*TRANSPORT_ERRORS):  # failing to close must not hide what happened
            stream.close()


def group_members(url: str, stream, bounded: bool = False) -> Iterator[dict[str, Any]]:
    """The records of the tar ``stream``; a ShardUnavailable (``corrupt_tar``) after the last whole
    record when the archive breaks off where a member header should be.

    A tar reader ends an archive at a missing or partial header without an error (only at offset 0
    is it one), so a shard cut at or inside a member header would read as a shorter, valid one:
    here the block read where the next header was expected must be whole (tar's end-of-archive
    block). A ``bounded`` stream (a window ending at a record's first header) may end just there.
    A damaged member header is an error too (:mod:`clipkit.data.tar_members`)."""
    record: dict[str, Any] = {}
    members = TarMembers(stream)
    for name, data in members:
        match = MEMBER_NAME.match(name)
        if match is None:
            continue
        key, field = match.group(1), match.group(2).lower()
        if record and record["__key__"] != key:
            yield record
            record = {}
        if not record:
            record = {"__key__": key, "__url__": url}
        record[field] = data
    if record:
        yield record
    ending = members.ending  # bytes of the block where a header was expected
    if ending < tarfile.BLOCKSIZE and not (bounded and ending == 0):
        raise ShardUnavailable(
            url,
            "corrupt_tar",
            f"truncated: it ends where a member header should be ({ending} of its 512 bytes there)",
        )


class CountedFile:
    """A local file read with seeks (tar headers only), its bytes counted as read and fetched."""

    def __init__(self, inner, meter: Meter) -> None:
        self.inner, self.meter = inner, meter

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.meter("read", len(data))
        self.meter("fetched", len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()


def member_offset(url: str, record: int, meter: Meter) -> Window | None:
    """Where the ``record``-th record of the local tar at ``url`` starts (its first header block),
    found by reading the headers only (tarfile seeks over the data); None when the tar has fewer
    records."""
    try:
        with open(url, "rb") as raw, tarfile.open(fileobj=CountedFile(raw, meter), mode="r:") as tar:
            for seen, (key, offset) in enumerate(record_starts(tar)):
                if seen == record:
                    return Window(offset, keys=(key,))
    except OSError as error:
        raise ShardUnavailable(url, "unreachable", str(error)) from error
    except (tarfile.TarError, EOFError, ValueError) as error:
        kind = local_compression(url)
        if kind is not None:
            raise compressed_tar(url, kind) from None
        raise ShardUnavailable(
            url, "corrupt_tar", f"not a readable tar ({type(error).__name__}: {error})"
        ) from error
    return None


#: Each kind of stream: the suffix it usually has and the command that decompresses it.
def compressed_tar(url: str, kind: str) -> DataError:
    """The refusal of a compressed shard: a stream cannot be read from a record's offset, so the
    loader reads plain tars only, while ``clipkit shard webdataset:`` reads compressed ones (and
    writes plain ones). A refusal, not a skipped shard: every sample in it would be lost unseen."""
    return DataError(compressed_tar_message(redact(url), kind))


def check_local_shards(paths: list[str]) -> None:
    """Refuse (:func:`compressed_tar`) a local shard that is compressed before anything is read
    from the set, rather than when a loader worker meets it mid-epoch; reads one block of each."""
    for path in paths:
        kind = local_compression(path)
        if kind is not None:
            raise compressed_tar(path, kind)
