"""WebDataset records of one tar read as a stream (no seeking), from wherever it lives.

A record is ``{"__key__", "__url__", field: bytes, ...}``: consecutive members sharing a key (the
path up to the first dot of the file name, as WebDataset groups them) with their extensions as
fields. A shard that cannot be opened, breaks off, or is not a valid tar raises
:class:`~clipkit.data.remote.ShardUnavailable` with the reason it is counted under.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterator
from typing import Any

from clipkit.data.remote import Patience, ShardUnavailable, open_shard

MEMBER_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
READ_BUFFER = 1 << 20


def tar_records(url: str, patience: Patience = Patience()) -> Iterator[dict[str, Any]]:
    """The records of the tar at ``url``, in tar order (close the generator to stop early)."""
    raw = open_shard(url, patience)
    stream = (
        raw
        if isinstance(raw, io.BufferedIOBase) or hasattr(raw, "fs")
        else io.BufferedReader(raw, READ_BUFFER)
    )
    try:
        yield from group_members(url, stream)
    except ShardUnavailable:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        raise ShardUnavailable(
            url, "corrupt_tar", f"not a readable tar ({type(error).__name__}: {error})"
        ) from error
    finally:
        stream.close()


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
