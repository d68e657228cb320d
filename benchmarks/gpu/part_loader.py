"""Does clipkit's loader keep the GPU fed? Images/s of the training loader on WebDataset shards,
against what the ViT-B/16 training step consumes.

- Data: 2048 distinct synthetic JPEGs (smooth colour fields plus noise, 256-320 px a side, q90,
  made on all cores), each with a caption, written 8 times over (16 384 samples: every worker of a
  16-worker loader gets 4 batches of 256 in one epoch; an epoch boundary would restart the workers)
  as shards by clipkit's own writer (``clipkit.data.shard_writer.write_shards``, what ``clipkit
  shard`` runs), into a temporary folder.
- Loader: ``clipkit.data.loader.BatchStream`` as ``build_trainer`` makes it for the ``clip``
  recipe (its training transform at 224 px: random-resized crop 0.9-1.0, normalise; its CLIP BPE
  tokenizer at context 77; batch 256; its shuffle buffer), decoding with simplejpeg where installed
  (else PIL; the decoder is named in the figures). With W workers: the first W batches (one per
  worker: process start-up, shuffle buffer fill) are not timed — the time to the first batch is
  reported apart — the next 3·W batches are: images/s = 3·W·256 / (arrival of batch 4·W − arrival of
  batch W). Run with W = every usable CPU (16 on the GPU machine), then, while the budget (40 s)
  lasts, with the recipe's ``num_workers: auto`` (``clipkit.config.machine.fit_to_machine``).
- Goal: loader images/s ≥ the ViT-B/16 step's samples/s, read from ``vit_step.json`` in the same
  folder (``clipkit_samples_per_s``, written by part_vit_step.py), so the GPU never waits on data.

Rehearsal (``CLIPKIT_GPU_REHEARSAL=1``): 64 small JPEGs (40-56 px), ``clip@tiny``'s transform and
tokenizer, batch 8, 2 workers. Usage (from the repository root):

    python benchmarks/gpu/part_loader.py --out DIR      # writes DIR/loader.json
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from common import device, figure, parse_out, pick, write_part
from PIL import Image

BUDGET_S = 40.0
STARTED = time.perf_counter()
BATCH = pick(256, 8)
UNIQUE_IMAGES = pick(2048, 64)
SIDES = pick((256, 320), (40, 56))
TIMED_ROUNDS = 3  # rounds of one batch per worker, after the first (start-up) round


def left() -> float:
    return BUDGET_S - (time.perf_counter() - STARTED)


def log(message: str) -> None:
    print(f"[loader {time.perf_counter() - STARTED:5.1f}s] {message}", flush=True)


def failure(skipped: list[str], what: str, error: BaseException) -> None:
    """Record a failed measurement in ``skipped`` and print its traceback."""
    skipped.append(f"{what}: {type(error).__name__}: {error}"[:500])
    log(f"{what}: {type(error).__name__}: {error}"[:500])
    traceback.print_exc()


# --- data ---

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "grey", "teal")
THINGS = ("square", "circle", "field", "gradient", "cloud", "wave", "stripe", "blob")


def synthetic_jpeg(index: int) -> bytes:
    """A smooth random colour field (a bicubic upscale of 6x6 random pixels) plus noise, so the
    entropy coder has work as in a photo; a side of 256-320 px (toy: 40-56), JPEG q90."""
    rng = np.random.default_rng(index)
    width, height = (int(rng.integers(SIDES[0], SIDES[1] + 1)) for _ in range(2))
    field = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), "RGB")
    smooth = np.asarray(field.resize((width, height), Image.BICUBIC), dtype=np.int16)
    noisy = np.clip(smooth + rng.integers(-12, 13, smooth.shape, dtype=np.int16), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy, "RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def write_synthetic_shards(folder: Path, total: int, threads: int) -> tuple[Path, dict]:
    """``total`` samples (the unique JPEGs cycled) as shards by clipkit's writer; (dir, stats)."""
    from clipkit.contract.types import Sample
    from clipkit.data.shard_writer import write_shards

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:  # PIL releases the GIL while coding
        images = list(pool.map(synthetic_jpeg, range(UNIQUE_IMAGES)))
    made = time.perf_counter() - began

    def samples():
        for i in range(total):
            rng = random.Random(i)
            caption = (
                f"a {rng.choice(COLOURS)} {rng.choice(THINGS)} next to a {rng.choice(COLOURS)} one, no. {i}"
            )
            yield Sample(
                key=f"synthetic-{i:06d}", image=images[i % len(images)], image_ext="jpg", captions=(caption,)
            )

    began = time.perf_counter()
    out = folder / "shards"
    write_shards(
        samples(), out, source="benchmarks/gpu/part_loader.py synthetic", samples_per_shard=pick(2048, 16)
    )
    written = time.perf_counter() - began
    stats = {
        "unique_images": len(images),
        "samples": total,
        "mean_jpeg_kb": round(sum(map(len, images)) / len(images) / 1e3, 1),
        "make_jpegs_s": round(made, 2),
        "write_shards_s": round(written, 2),
        "shard_mb": round(sum(p.stat().st_size for p in out.glob("*.tar")) / 1e6, 1),
    }
    return out, stats


