"""What the shards' tar headers cost: bytes per sample and the CPU time of reading the records,
for shards written with an integer member mtime (ustar headers, clipkit since issue 36's suite
work) against a float one (0.0: a 1 KiB PAX header before every member, clipkit before).

The same synthetic samples are sharded both ways (``clipkit shard``'s writer, its ``MEMBER_MTIME``
set for each), then every record of every shard is read with :func:`clipkit.data.tar_stream.tar_records`
(what the loader runs before decoding) in interleaved rounds; the CPU time is this process's
(one thread). Decoding the images is not included: it is the same for both.

    python benchmarks/tar_headers.py [--samples 1024] [--image-size 48,224] [--rounds 5]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
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

WRITERS = {"ustar (int mtime)": 0, "PAX per member (float mtime, before)": 0.0}


def shard_with(mtime: float | int, source: str, out: Path) -> list[str]:
    from clipkit.app import api
    from clipkit.data import shard_writer

    shard_writer.MEMBER_MTIME = mtime
    api.shard(source, out)
    return sorted(glob.glob(str(out / "*.tar")))


def read_all(files: list[str]) -> int:
    from clipkit.data.tar_stream import tar_records

    return sum(1 for url in files for _ in tar_records(url))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--image-size", default="48,224")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(markdown_header("image size", "writer", "bytes / sample", "read CPU ms / sample", "ratio to PAX"))
    for size in (int(s) for s in args.image_size.split(",")):
        source = f"synthetic://shapes?n={args.samples}&split=train&image_size={size}"
        with tempfile.TemporaryDirectory() as folder:
            files = {
                name: shard_with(mtime, source, Path(folder) / str(i))
                for i, (name, mtime) in enumerate(WRITERS.items())
            }
            for name in files:
                assert read_all(files[name]) == args.samples  # warm-up, and the records are all there
            calls = {name: (lambda f=f: cpu_seconds(lambda: read_all(f))) for name, f in files.items()}
            seconds = interleaved(calls, args.rounds)
            per_sample = {name: [s / args.samples * 1e3 for s in values] for name, values in seconds.items()}
            before = per_sample["PAX per member (float mtime, before)"]
            for name, values in per_sample.items():
                size_bytes = sum(os.path.getsize(f) for f in files[name]) / args.samples
                print(
                    markdown_row(
                        size, name, f"{size_bytes:,.0f}", spread(values), ratio_spread(values, before)
                    )
                )


if __name__ == "__main__":
    main()
