"""WebDataset records of one tar read as a stream (no seeking), from wherever it lives.

A record is ``{"__key__", "__url__", field: bytes, ...}``: consecutive members sharing a key (the
path up to the first dot of the file name, as WebDataset groups them) with their extensions as
fields. A shard that cannot be opened, breaks off, or is not a valid tar raises
:class:`~clipkit.data.remote.ShardUnavailable` with the reason it is counted under.
"""

from __future__ import annotations

import contextlib
import io
import re
import tarfile
from collections.abc import Iterator
from typing import Any

from clipkit.data.remote import (
    OPENING,
    TRANSPORT_ERRORS,
    Patience,
    ShardUnavailable,
    open_shard,
    transport_fault,
)

MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
READ_BUFFER = 1 << 20


def tar_records(url: str, patience: Patience = Patience()) -> Iterator[dict[str, Any]]:
    """The records of the tar at ``url``, in tar order (close the generator to stop early).

    Every failure — opening, the transport (any of :data:`~clipkit.data.remote.TRANSPORT_ERRORS`),
    the archive itself, a ``pipe:`` command's exit status — is a ShardUnavailable. A tar read to
    its end is read to the end of its stream too, so a ``pipe:`` command's exit status (and an
    HTTP body's true length) is always checked, also after a complete archive."""
    try:
        raw = open_shard(url, patience)
    except TRANSPORT_ERRORS as error:
        raise transport_fault(url, error, OPENING) from None
    stream = (
        raw
        if isinstance(raw, io.BufferedIOBase) or hasattr(raw, "fs")
        else io.BufferedReader(raw, READ_BUFFER)
    )
    # fsspec backends raise their own types mid-read (botocore, aiohttp): all are transport faults.
    faults = (Exception,) if hasattr(raw, "fs") else TRANSPORT_ERRORS
    try:
        yield from group_members(url, stream)
        drain(stream)
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


def drain(stream) -> None:
    """Read ``stream`` to its end (the tar's zero padding), so its reader sees the end of input."""
    while stream.read(READ_BUFFER):
        pass


def group_members(url: str, stream) -> Iterator[dict[str, Any]]:
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
    if record:
        yield record
