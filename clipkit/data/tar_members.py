"""The regular files of a tar read as a stream: ``(name, bytes)`` in archive order.

What Python's ``tarfile`` does in stream mode (``"r|"``), for the headers clipkit's own shards are
made of, at a fraction of its CPU: a ustar (or v7) header of a regular file is parsed here — its
checksum summed in C, its name, prefix and size read — instead of building a ``TarInfo`` from
every field (``tarfile``'s checksum alone unpacks 504 single bytes). Reading a shard's records takes
0.23x the CPU of ``tarfile``'s reading at 48 px and 0.39x at 224 px (``benchmarks/tar_reader.py``,
docs/benchmarks.md).

Everything else keeps ``tarfile``'s own behaviour, because it is ``tarfile`` that reads it: the
first header that is not a plain regular file (a PAX or GNU extended header, a GNU long name, a
link, a directory, a base-256 size) hands the rest of the archive over to it. The stream is read in
the chunks ``tarfile`` reads it in (``tarfile.RECORDSIZE``), so the same bytes are read (and
counted by a metering reader) either way.

One difference, on purpose: a member header whose checksum is wrong after the first member is an
error (``tarfile.ReadError``), where ``tarfile`` ends the archive there without one — which read a
shard with one damaged header as a shorter, valid shard and dropped every record after it.

A compressed stream where the archive should start (a ``.tar.gz`` renamed ``.tar``) is
:class:`CompressedTar`, which says what it is: this reader, like the loader, reads plain tars only.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

BLOCK = tarfile.BLOCKSIZE
#: What ``tarfile``'s stream mode asks its file for at a time.
CHUNK = tarfile.RECORDSIZE
ZERO_BLOCK = bytes(BLOCK)
#: Header types of a regular file (``tarfile.REGULAR_TYPES``): "0", the old NUL, contiguous "7".
REGULAR = (b"0", b"\0", b"7")
#: Magic numbers of the compressed streams ``tarfile`` reads (``clipkit shard webdataset:`` does).
COMPRESSIONS = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


class CompressedTar(tarfile.ReadError):
    """A compressed stream where a tar should start; ``kind`` is "gzip", "bzip2" or "xz"."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"a {kind}-compressed stream, not a tar")
        self.kind = kind


def compression(head: bytes) -> str | None:
    """The compression of a file starting with ``head`` (its first block, or what there is of it):
    None when it is a tar (a first header that checks out) or starts with no known magic number.
    The header is checked first, so a tar whose first member is named "BZh..." stays a tar."""
    try:
        if len(head) >= BLOCK and regular_file(head[:BLOCK], 0) is not None:
            return None
    except tarfile.TarError:
        pass  # not a header: look for a magic number
    return next((kind for magic, kind in COMPRESSIONS.items() if head.startswith(magic)), None)


#: Per compression: the name such a tar usually has, and the command that decompresses it.
DECOMPRESS = {"gzip": (".tar.gz", "gunzip"), "bzip2": (".tar.bz2", "bunzip2"), "xz": (".tar.xz", "unxz")}


def compressed_tar_message(shown: str, kind: str) -> str:
    """What is said of the compressed tar ``shown`` (its path or redacted URL): the loader reads
    plain tars only; how to decompress it, or that ``clipkit shard webdataset:`` reads it."""
    suffix, command = DECOMPRESS[kind]
    return (
        f"{shown} is a {kind}-compressed tar, not a plain one (a {suffix} under another name?): the loader "
        f"reads uncompressed tars only; decompress it ({command} < {shown} > plain.tar) or shard the set "
        "with `clipkit shard webdataset:PATH OUT`, which reads it"
    )


def local_compression(path: str) -> str | None:
    """The compression of the local file at ``path`` (None: a tar, unknown, or unreadable)."""
    try:
        with open(path.removeprefix("file://"), "rb") as stream:
            return compression(stream.read(BLOCK))
    except OSError:
        return None


def check_uncompressed(head: bytes) -> None:
    """:class:`CompressedTar` when ``head``, the first bytes of what should be a tar, is compressed."""
    kind = compression(head)
    if kind is not None:
        raise CompressedTar(kind)