# --- the loader ---


def training_pieces(shards: Path):
    """The ``clip`` recipe (``clip@tiny`` in a rehearsal) on ``shards``: (recipe, transform, tokenizer)."""
    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry
    from clipkit.model import build_slot, build_transform

    registry = default_registry()
    recipe = resolve(
        pick("clip", "clip@tiny"), [f"data.shards={shards}", f"data.batch_size={BATCH}"], registry
    )
    tokenizer = build_slot(registry, "tokenizer", recipe["model"]["tokenizer"], "model.tokenizer")
    return recipe, build_transform(recipe, train=True), tokenizer


def time_loader(shards: Path, recipe: dict, transform, tokenizer, workers: int) -> dict:
    """Start-up and steady images/s of clipkit's training BatchStream with ``workers`` workers."""
    from clipkit.config.recipe import section
    from clipkit.data.loader import BatchStream

    data = section(recipe, "data")
    stream = BatchStream(
        str(shards),
        batch_size=BATCH,
        transform=transform,
        tokenizer=tokenizer,
        seed=int(recipe.get("seed", 0)),
        num_workers=workers,
        shuffle_buffer=data.shuffle_buffer,
        resampled=data.resampled,
        views=1,
        meta_keys=dict(data.meta_keys),
    )
    rounds = max(1, workers)  # batches per round: one per worker (the main process when 0 workers)
    began = time.perf_counter()
    batches = iter(stream)
    arrivals = []
    shape = None
    try:
        for _ in range(rounds * (1 + TIMED_ROUNDS)):
            batch = next(batches)
            arrivals.append(time.perf_counter())
            shape = tuple(batch["image"].shape)
            batch = None
    finally:
        batches.close()  # ends the DataLoader's workers
    if stream.epoch != 0:
        raise RuntimeError("the timed batches crossed an epoch boundary (worker restart): write more samples")
    timed_images = rounds * TIMED_ROUNDS * BATCH
    timed_s = arrivals[-1] - arrivals[rounds - 1]
    return {
        "workers": workers,
        "startup_s": arrivals[0] - began,
        "first_round_s": arrivals[rounds - 1] - began,
        "images_per_s": timed_images / timed_s,
        "timed_images": timed_images,
        "timed_s": timed_s,
        "image_shape": shape,
    }


def step_consumption(out: Path) -> float | None:
    """The clipkit ViT-B/16 step's samples/s from ``vit_step.json`` in the same folder, if there."""
    path = out / "vit_step.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return next((f["value"] for f in record["figures"] if f.get("key") == "clipkit_samples_per_s"), None)


def shm_gib() -> float | None:
    """Size of /dev/shm (the workers hand batches over through it), GiB."""
    try:
        return shutil.disk_usage("/dev/shm").total / 2**30
    except OSError:
        return None


