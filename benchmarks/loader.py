"""Images/s per core of the loader's JPEG -> training tensor path vs a plain PIL loop, and shard writing.

Rows, all timed in the same run on the same encoded images (interleaved: each repeat runs every
row once, so drifting load from other processes hits every row alike):

- decode only: ``Image.open`` + ``load`` (full size): the floor of any PIL-based path.
- (a) plain PIL loop: open, convert RGB, torchvision's random-resized-crop box rule, resize to S
  bicubic (PIL, antialiased), to float tensor, normalise: what a straightforward script does.
- (a') clipkit's previous path: decode (PIL) + ``ImageTransform.__call__`` (PIL resampling).
- (b) ``clipkit.data.transforms.decode_transformed`` (torch uint8 bicubic resampling, fused
  normalisation, JPEG draft decoding when the crop allows it) with the PIL decoder; with the
  ``fastjpeg`` extra installed also with simplejpeg (decode straight into numpy; the default
  then), without draft, with ``fast=True`` (fast IDCT and upsampling), and in two-view mode (one
  decode, two crops; counted per source image). With simplejpeg, two more floor rows: its
  full-size decode into numpy (the floor the 85 % goal is stated against), and its decode at the
  DCT scale (b) asks for per image (1/2 where every box maps onto whole reduced pixels, ...), i.e.
  the decode work (b) really does; then a step-by-step CPU-time breakdown of (b) with simplejpeg.
- (c) shard writing: ``clipkit.app.api.shard`` of a temporary JSONL table of the photos (repeated to
  ``--shard-images`` rows): samples/s, MB/s of image bytes in and of tar bytes out.

Single process, ``torch.set_num_threads(1)``: figures are per core, in process CPU time. Each row
is run ``--repeats`` times over ``--images`` images (the photos cycled, one ``random.Random(i)``
per image), rows interleaved in a shuffled order per round; the table gives the median (min–max)
img/s and, per round, the ratios to (a) and to the decode-only floors. ``--web`` first re-encodes
the photos in memory as typical web JPEGs (longer side 500–800 px, q85, 4:2:0). Shard
writing is timed ``--repeats // 2`` times after a warm-up run. Usage (from the repository root):

    python benchmarks/loader.py [--images 255] [--image-size 224] [--crop-scale 0.9 1.0]
        [--data DIR] [--web] [--shard-resize N] [--upscale K] [--repeats 10] [--skip-shard | --skip-loader]
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from measure import cpu_seconds, interleaved, machine_line, ratio_spread, spread
from PIL import Image

from clipkit.data.decoders import SimpleJpegDecoder, default_decoder
from clipkit.data.transforms import ImageTransform, decode_transformed, decoder_factor, render

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco-mini-cc-by" / "images"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=255, help="images per timed run (photos cycled)")
    parser.add_argument("--image-size", type=int, default=224, help="output side S")
    parser.add_argument("--crop-scale", type=float, nargs=2, default=(0.9, 1.0), help="CLIP recipe: 0.9 1.0")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of JPEG photos")
    parser.add_argument(
        "--shard-resize", type=int, default=None, help="first re-encode as `clipkit shard -o resize=N` stores"
    )
    parser.add_argument("--upscale", type=float, default=None, help="first upscale K× (bicubic, JPEG q95)")
    parser.add_argument(
        "--web",
        action="store_true",
        help="first re-encode as typical web JPEGs: longer side 500-800 px, q85, 4:2:0 (seeded)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per row (after one warm-up)")
    parser.add_argument("--shard-images", type=int, default=306, help="table rows for the shard benchmark")
    parser.add_argument("--skip-shard", action="store_true", help="skip (c) shard writing")
    parser.add_argument("--skip-loader", action="store_true", help="only (c) shard writing")
    return parser.parse_args()


def load_photos(args: argparse.Namespace) -> tuple[list[bytes], str]:
    """Encoded photos (bytes) and a description; generated 640x480 JPEGs when the folder is absent."""
    paths = sorted(glob.glob(str(args.data / "*.jpg")))
    if paths:
        photos, description = (
            [Path(path).read_bytes() for path in paths],
            f"{len(paths)} JPEG photos in {args.data}",
        )
    else:
        photos, description = generated_jpegs(51), "51 generated 640x480 JPEGs (q90; photo folder absent)"
    if args.upscale:
        photos = [rescaled(photo, args.upscale) for photo in photos]
        description += f", upscaled {args.upscale}x (bicubic, re-encoded q95)"
    if args.web:
        photos = web_jpegs(photos)
        description += ", re-encoded as web JPEGs (longer side 500-800 px, q85, 4:2:0)"
    if args.shard_resize:
        from clipkit.data.download import resize_image

        photos = [resize_image(photo, args.shard_resize) for photo in photos]
        description += (
            f", shorter side resized to {args.shard_resize} (clipkit.data.download.resize_image, q95)"
        )
    return photos, description


def generated_jpegs(count: int) -> list[bytes]:
    """Smooth colour fields plus noise (so the entropy coder has work, like a photo), 640x480, q90."""
    rng = np.random.default_rng(0)
    x, y = np.meshgrid(np.linspace(0, 1, 640), np.linspace(0, 1, 480))
    photos = []
    for _ in range(count):
        phases = rng.uniform(0, 2 * np.pi, 3)
        base = np.stack([127 + 100 * np.sin(6 * x + 4 * y + phase) for phase in phases], axis=-1)
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        photos.append(encode_jpeg(Image.fromarray(pixels, "RGB"), 90))
    return photos


def rescaled(photo: bytes, factor: float) -> bytes:
    image = Image.open(io.BytesIO(photo)).convert("RGB")
    size = (round(image.width * factor), round(image.height * factor))
    return encode_jpeg(image.resize(size, Image.BICUBIC), 95)


def web_jpegs(photos: list[bytes]) -> list[bytes]:
    """Each photo resized (bicubic) to a longer side drawn from 500-800 px (``random.Random(0)``)
    and re-encoded at quality 85 with 4:2:0 chroma subsampling, as most web JPEGs are."""
    rng, out = random.Random(0), []
    for photo in photos:
        image = Image.open(io.BytesIO(photo)).convert("RGB")
        scale = rng.randint(500, 800) / max(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
        out.append(encode_jpeg(image, 85, subsampling=2))
    return out


def encode_jpeg(image: Image.Image, quality: int, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, **options)
    return buffer.getvalue()


def torchvision_crop_box(width, height, scale, ratio, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (10 tries, then the clamped centre crop), as a plain
    script copies it; (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    w, h = width, height
    if width / height < ratio[0]:
        h = round(width / ratio[0])
    elif width / height > ratio[1]:
        w = round(height * ratio[1])
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


PIL_FLOOR = "decode only (PIL open + load, full size)"
FAST_FLOOR = "decode only (simplejpeg, full size, into numpy)"
SCALED_FLOOR = "decode only (simplejpeg, at the DCT scale (b) decodes at)"
PLAIN = "(a) plain PIL loop (RRC box, PIL bicubic, float, normalise)"
FAST = "(b) decode_transformed, simplejpeg (fastjpeg extra; draft on)"


def loader_rows(args: argparse.Namespace, photos: list[bytes]) -> dict[str, callable]:
    """{label: run(i, data) -> images produced} for every timed loader row."""
    size, scale, ratio = args.image_size, tuple(args.crop_scale), (3 / 4, 4 / 3)
    transform = ImageTransform(image_size=size, mean=CLIP_MEAN, std=CLIP_STD, crop_scale=scale)
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)

    def decode_only(i: int, data: bytes) -> int:
        Image.open(io.BytesIO(data)).load()
        return 1

    def decode_only_fast(i: int, data: bytes) -> int:
        fast_decoder.decode(data, 1)
        return 1

    def decode_only_scaled(i: int, data: bytes) -> int:
        fast_decoder.decode(data, scale_of[i % len(scale_of)])
        return 1

    def plain_pil(i: int, data: bytes) -> int:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        box = torchvision_crop_box(*image.size, scale, ratio, random.Random(i))
        image = image.resize((size, size), Image.BICUBIC, box=box)
        tensor = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        (tensor - mean) / std
        return 1

    def previous(i: int, data: bytes) -> int:
        image = Image.open(io.BytesIO(data))
        image.load()
        transform(image, random.Random(i))
        return 1

    def pil_path(i: int, data: bytes) -> int:
        return len(decode_transformed(data, transform, random.Random(i), "benchmark", decoder=None))

    def fast(i: int, data: bytes) -> int:
        return len(decode_transformed(data, transform, random.Random(i), "benchmark", decoder=fast_decoder))

    def fast_no_draft(i: int, data: bytes) -> int:
        options = {"draft": False, "decoder": fast_decoder}
        return len(decode_transformed(data, transform, random.Random(i), "benchmark", **options))

    def fast_dct(i: int, data: bytes) -> int:
        return len(decode_transformed(data, transform, random.Random(i), "benchmark", decoder=fast_idct))

    def two_views(i: int, data: bytes) -> int:
        decode_transformed(data, [transform, transform], random.Random(i), "benchmark", decoder=fast_decoder)
        return 1  # per source image (each yields two crops)

    rows = {
        PIL_FLOOR: decode_only,
        PLAIN: plain_pil,
        "(a') previous clipkit path: decode + ImageTransform.__call__": previous,
        "(b) decode_transformed, PIL decoder (draft on)": pil_path,
    }
    fast_decoder = default_decoder()
    fast_idct = SimpleJpegDecoder(fast=True) if fast_decoder is not None else None
    if fast_decoder is not None:  # the fastjpeg extra (simplejpeg) is installed
        work = [photos[i % len(photos)] for i in range(args.images)]
        scale_of = decode_factors(transform, fast_decoder, work)
        rows = {
            PIL_FLOOR: decode_only,
            FAST_FLOOR: decode_only_fast,
            SCALED_FLOOR: decode_only_scaled,
            **{label: run for label, run in rows.items() if label != PIL_FLOOR},
            FAST: fast,
            "(b) decode_transformed, simplejpeg, draft=False": fast_no_draft,
            "(b) decode_transformed, simplejpeg fast=True (fastdct, fastupsample)": fast_dct,
            "(b) decode_transformed, simplejpeg, two views, per source image": two_views,
        }
    return rows


def decode_factors(transform: ImageTransform, decoder, work: list[bytes]) -> list[int]:
    """The DCT scale factor ``decode_transformed`` asks the decoder for, per image i of ``work``
    (draws of ``random.Random(i)``, as in the timed rows)."""
    plans = [transform.plan(decoder.header(data), random.Random(i)) for i, data in enumerate(work)]
    return [decoder_factor([plan]) for plan in plans]


def time_stages(args: argparse.Namespace, photos: list[bytes]) -> dict[str, list[float]]:
    """{stage: [µs per image, per round]} of the simplejpeg path of ``decode_transformed``, run step
    by step with the module's own functions and a CPU-time clock around each step (interleaved with
    nothing else; one warm-up pass, then ``--repeats`` rounds)."""
    transform = ImageTransform(
        image_size=args.image_size, mean=CLIP_MEAN, std=CLIP_STD, crop_scale=tuple(args.crop_scale)
    )
    decoder = default_decoder()
    work = [photos[i % len(photos)] for i in range(args.images)]
    clock = time.process_time_ns
    stages = [
        "header + random draws + scale choice",
        "decode (simplejpeg, into numpy)",
        "crop copy + resample (torch uint8) + transpose copy",
        "normalise (uint8 -> float32)",
    ]
    totals = {stage: [] for stage in stages}
    for repeat in range(args.repeats + 1):
        spent = [0] * len(stages)
        for i, data in enumerate(work):
            t0 = clock()
            plan = transform.plan(decoder.header(data), random.Random(i))
            factor = decoder_factor([plan])
            t1 = clock()
            pixels, applied = decoder.decode(data, factor)
            t2 = clock()
            pixels = render(pixels, plan, applied)
            t3 = clock()
            transform.from_uint8(pixels)
            t4 = clock()
            for k, (start, end) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                spent[k] += end - start
        if repeat:  # the first pass is a warm-up
            for stage, ns in zip(stages, spent, strict=True):
                totals[stage].append(ns / len(work) / 1e3)
    return totals


def print_stages(totals: dict[str, list[float]], factors: list[int]) -> None:
    whole = sum(statistics.median(values) for values in totals.values())
    print()
    shares = ", ".join(f"1/{f}: {factors.count(f) / len(factors):.0%}" for f in sorted(set(factors)))
    print(f"Where (b) simplejpeg's time goes (step by step, CPU time; DCT scales used: {shares})")
    print()
    print("| step | µs/img: median (min–max) | share |")
    print("|---|---|---|")
    for stage, values in totals.items():
        median = statistics.median(values)
        print(f"| {stage} | {spread(values, 0)} | {median / whole:.0%} |")
    print(f"| sum of medians | {whole:.0f} | 100% |")


def time_loader(rows: dict, photos: list[bytes], images: int, repeats: int) -> dict[str, list[float]]:
    """{label: [images/s per round]} in process CPU time (``time.process_time``: waiting for a core
    shared with other jobs does not count): one warm-up pass, then ``repeats`` rounds, each running
    every row once in a shuffled order (so load drift from other processes hits all rows alike)."""
    work = [photos[i % len(photos)] for i in range(images)]
    for run in rows.values():
        for i, data in enumerate(work[: len(photos)]):
            run(i, data)

    def rate(run) -> float:
        """Images per CPU second of one pass of ``run`` over the work."""
        return images / cpu_seconds(lambda: [run(i, data) for i, data in enumerate(work)])

    return interleaved({label: (lambda run=run: rate(run)) for label, run in rows.items()}, repeats)


def time_sharding(
    photos: list[bytes], rows: int, repeats: int
) -> tuple[list[tuple[float, float, float]], dict]:
    """[(samples/s, image MB/s in, tar MB/s out)] of clipkit.app.api.shard on a JSONL table of ``rows``
    rows cycling through ``photos`` (files in a temporary folder), and the last manifest."""
    from clipkit.app.api import shard

    results, manifest = [], {}
    with tempfile.TemporaryDirectory(prefix="clipkit-shard-bench-") as folder:
        root = Path(folder)
        (root / "images").mkdir()
        table_rows = []
        for i in range(rows):
            name = f"images/{i:05d}.jpg"
            (root / name).write_bytes(photos[i % len(photos)])
            table_rows.append({"image": name, "captions": [f"photo {i}", f"another caption of photo {i}"]})
        table = root / "captions.jsonl"
        table.write_text("".join(json.dumps(row) + "\n" for row in table_rows))
        image_bytes = sum(len(photos[i % len(photos)]) for i in range(rows))
        for repeat in range(repeats + 1):  # the first run is a warm-up (imports, plugin registry)
            out = root / f"shards-{repeat}"
            start = time.perf_counter()
            manifest = shard(str(table), out)
            seconds = time.perf_counter() - start
            tar_bytes = sum(path.stat().st_size for path in out.glob("*.tar"))
            if repeat:
                results.append(
                    (manifest["n"] / seconds, image_bytes / seconds / 1e6, tar_bytes / seconds / 1e6)
                )
            shutil.rmtree(out)
    return results, manifest


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    photos, description = load_photos(args)
    sizes = [Image.open(io.BytesIO(photo)).size for photo in photos]
    import PIL
    import PIL.features

    print(
        f"inputs: {description}; mean {np.mean([len(p) for p in photos]) / 1e3:.0f} kB, "
        f"median size {int(np.median([w for w, _ in sizes]))}x{int(np.median([h for _, h in sizes]))}"
    )
    print(
        f"output {args.image_size}px, crop_scale {tuple(args.crop_scale)}, ratio (3/4, 4/3), "
        f"{args.images} images per run, {args.repeats} runs after a warm-up, "
        f"torch threads {torch.get_num_threads()}"
    )
    libjpeg = f"{PIL.__version__} (libjpeg-turbo {PIL.features.version('libjpeg_turbo')})"
    print(machine_line(("pillow", libjpeg), threads=False, load=False))

    if not args.skip_loader:
        print_loader_table(time_loader(loader_rows(args, photos), photos, args.images, args.repeats))
        if default_decoder() is not None:
            transform = ImageTransform(
                image_size=args.image_size, mean=CLIP_MEAN, std=CLIP_STD, crop_scale=tuple(args.crop_scale)
            )
            work = [photos[i % len(photos)] for i in range(args.images)]
            factors = decode_factors(transform, default_decoder(), work)
            print_stages(time_stages(args, photos), factors)
    if not args.skip_shard:
        print_shard_table(args, photos)


FLOOR_NAMES = {
    PIL_FLOOR: "PIL decode floor",
    FAST_FLOOR: "simplejpeg full-size decode floor",
    SCALED_FLOOR: "simplejpeg decode at (b)'s scale",
}


def print_loader_table(rates: dict[str, list[float]]) -> None:
    """Medians with the min–max over rounds; ratios are per round (same round, same load)."""
    floors = [label for label in (PIL_FLOOR, FAST_FLOOR, SCALED_FLOOR) if label in rates]
    print()
    print(
        "| path | img/s/core, CPU time: median (min–max) | ms/img | × (a) | "
        + " | ".join(f"÷ {FLOOR_NAMES[label]}" for label in floors)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(floors))
    for label, values in rates.items():
        median = statistics.median(values)
        cells = [ratio_spread(values, rates[reference], 2) for reference in (PLAIN, *floors)]
        print(f"| {label} | {spread(values, 0)} | {1e3 / median:.2f} | " + " | ".join(cells) + " |")


def print_shard_table(args: argparse.Namespace, photos: list[bytes]) -> None:
    results, manifest = time_sharding(photos, args.shard_images, max(1, args.repeats // 2))
    samples, mb_in, mb_out = (statistics.median(column) for column in zip(*results, strict=True))
    print()
    print(
        f"(c) clipkit.app.api.shard, JSONL table of {args.shard_images} rows, default options, "
        f"{len(manifest['shards'])} shard(s), {manifest['n']} samples; median of {len(results)} runs"
    )
    print()
    print("| samples/s | image MB/s in | tar MB/s out |")
    print("|---|---|---|")
    print(f"| {samples:.0f} | {mb_in:.1f} | {mb_out:.1f} |")


if __name__ == "__main__":
    main()
