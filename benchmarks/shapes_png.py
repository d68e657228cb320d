"""What the synthetic shapes source's PNG level costs: CPU per sample of encoding its images at
zlib level 1 (clipkit since issue 36's suite work) against Pillow's default level 6 (before), and
the bytes per sample. The pixels are the same at every level (checked here on every image).

The images are rendered once (:func:`render_with_geometry`, the source's own drawing), then encoded
both ways in interleaved rounds; the CPU time is this process's (one thread). The share of a whole
sample (drawing + encoding, what ``clipkit shard synthetic://shapes`` spends per record before
writing it) is printed too, from the drawing's CPU in the same rounds.

    python benchmarks/shapes_png.py [--samples 1000] [--image-size 48,224] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
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

LEVELS = {"level 1 (now)": 1, "level 6 (Pillow's default, before)": 6}
DRAW = "drawing (render_with_geometry)"


def rendered(samples: int, image_size: int) -> list:
    from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes, render_with_geometry

    source = SyntheticShapes(n=samples, image_size=image_size)
    images = []
    for index in range(samples):
        rng = source._rng(index)
        attributes = source._draw(rng)
        names = (attributes[key] for key in ("colour", "shape", "position", "size"))
        images.append(render_with_geometry(*names, rng, image_size)[0])
    return images


def encoded(images: list, level: int) -> list[bytes]:
    out = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=level)
        out.append(buffer.getvalue())
    return out


def same_pixels(images: list, blobs: list[bytes]) -> bool:
    from PIL import Image

    pairs = zip(images, blobs, strict=True)
    return all(Image.open(io.BytesIO(blob)).tobytes() == image.tobytes() for image, blob in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--image-size", default="48,224")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(
        markdown_header(
            "image size",
            "PNG",
            "bytes / sample",
            "encode CPU ms / sample",
            "ratio to level 6",
            "share of a sample (drawing + encoding), per round",
        )
    )
    for size in (int(s) for s in args.image_size.split(",")):
        images = rendered(args.samples, size)
        for level in LEVELS.values():
            assert same_pixels(images, encoded(images, level))  # warm-up, and lossless at this level
        calls = {
            name: (lambda level=level, images=images: cpu_seconds(lambda: encoded(images, level)))
            for name, level in LEVELS.items()
        }
        calls[DRAW] = lambda size=size: cpu_seconds(lambda: rendered(args.samples, size))
        seconds = interleaved(calls, args.rounds)
        per_sample = {name: [s / args.samples * 1e3 for s in values] for name, values in seconds.items()}
        before, draw = per_sample["level 6 (Pillow's default, before)"], per_sample[DRAW]
        for name, level in LEVELS.items():
            values = per_sample[name]
            size_bytes = sum(map(len, encoded(images, level))) / args.samples
            whole = [encode + drawn for encode, drawn in zip(values, draw, strict=True)]
            print(
                markdown_row(
                    size,
                    name,
                    f"{size_bytes:,.0f}",
                    spread(values),
                    ratio_spread(values, before),
                    ratio_spread(values, whole, 2),
                )
            )


if __name__ == "__main__":
    main()