class TarMembers:
    """Iterate for ``(name, data)`` of each regular file of the tar in ``stream`` (anything with
    ``read(n)``); afterwards :attr:`ending` is the number of bytes of the block read where the next
    header was expected (512: an end-of-archive block; 0: the stream ended right there; between:
    it broke off inside a header).

    Raises ``tarfile.ReadError`` as ``tarfile`` does (an empty or cut first header, a member's data
    or padding cut short) and on a damaged member header (see the module docs)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.buffer = b""  # pulled from the stream, consumed up to self.at
        self.at = 0
        self.position = 0  # bytes of the archive consumed
        self.ending = 0

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes (fewer at the end of the stream), pulled in CHUNKs as needed."""
        end = self.at + size
        if end > len(self.buffer):
            parts, have = [self.buffer[self.at :]], len(self.buffer) - self.at
            while have < size:
                chunk = self.stream.read(CHUNK)
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
            self.buffer, self.at, end = b"".join(parts), 0, size
        taken = self.buffer[self.at : end]
        self.at += len(taken)
        self.position += len(taken)
        return taken

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        while True:
            offset = self.position
            block = self.take(BLOCK)
            if len(block) < BLOCK or block == ZERO_BLOCK:  # the end, whole or cut
                if offset == 0 and len(block) < BLOCK:
                    check_uncompressed(block)  # a small compressed file is shorter than a block
                    raise tarfile.ReadError("empty file" if not block else "truncated header")
                self.ending = self.position - offset
                return
            try:
                header = regular_file(block, offset)
            except tarfile.TarError:
                if offset == 0:
                    check_uncompressed(block)  # say what it is rather than "bad checksum"
                raise
            if header is None:  # anything else: tarfile reads the rest, from this header on
                yield from self.rest_by_tarfile(block)
                return
            name, size = header
            data = self.take(size)
            if len(data) < size:
                raise tarfile.ReadError("unexpected end of data")
            padding = -size % BLOCK
            if len(self.take(padding)) < padding:  # tarfile checks the byte before the next header
                raise tarfile.ReadError("unexpected end of data")
            yield name, data

    def rest_by_tarfile(self, block: bytes) -> Iterator[tuple[str, bytes]]:
        """The regular files from ``block`` (a header just taken) on, read by ``tarfile``."""
        rest = _Prefixed(block + self.buffer[self.at :], self.stream)
        self.buffer, self.at = b"", 0
        with tarfile.open(fileobj=rest, mode="r|") as tar:
            for member in tar:
                if member.isfile():
                    yield member.name, tar.extractfile(member).read()
            self.ending = tar.fileobj.pos - tar.offset


def regular_file(block: bytes, offset: int) -> tuple[str, int] | None:
    """(name, size) of the 512-byte header ``block`` when it is a regular file's plain header;
    None for any other kind of header. A wrong checksum is a ``tarfile.ReadError``."""
    checksum = tarfile.nti(block[148:156])
    # tarfile's unsigned sum (the checksum field counted as eight spaces), then its signed one.
    if checksum != sum(block) - sum(block[148:156]) + 256 and checksum not in tarfile.calc_chksums(block):
        raise tarfile.ReadError(f"bad checksum in the member header at byte {offset}")
    kind = block[156:157]
    if kind not in REGULAR or block[124] & 0x80:  # another type, or a base-256 size
        return None
    name = _text(block[0:100])
    if kind == b"\0" and name.endswith("/"):  # v7's directory
        return None
    prefix = _text(block[345:500])
    if prefix:  # ustar's split long name (as tarfile joins it)
        name = f"{prefix}/{name}"
    return name, tarfile.nti(block[124:136])


def _text(field: bytes) -> str:
    """A NUL-terminated header field, decoded as tarfile's stream mode decodes names."""
    end = field.find(b"\0")
    return (field if end < 0 else field[:end]).decode(tarfile.ENCODING, "surrogateescape")


class _Prefixed:
    """``prefix`` then the rest of ``stream``, read with ``read(n)``."""

    def __init__(self, prefix: bytes, stream) -> None:
        self.prefix, self.stream = prefix, stream

    def read(self, size: int = -1) -> bytes:
        if not self.prefix:
            return self.stream.read(size)
        if size < 0:
            data, self.prefix = self.prefix + self.stream.read(), b""
            return data
        data, self.prefix = self.prefix[:size], self.prefix[size:]
        return data
