"""clipkit.data.tar_members against Python's tarfile (the reader it stands in for): the same
members, the same bytes pulled from the stream, the same end of archive and the same errors, for
every tar format tarfile writes and for a tar cut at every byte; a damaged member header is an
error where tarfile ended the archive silently."""

from __future__ import annotations

import io
import tarfile

import pytest

from clipkit.data.remote import ShardUnavailable
from clipkit.data.tar_members import CHUNK, TarMembers
from clipkit.data.tar_stream import tar_records


class Pulled(io.RawIOBase):
    """A byte string read with ``read(n)``, remembering every size asked for."""

    def __init__(self, data: bytes) -> None:
        self.source, self.asked, self.given = io.BytesIO(data), [], 0

    def read(self, size: int = -1) -> bytes:
        self.asked.append(size)
        data = self.source.read(size)
        self.given += len(data)
        return data


def reference(data: bytes) -> tuple[list[tuple[str, bytes]], int, Pulled]:
    """What tarfile's stream mode reads: the regular files, the ending (the bytes of the block
    where the next header was expected) and the stream it read."""
    stream = Pulled(data)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
        ending = tar.fileobj.pos - tar.offset
    return members, ending, stream


def fast(data: bytes) -> tuple[list[tuple[str, bytes]], int, Pulled]:
    stream = Pulled(data)
    reader = TarMembers(stream)
    members = list(reader)
    return members, reader.ending, stream


def outcome(read, data: bytes):
    try:
        members, ending, stream = read(data)
    except tarfile.TarError as error:
        return type(error).__name__, str(error)
    return members, ending, stream.given


def make_tar(format: int, members: list[tuple[str, bytes]], extra=(), mtime=0) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(payload), mtime
            tar.addfile(info, io.BytesIO(payload))
        for info in extra:
            tar.addfile(info)
    return buffer.getvalue()


SAMPLES = [
    ("000000.png", bytes(range(256)) * 9),
    ("000000.txt", b"a red square"),
    ("000000.json", b'{"i": 0}'),
    ("000001.png", b""),  # an empty member: no data block
    ("000001.txt", b"x" * 512),  # exactly one block: no padding
    ("dir/sub/000002.txt", "ünïcode".encode()),
]
LONG_NAME = "a/" + "b" * 120 + "/000003.txt"  # ustar splits it into prefix + name; v7 cannot


def link(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = "000000.txt" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
    return info


TARS = {
    "ustar": make_tar(tarfile.USTAR_FORMAT, [*SAMPLES, (LONG_NAME, b"long")]),
    "pax-per-member (float mtime)": make_tar(tarfile.PAX_FORMAT, SAMPLES, mtime=0.5),
    "pax long name": make_tar(tarfile.PAX_FORMAT, [*SAMPLES, ("c" * 300 + ".txt", b"pax")]),
    "gnu long name": make_tar(tarfile.GNU_FORMAT, [*SAMPLES, ("d" * 300 + ".txt", b"gnu")]),
    "links and a directory after files": make_tar(
        tarfile.USTAR_FORMAT,
        SAMPLES,
        extra=[link("l.txt", tarfile.SYMTYPE), link("h.txt", tarfile.LNKTYPE), link("d", tarfile.DIRTYPE)],
    ),
    "empty archive": make_tar(tarfile.USTAR_FORMAT, []),
}


@pytest.mark.parametrize("kind", list(TARS))
def test_reads_what_tarfile_reads_pulling_the_same_chunks(kind):
    data = TARS[kind]
    members, ending, stream = reference(data)
    got, got_ending, got_stream = fast(data)
    assert got == members and got_ending == ending == tarfile.BLOCKSIZE
    assert got_stream.given == stream.given  # the same bytes read (and counted by a meter)
    if kind == "ustar":  # parsed here throughout: in tarfile's chunks
        assert set(got_stream.asked) == {CHUNK} and got_stream.asked == stream.asked
        assert (LONG_NAME, b"long") in got


@pytest.mark.parametrize("kind", ["ustar", "pax-per-member (float mtime)"])
def test_a_cut_tar_ends_or_fails_as_in_tarfile(kind):
    data = TARS[kind]
    # Every byte of the first header and data block; elsewhere, the bytes around each block's edges
    # and inside each header's fields (name, size, checksum, type, prefix).
    within = {0, 1, 2, 99, 100, 124, 135, 148, 156, 157, 345, 499, 509, 510, 511}
    cuts = [cut for cut in range(len(data) + 1) if cut < 1100 or cut % tarfile.BLOCKSIZE in within]
    for cut in cuts:
        assert outcome(fast, data[:cut]) == outcome(reference, data[:cut]) or (
            # tarfile's message for a cut first header names no offset; the outcome is the same
            outcome(fast, data[:cut])[0] == outcome(reference, data[:cut])[0] == "ReadError"
        ), cut


def test_a_damaged_member_header_is_an_error_where_tarfile_dropped_the_rest(tmp_path):
    data = bytearray(TARS["ustar"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        fifth = tar.getmembers()[4].offset  # 000001.txt's header: record 000000 was given before it
    data[fifth + 3] ^= 0x20  # a byte of its name: the checksum no longer matches
    members, _, _ = reference(bytes(data))
    assert [name for name, _ in members] == [name for name, _ in SAMPLES[:4]]  # tarfile: "valid", shorter
    with pytest.raises(tarfile.ReadError, match=f"bad checksum in the member header at byte {fifth}"):
        fast(bytes(data))
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(bytes(data))
    records = tar_records(str(shard))
    assert next(records)["__key__"] == "000000"  # what came before the damage is given
    damaged = "shard-000000.tar: not a readable tar .*bad checksum"
    with pytest.raises(ShardUnavailable, match=damaged) as caught:
        next(records)
    assert caught.value.reason == "corrupt_tar"  # counted, and the loader goes on as for any damaged shard


def test_a_damaged_first_header_and_not_a_tar_are_errors():
    data = bytearray(TARS["ustar"])
    data[0] ^= 0x01
    with pytest.raises(tarfile.ReadError, match="bad checksum in the member header at byte 0"):
        fast(bytes(data))
    with pytest.raises(tarfile.TarError):
        fast(b"this is not a tar file at all " * 40)
    with pytest.raises(tarfile.ReadError, match="empty file"):
        fast(b"")


@pytest.mark.parametrize("small", [False, True])  # a gzip stream under one block: "truncated header" before
def test_a_gzip_compressed_tar_under_a_tar_name_is_named_as_such(tmp_path, small):
    """The loader reads uncompressed tars; a .tar.gz named .tar was a "corrupt_tar" (bad checksum,
    invalid or truncated header). It is refused, naming the file, what it is and what to do."""
    import gzip

    from clipkit.errors import DataError

    shard = tmp_path / "x.tar"
    shard.write_bytes(gzip.compress(make_tar(tarfile.USTAR_FORMAT, SAMPLES[:2] if small else SAMPLES)))
    assert small == (shard.stat().st_size < tarfile.BLOCKSIZE)
    said = r"x\.tar is a gzip-compressed tar.*uncompressed tars only.*gunzip.*clipkit shard webdataset:"
    with pytest.raises(DataError, match=said):
        list(tar_records(str(shard)))
    with pytest.raises(DataError, match=said):  # a lane starting inside it: its headers are read, seeking
        list(tar_records(str(shard), skip=1))
    assert [name for name, _ in fast(make_tar(tarfile.USTAR_FORMAT, SAMPLES))[0]] == [n for n, _ in SAMPLES]
