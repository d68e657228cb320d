"""Images/s of training augmentation: per-sample PIL path vs batched tensor path
(clipkit.data.batched_augment).

(a) ``ImageTransform`` (PIL random-resized-crop, bicubic, to tensor, normalise) on PIL images, one
    sample at a time with its own ``random.Random``, then ``torch.stack`` into a batch (what the
    DataLoader's collate does); decoding is excluded.
(b) ``BatchedAugment`` on the whole uint8 batch (uint8 -> float, crop boxes, resample, normalise),
    one row per backend (torch; kornia if importable).

Both use the same crop settings. Timings are best-of-N and median wall-clock seconds per batch;
with ``--threads 1`` (default) the figures are per core. Usage:

    python benchmarks/augment.py [--batch 256] [--input-size 256] [--image-size 224] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import numpy as np
import torch
from PIL import Image

from clipkit.data.batched_augment import BatchedAugment
from clipkit.data.transforms import ImageTransform

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-size", type=int, default=256, help="side of the square uint8 inputs")
    parser.add_argument("--image-size", type=int, default=224, help="output side S")
    parser.add_argument("--crop-scale", type=float, nargs=2, default=(0.5, 1.0))
    parser.add_argument("--hflip", action="store_true", help="also flip (both paths)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 = per core)")
    parser.add_argument("--device", default="cpu", help="device of the batched path (cuda: GPU timing)")
    return parser.parse_args()


def time_runs(run, repeats: int, synchronise=lambda: None) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``run`` after one warm-up call."""
    run()
    synchronise()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronise()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    batch_shape = (args.batch, 3, args.input_size, args.input_size)
    images = torch.randint(0, 256, batch_shape, dtype=torch.uint8, generator=generator)
    pil_images = [Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy())) for image in images]
    settings = {
        "image_size": args.image_size,
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
        "crop_scale": tuple(args.crop_scale),
        "hflip": args.hflip,
    }

    transform = ImageTransform(**settings)

    def per_sample() -> torch.Tensor:
        return torch.stack([transform(image, random.Random(i)) for i, image in enumerate(pil_images)])

    rows = [("(a) per-sample PIL ImageTransform", time_runs(per_sample, args.repeats))]

    device = torch.device(args.device)
    synchronise = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    device_images = images.to(device)
    for backend in ("torch", "kornia"):
        try:
            module = BatchedAugment(**settings, backend=backend).to(device)
        except ImportError:
            print(f"(kornia not importable: skipping the {backend} backend)")
            continue

        def batched(module=module) -> torch.Tensor:
            return module(device_images, torch.Generator().manual_seed(1))

        label = f"(b) BatchedAugment backend={backend} on {device.type}"
        rows.append((label, time_runs(batched, args.repeats, synchronise)))

    print_report(args, rows)


def print_report(args: argparse.Namespace, rows: list[tuple[str, list[float]]]) -> None:
    try:
        import kornia

        kornia_version = kornia.__version__
    except ImportError:
        kornia_version = "not installed"
    import PIL

    print(
        f"batch {args.batch}, {args.input_size}x{args.input_size} uint8 -> "
        f"{args.image_size}x{args.image_size}, "
        f"crop_scale {tuple(args.crop_scale)}, hflip {args.hflip}, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} timed runs after 1 warm-up"
    )
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, pillow {PIL.__version__}, "
        f"kornia {kornia_version}, {platform.processor() or platform.machine()}"
    )
    reference = args.batch / min(rows[0][1])
    print()
    print("| path | best s/batch | median s/batch | images/s (best) | images/s (median) | × (a), best |")
    print("|---|---|---|---|---|---|")
    for label, seconds in rows:
        best, median = min(seconds), statistics.median(seconds)
        rate = args.batch / best
        print(
            f"| {label} | {best:.3f} | {median:.3f} | {rate:.0f} | {args.batch / median:.0f} | "
            f"{rate / reference:.2f} |"
        )


if __name__ == "__main__":
    main()
