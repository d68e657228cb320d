"""Images/s per core of the training loader reading the same shards from local disk, loopback
HTTP and a loopback S3 server (moto), in interleaved rounds.

The shards are a ``clipkit shard`` of ``--data`` (default: the COCO mini set in ../shared/data, real
JPEG photos; else the synthetic shapes). Each round runs every source once, in a shuffled order:
a :class:`clipkit.data.loader.BatchStream` (one process, ``num_workers=0``, ``torch`` on one
thread) takes ``--batches`` batches of 224 px training tensors. The figures are **process CPU
time** of this process (``time.process_time``): the HTTP server and moto run in their own
processes, so what is counted is the loader's decoding plus its transport client, per core.
Wall time is given too. The table gives the median (min–max) img/s over rounds and the per-round
ratio to local disk. Goal: streamed ≥ 0.9× local per core.

    python benchmarks/stream.py [--data SOURCE] [--rounds 5] [--batches 8] [--batch-size 32]
        [--rows 1024] [--per-shard 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from measure import interleaved, markdown_header, ratio_spread, spread  # noqa: E402

from clipkit import api  # noqa: E402
from clipkit.data.loader import BatchStream  # noqa: E402
from clipkit.data.transforms import ImageTransform  # noqa: E402

COCO = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco-mini-cc-by" / "captions.jsonl"
SYNTHETIC = "synthetic://shapes?n=2048&split=train&image_size=224"


def make_shards(data: str, out: Path, rows: int, per_shard: int) -> Path:
    """Shards of ``data``; a JSONL table's rows are repeated to ``rows`` (image paths made
    absolute), so the shards have a realistic size without a large download."""
    if data.endswith(".jsonl"):
        table = Path(data)
        lines = [json.loads(line) for line in table.read_text().splitlines() if line.strip()]
        for line in lines:
            line["image"] = str((table.parent / line["image"]).resolve())
        repeated = out.parent / "repeated.jsonl"
        repeated.write_text("".join(json.dumps(lines[i % len(lines)]) + "\n" for i in range(rows)))
        data = str(repeated)
    api.shard(data, out, samples_per_shard=per_shard)
    return out


def http_process(root: Path, port: int, answers_range: bool = False):
    """A loopback HTTP server for ``root`` in its own process: Python's ``http.server`` (which
    ignores ``Range``), or with ``answers_range`` tests/stream_servers.py's (which answers it)."""
    if answers_range:
        tests = Path(__file__).resolve().parents[1] / "tests"
        code = f"import sys; sys.path.insert(0, {str(tests)!r}); import stream_servers as s; "
        code += f"s.serve({str(root)!r}, {port})"
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        command += ["--directory", str(root)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def time_source(spec: str, batches: int, batch_size: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for ``batches`` batches of ``spec``."""
    transform = ImageTransform(image_size=224, mean=(0.5,) * 3, std=(0.25,) * 3, crop_scale=(0.9, 1.0))
    stream = BatchStream(
        spec, batch_size=batch_size, transform=transform, tokenizer=None, seed=0, shuffle_buffer=64
    )
    cpu, wall = time.process_time(), time.perf_counter()
    iterator = iter(stream)
    for _ in range(batches):
        next(iterator)
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(COCO) if COCO.is_file() else SYNTHETIC)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1024, help="a table's rows repeated to this many")
    parser.add_argument("--per-shard", type=int, default=256, help="samples per shard")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from stream_servers import free_port, moto_available, s3_server, wait_for_port

    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(args.data, Path(tmp) / "shards", args.rows, args.per_shard)
        names = sorted(p.name for p in shards.glob("*.tar"))
        pattern = f"shard-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"
        port = free_port()
        server = http_process(shards.parent, port)
        wait_for_port(port, server)
        sources = {"local disk": str(shards), "loopback HTTP": f"http://127.0.0.1:{port}/shards/{pattern}"}
        files = {f"shards/{p.name}": p for p in shards.iterdir()}
        s3 = s3_server("bench", files) if moto_available() else None
        try:
            if s3 is not None:
                s3.__enter__()
                sources["loopback S3 (moto)"] = f"s3://bench/shards/{pattern}"
            run(sources, args)
        finally:
            if s3 is not None:
                s3.__exit__(None, None, None)
            server.terminate()
            server.wait()


def run(sources: dict[str, str], args) -> None:
    images = args.batches * args.batch_size
    for spec in sources.values():  # warm-up: imports, connections, page cache
        time_source(spec, 1, args.batch_size)

    def one_round(spec: str) -> tuple[float, float]:
        return time_source(spec, args.batches, args.batch_size)

    calls = {name: (lambda spec=spec: one_round(spec)) for name, spec in sources.items()}
    rounds = interleaved(calls, args.rounds)
    cpu = {name: [images / seconds for seconds, _ in timings] for name, timings in rounds.items()}
    wall = {name: [images / elapsed for _, elapsed in timings] for name, timings in rounds.items()}
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, data {args.data}")
    print(f"{images} images per source per round, {args.rounds} rounds, {args.per_shard} samples per shard")
    columns = ("source", "img/s/core (CPU), median (min–max)", "× local per round (min–max)", "img/s wall")
    print(markdown_header(*columns))
    local = cpu["local disk"]
    for name in sources:
        print(
            f"| {name} | {spread(cpu[name], 0)} | {ratio_spread(cpu[name], local, 2)} "
            f"| {statistics.median(wall[name]):.0f} |"
        )


if __name__ == "__main__":
    main()
