"""Loader scaling with the number of workers: images/s and process CPU time per image when the
loader workers read apart (lanes, one per worker: each byte read once) against the loader before
lanes (one lane: every worker reads all the bytes and decodes its share), from local shards and a
loopback HTTP server (127.0.0.1 only), in interleaved rounds.

Each measurement is one epoch of :class:`clipkit.data.loader.BatchStream` (224 px training
tensors, torch on one thread per process) in a fresh child process. Its CPU time per image is the
workers' CPU time while they iterate (each batch carries it) plus the child's after the first
batch: the per-image cost, without the workers' start and exit, which are fixed per worker and per
epoch and would swamp a short epoch; the whole process CPU time (the child's and its waited-for
workers', ``RUSAGE_CHILDREN``) is given too. The HTTP server runs in its own process and is not
counted. Bytes read and fetched come from the
loader's counters, as a multiple of the shards' size. The table gives, per (source, workers,
design), the median (min–max) over rounds of the CPU milliseconds per image, the per-round ratio
to one worker of the same design and source, images/s (wall clock, which other jobs on the
machine disturb) and the bytes read per epoch.

    python benchmarks/loader_scaling.py [--workers 1,2,4,8,16] [--rounds 3] [--rows 1024]
        [--per-shard 32] [--batch-size 32] [--data SOURCE] [--shared-workers 1,16] [--without-index]
        [--range-server]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]

DESIGNS = {"lanes": None, "shared (before)": 1}  # lanes: None = one per worker (the default)


def child(spec: str, workers: int, lanes: int | None, batch_size: int) -> dict:
    """One epoch of ``spec``; CPU seconds of this process and its (waited-for) loader workers."""
    import torch

    from clipkit.data.loader import BatchStream
    from clipkit.data.transforms import ImageTransform

    torch.set_num_threads(1)
    transform = ImageTransform(image_size=224, mean=(0.5,) * 3, std=(0.25,) * 3, crop_scale=(0.9, 1.0))
    stream = BatchStream(spec, batch_size=batch_size, transform=transform, tokenizer=None, seed=0,
                         shuffle_buffer=64, num_workers=workers, lanes=lanes)  # fmt: skip
    time_iterations()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, wall = time.process_time(), time.perf_counter()
    images, working, first = 0, {}, None
    for batch in stream.loader(0, 0):  # the whole epoch: the workers exit and are waited for
        first = time.process_time() if first is None else first
        stats = batch.pop("data_stats")
        worker, seconds = stats.pop("cpu")
        working[worker] = seconds
        stream.count(stats)
        images += len(batch["index"])
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "images": images,
        # The workers' CPU while iterating, and this process's after the first batch: the cost
        # per image without the workers' start and exit (fixed per worker and per epoch).
        "cpu": sum(working.values()) + time.process_time() - first,
        "cpu_all": time.process_time() - cpu + children,  # start-up and exit included
        "wall": wall,
        "read": sum(stream.bytes_read.values()),
        "fetched": sum(stream.bytes_fetched.values()),
    }


def time_iterations() -> None:
    """Each batch carries (worker, its CPU seconds since it began iterating)."""
    import torch

    from clipkit.data.loader import EpochDataset

    iterate = EpochDataset.__iter__

    def timed(self):
        info = torch.utils.data.get_worker_info()
        start = time.process_time()
        for batch in iterate(self):
            batch["data_stats"]["cpu"] = (info.id if info else -1, time.process_time() - start)
            yield batch

    EpochDataset.__iter__ = timed


def measure(spec: str, workers: int, lanes: int | None, batch_size: int) -> dict:
    arguments = json.dumps([spec, workers, lanes, batch_size])
    done = subprocess.run([sys.executable, __file__, "--child", arguments], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from stream import COCO, SYNTHETIC, http_process, make_shards
    from stream_servers import free_port, wait_for_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", default=str(COCO) if COCO.is_file() else SYNTHETIC)
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1024, help="a table's rows repeated to this many")
    parser.add_argument("--per-shard", type=int, default=32, help="samples per shard")
    parser.add_argument("--shared-workers", default="1,16", help="worker counts run with one lane too")
    parser.add_argument(
        "--without-index", action="store_true",
        help="also read over HTTP a copy without the shards' record indexes (as older shard sets)",
    )  # fmt: skip
    parser.add_argument(
        "--range-server", action="store_true",
        help="serve HTTP with a server that answers Range (tests/stream_servers.py), as nginx and S3 "
        "do; default: Python's http.server, which ignores it",
    )  # fmt: skip
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(args.data, Path(tmp) / "shards", args.rows, args.per_shard)
        size = sum(p.stat().st_size for p in shards.glob("*.tar"))
        names = sorted(p.name for p in shards.glob("*.tar"))
        pattern = f"shard-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"
        port = free_port()
        server = http_process(shards.parent, port, answers_range=args.range_server)
        try:
            wait_for_port(port, server)
            sources = {"local": str(shards), "HTTP": f"http://127.0.0.1:{port}/shards/{pattern}"}
            if args.without_index:  # the same tars, no .idx beside them: lanes read the records before
                shutil.copytree(shards, shards.parent / "plain", ignore=shutil.ignore_patterns("*.idx"))
                sources["HTTP, no index"] = f"http://127.0.0.1:{port}/plain/{pattern}"
            shared = [int(w) for w in args.shared_workers.split(",") if w]
            runs = [(s, w, "lanes") for s in sources for w in workers]
            runs += [(s, w, "shared (before)") for s in sources for w in shared]
            results: dict[tuple, list[dict]] = {run: [] for run in runs}
            for round_ in range(args.rounds):
                random.Random(round_).shuffle(runs)
                for source, count, design in runs:
                    result = measure(sources[source], count, DESIGNS[design], args.batch_size)
                    results[(source, count, design)].append(result)
                    print(json.dumps([round_, source, count, design, result]), file=sys.stderr, flush=True)
                print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        finally:
            server.terminate()
            server.wait()
    report(results, sources, size, args)


def report(results, sources, size, args) -> None:
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, data {args.data}, {args.rows} "
          f"samples in shards of {args.per_shard} ({size / 2**20:.1f} MiB), batch {args.batch_size}, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")  # fmt: skip
    columns = ["source", "workers", "design", "CPU ms/image, median (min–max)", "× 1 worker, per round",
               "with start-up, ms/image", "img/s wall", "bytes read / data", "fetched / data"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for source in sources:
        for design in DESIGNS:
            counts = sorted(count for (s, count, d) in results if s == source and d == design)
            if not counts:
                continue
            base = [r["cpu"] / r["images"] for r in results[(source, counts[0], design)]]
            for count in counts:
                rows = results[(source, count, design)]
                per_image = [1000 * r["cpu"] / r["images"] for r in rows]
                ratios = [p / (1000 * b) for p, b in zip(per_image, base, strict=True)]
                rate = statistics.median(r["images"] / r["wall"] for r in rows)
                whole = statistics.median(1000 * r["cpu_all"] / r["images"] for r in rows)
                read = statistics.median(r["read"] / size for r in rows)
                fetched = statistics.median(r["fetched"] / size for r in rows)
                print(
                    f"| {source} | {count} | {design} | {statistics.median(per_image):.2f} "
                    f"({min(per_image):.2f}–{max(per_image):.2f}) | {statistics.median(ratios):.2f} "
                    f"({min(ratios):.2f}–{max(ratios):.2f}) | {whole:.2f} | {rate:.0f} | {read:.2f}× "
                    f"| {fetched:.2f}× |"
                )


if __name__ == "__main__":
    main()