def main() -> None:
    out = parse_out()
    device()  # the contract: a real run is on the GPU machine (only a rehearsal runs elsewhere)
    from clipkit.config.machine import fit_to_machine, usable_cpus
    from clipkit.data.decoders import default_decoder

    torch.set_num_threads(1)  # the main process only receives batches
    cpus = usable_cpus()
    all_workers = pick(cpus, 2)
    auto_workers = fit_to_machine("auto", "auto", accelerator=torch.cuda.is_available()).workers
    decoder = "simplejpeg" if default_decoder() is not None else "PIL (simplejpeg not installed)"
    figures: list[dict] = []
    skipped: list[str] = []
    extra: dict = {"budget_s": BUDGET_S, "decoder": decoder, "usable_cpus": cpus, "dev_shm_gib": shm_gib()}

    def save() -> None:
        write_part(out, "loader", figures, skipped=skipped, extra=extra)

    log(f"{cpus} usable CPUs, decoder {decoder}, /dev/shm {extra['dev_shm_gib']} GiB")
    folder = Path(tempfile.mkdtemp(prefix="clipkit-gpu-loader-"))
    try:
        total = BATCH * max(all_workers, auto_workers, 1) * (1 + TIMED_ROUNDS)
        try:
            shards, stats = write_synthetic_shards(folder, total, max(1, cpus))
        except Exception as error:  # noqa: BLE001
            failure(skipped, "writing the synthetic shards failed", error)
            save()
            return
        extra["data"] = stats
        log(
            f"{stats['unique_images']} JPEGs (mean {stats['mean_jpeg_kb']} kB) in {stats['make_jpegs_s']} s; "
            f"{stats['samples']} samples written as shards ({stats['shard_mb']} MB) "
            f"in {stats['write_shards_s']} s"
        )
        recipe, transform, tokenizer = training_pieces(shards)
        consumption = step_consumption(out)
        save()

        runs = [(all_workers, "every usable CPU")]
        if auto_workers != all_workers:
            runs.append((auto_workers, "the recipe's num_workers: auto"))
        first_time = None
        for workers, why in runs:
            if first_time is not None and left() < first_time * 2 + 3:
                skipped.append(f"{workers} workers ({why}): budget ({left():.0f} s left)")
                continue
            began = time.perf_counter()
            try:
                result = time_loader(shards, recipe, transform, tokenizer, workers)
            except Exception as error:  # noqa: BLE001 - keep the other run's figures
                failure(skipped, f"{workers} workers ({why}) failed", error)
                continue
            first_time = first_time or time.perf_counter() - began
            add_figures(figures, result, why, decoder, consumption)
            save()
        if consumption is None:
            skipped.append(
                "loader / step consumption: no clipkit_samples_per_s in vit_step.json (part_vit_step.py "
                "did not run first into this folder)"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    extra["wall_s"] = round(time.perf_counter() - STARTED, 1)
    save()
    log(f"done in {extra['wall_s']} s")


def add_figures(figures: list, result: dict, why: str, decoder: str, consumption: float | None) -> None:
    workers, rate = result["workers"], result["images_per_s"]
    per_core = rate / max(1, workers)
    log(
        f"{workers} workers ({why}): {rate:.0f} images/s ({per_core:.0f} per worker) over "
        f"{result['timed_images']} images in {result['timed_s']:.2f} s; first batch after "
        f"{result['startup_s']:.2f} s, first round after {result['first_round_s']:.2f} s"
    )
    what = f"{workers} workers, batch {BATCH}, {result['image_shape'][-1]} px, {decoder}"
    figures.append(
        figure(
            f"clipkit training loader images/s, {what}",
            rate,
            "images/s",
            note=f"{why}; {TIMED_ROUNDS} rounds of one batch per worker after the first round "
            f"({result['timed_images']} images in {result['timed_s']:.2f} s)",
        )
    )
    figures.append(figure(f"clipkit training loader images/s per worker, {what}", per_core, "images/s/core"))
    figures.append(
        figure(
            f"clipkit training loader start-up (first batch), {what}",
            result["startup_s"],
            "s",
            note=f"worker start, shuffle buffer fill, first batch; the first round (one batch per worker) "
            f"after {result['first_round_s']:.2f} s",
        )
    )
    if consumption:
        ratio = rate / consumption
        needed = consumption / per_core
        log(
            f"{workers} workers: loader / clipkit step consumption = {ratio:.2f} "
            f"({needed:.1f} workers of this speed needed)"
        )
        figures.append(
            figure(
                f"loader images/s / clipkit step samples/s, {workers} workers",
                ratio,
                "x",
                goal=">= 1.0 (the GPU never waits on data)",
                met=ratio >= 1.0,
                note=f"{rate:.0f} images/s vs clipkit's step {consumption:.0f} samples/s (vit_step.json); "
                f"~{needed:.1f} workers of this speed would feed it",
            )
        )


if __name__ == "__main__":
    main()
