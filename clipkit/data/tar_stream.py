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
import re
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

from clipkit.data.remote import (
    OPENING,
    TRANSPORT_ERRORS,
    Patience,
    ShardUnavailable,
    open_shard,
    scheme_of,
    transport_fault,
)

MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
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
    file, the bytes its block cache asked the store for (read-ahead included)."""

    def __init__(self, inner, meter: Meter) -> None:
        self.inner, self.meter, self.requested = inner, meter, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self.inner.readinto(buffer)
        requested = getattr(getattr(self.inner, "cache", None), "total_requested_bytes", None)
        if isinstance(requested, int):
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
    """A local file: a segment starting mid-shard seeks to its first member instead of reading
    the members before it."""
    return scheme_of(url) == ""


def tar_records(
    url: str, patience: Patience = Patience(), meter: Meter = ignore, skip: int = 0
) -> Iterator[dict[str, Any]]:
    """The records of the tar at ``url``, in tar order (close the generator to stop early), from
    its ``skip``-th on (only for a :func:`seekable` one); ``meter`` counts the bytes fetched and read.

    Every failure — opening, the transport (any of :data:`~clipkit.data.remote.TRANSPORT_ERRORS`),
    the archive itself, a ``pipe:`` command's exit status — is a ShardUnavailable. A tar read to
    its end is read to the end of its stream too, so a ``pipe:`` command's exit status (and an
    HTTP body's true length) is always checked, also after a complete archive, and the whole file
    is counted."""
    try:
        offset = member_offset(url, skip, meter) if skip else 0
        raw = open_shard(url, patience)
    except TRANSPORT_ERRORS as error:
        raise transport_fault(url, error, OPENING) from None
    if offset is None:  # fewer records than skip: nothing to give (the caller counts it short)
        raw.close()
        return
    if offset:
        raw.seek(offset)
    # fsspec backends raise their own types mid-read (botocore, aiohttp): all are transport faults.
    faults = (Exception,) if hasattr(raw, "fs") else TRANSPORT_ERRORS
    stream = CountedReader(io.BufferedReader(CountedSource(raw, meter), READ_BUFFER), meter)
    try:
        yield from group_members(url, stream)
        stream.drain()  # only reached once the tar's last record is taken: count the whole file
    except ShardUnavailable:
        raise
    except (tarfile.TarError, EOFError) as error:
        raise ShardUnavailable(
            url, "corrupt_tar", f"not a readable tar ({type(error).__name__}: {error})"
        ) from error
    except faults as error:
        raise transport_fault(url, error) from error
    finally:
        with contextlib.suppress(*TRANSPORT_ERRORS):  # failing to close must not hide what happened
            stream.close()


def group_members(url: str, stream) -> Iterator[dict[str, Any]]:
    """The records of the tar ``stream``; a ShardUnavailable (``corrupt_tar``) after the last whole
    record when the archive breaks off where a member header should be.

    tarfile ends an archive silently at a missing or partial header (only at offset 0 is it an
    error), so a shard cut at or inside a member header would read as a shorter, valid one: here
    the block read where the next header was expected must be whole (tar's end-of-archive block)."""
    record: dict[str, Any] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            match = MEMBER_NAME.match(member.name)
            if not member.isfile() or match is None:
                continue
            key, field = match.group(1), match.group(2).lower()
            if record and record["__key__"] != key:
                yield record
                record = {}
            if not record:
                record = {"__key__": key, "__url__": url}
            record[field] = tar.extractfile(member).read()
        ending = tar.fileobj.pos - tar.offset  # bytes of the block where a header was expected
    if record:
        yield record
    if ending < tarfile.BLOCKSIZE:
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


def member_offset(url: str, record: int, meter: Meter) -> int | None:
    """Byte offset of the first member (its first header block) of the ``record``-th record of
    the local tar at ``url``, found by reading the headers only (tarfile seeks over the data);
    None when the tar has fewer records."""
    try:
        with open(url, "rb") as raw, tarfile.open(fileobj=CountedFile(raw, meter), mode="r:") as tar:
            key, seen = None, -1
            while (member := tar.next()) is not None:
                match = MEMBER_NAME.match(member.name)
                if not member.isfile() or match is None or match.group(1) == key:
                    continue
                key, seen = match.group(1), seen + 1
                if seen == record:
                    return member.offset
    except OSError as error:
        raise ShardUnavailable(url, "unreachable", str(error)) from error
    except (tarfile.TarError, EOFError, ValueError) as error:
        raise ShardUnavailable(
            url, "corrupt_tar", f"not a readable tar ({type(error).__name__}: {error})"
        ) from error
    return None
