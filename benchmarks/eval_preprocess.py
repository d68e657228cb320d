"""Eval preprocessing cost: the exact eval path vs the loader's fast path, CPU time per image.

Rows, each from encoded bytes to the normalised [3, S, S] float32 tensor of the eval transform
(resize the shorter side to S, centre crop):

- exact: ``clipkit.data.transforms.decode_for_eval`` — what ``clipkit eval`` runs: full-size PIL
  decode, PIL bicubic, torchvision's sizes and offsets (pixel-identical to torchvision/open_clip).
- fast: ``clipkit.data.transforms.decode_transformed`` — the training loader's path, which
  ``clipkit eval`` used before: JPEG draft / DCT-scaled decoding (simplejpeg when installed),
  torch's uint8 bicubic kernel.

Images: the real COCO photos of ``../shared/data/coco-mini-cc-by`` (51 JPEGs, mostly 640 × 427-480)
when present, else 51 synthetic 640 × 427 JPEGs. One warm-up round, then ``--repeats`` rounds with
the rows in a shuffled order; process CPU time, one torch thread. Usage (repository root):

    python benchmarks/eval_preprocess.py [--size 224] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import numpy as np
import torch
from measure import cpu_seconds, interleaved, ratio_spread, spread
from PIL import Image

from clipkit.data.transforms import ImageTransform, decode_for_eval, decode_transformed

COCO = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "coco-mini-cc-by" / "images"
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def load_images() -> tuple[list[bytes], str]:
    """Encoded images to preprocess, and where they came from."""
    if COCO.is_dir():
        return [path.read_bytes() for path in sorted(COCO.glob("*.jpg"))], "COCO photos"
    rng = np.random.default_rng(0)
    images = []
    for _ in range(51):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (427, 640, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
        images.append(out.getvalue())
    return images, "synthetic 640x427 JPEGs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, origin = load_images()
    transform = ImageTransform(image_size=args.size, mean=CLIP_MEAN, std=CLIP_STD)
    rows = {
        "exact (decode_for_eval)": lambda data: decode_for_eval(data, transform, "x"),
        "fast (decode_transformed)": lambda data: decode_transformed(data, transform, random.Random(0), "x")[
            0
        ],
    }

    def ms_per_image(row) -> float:
        return cpu_seconds(lambda: [row(data) for data in images]) / len(images) * 1000

    for row in rows.values():
        ms_per_image(row)  # warm-up
    calls = {name: (lambda row=row: ms_per_image(row)) for name, row in rows.items()}
    times = interleaved(calls, args.repeats)
    print(
        f"{len(images)} {origin}, S = {args.size}, {args.repeats} rounds, ms CPU per image (median, min–max)"
    )
    for name, values in times.items():
        print(f"  {name:28s} {spread(values, 2)}")
    exact, fast = times.values()
    print(f"  exact / fast, per round (both rows ran in it): {ratio_spread(exact, fast, 2)}")


if __name__ == "__main__":
    main()
