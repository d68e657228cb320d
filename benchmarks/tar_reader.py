"""The CPU time of reading shards' records: clipkit's tar member reader
(:mod:`clipkit.data.tar_members`: plain ustar headers parsed without ``tarfile``) against Python's
``tarfile`` stream reader, which clipkit used before, on the same shards.

The same synthetic samples are sharded by ``clipkit shard`` (ustar headers), then every record of
every shard is read with :func:`clipkit.data.tar_stream.tar_records` (what the loader runs before
decoding), once with each member reader, in interleaved rounds; the CPU time is this process's (one
thread). Shards with a PAX header per member (written with a float mtime, as clipkit did before
ustar) are read too: there clipkit's reader hands over to ``tarfile`` at the first header.

    python benchmarks/tar_reader.py [--samples 1024] [--image-size 48,224] [--rounds 5]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tarfile
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import (
    cpu_seconds,
    interleaved,
    machine_line,
    markdown_header,
    markdown_row,
    ratio_spread,
    spread,
)

WRITERS = {"ustar": 0, "PAX per member": 0.0}  # the member mtime the shards are written with


class TarfileMembers:
    """The regular files of a tar stream read by ``tarfile`` (what clipkit did before)."""

    def __init__(self, stream) -> None:
        self.stream, self.ending = stream, 0

    def __iter__(self):
        with tarfile.open(fileobj=self.stream, mode="r|") as tar:
            for member in tar:
                if member.isfile():
                    yield member.name, tar.extractfile(member).read()
            self.ending = tar.fileobj.pos - tar.offset


def shard_with(mtime: float | int, source: str, out: Path) -> list[str]:
    from clipkit.app import api
    from clipkit.data import shard_writer

    shard_writer.MEMBER_MTIME = mtime
    api.shard(source, out)
    return sorted(glob.glob(str(out / "*.tar")))


def read_all(files: list[str], reader) -> list:
    from clipkit.data import tar_stream

    tar_stream.TarMembers = reader
    return [record for url in files for record in tar_stream.tar_records(url)]


def main() -> None:
    from clipkit.data.tar_members import TarMembers

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--image-size", default="48,224")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    readers = {"clipkit": TarMembers, "tarfile (before)": TarfileMembers}
    print(machine_line())
    print(markdown_header("image size", "shards", "reader", "read CPU ms / sample", "ratio to tarfile"))
    for size in (int(s) for s in args.image_size.split(",")):
        source = f"synthetic://shapes?n={args.samples}&split=train&image_size={size}"
        with tempfile.TemporaryDirectory() as folder:
            for i, (written, mtime) in enumerate(WRITERS.items()):
                files = shard_with(mtime, source, Path(folder) / str(i))
                records = {name: read_all(files, reader) for name, reader in readers.items()}  # warm-up
                assert (
                    records["clipkit"] == records["tarfile (before)"]
                    and len(records["clipkit"]) == args.samples
                )
                calls = {
                    name: (lambda r=reader, f=files: cpu_seconds(lambda: read_all(f, r)))
                    for name, reader in readers.items()
                }
                seconds = interleaved(calls, args.rounds)
                per_sample = {
                    name: [s / args.samples * 1e3 for s in values] for name, values in seconds.items()
                }
                before = per_sample["tarfile (before)"]
                for name, values in per_sample.items():
                    print(markdown_row(size, written, name, spread(values), ratio_spread(values, before)))


if __name__ == "__main__":
    main()
