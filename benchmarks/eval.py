"""Eval throughput: images/s of clipkit's ``zero_shot`` and ``retrieval`` tasks vs a bare loop, same model.

Set-up (untimed): train ``--recipe`` (default ``clip@tiny``) for a few steps on a small synthetic
shard set, export it (``clipkit.app.api.export``), load the export (``clipkit.artifacts.reader.load_export``),
and write the evaluation images (``synthetic://shapes`` held-out split, ``--images`` of them) as
shards with ``clipkit.app.api.shard``, so that every row reads the same PNG files from disk.

Rows (timed; per task, everything from the shard files to the metric):

- clipkit: ``clipkit.eval.evaluate.run_evals(model, [task])`` — the code ``clipkit eval`` runs —
  for ``zero_shot`` (label ``colour``: 8 classes × 10 templates from the source's label set) and
  ``retrieval`` (one caption per image). ``feature_seeds: 1``, so a random-feature similarity is
  scored once, like the bare loop.
- bare: what a script writes for the same model without clipkit's eval code: ``tarfile`` +
  ``json`` to read the shards, PIL to decode, resize the shorter side (bicubic), centre-crop,
  normalise, ``model.encode_image`` / ``model.encode_text`` in batches of 256 under
  ``torch.no_grad``, the model's similarity (and its prompt ``ensemble`` rule) for the logits,
  then top-1 / Recall@1, 5, 10.
- encode only: ``model.encode_image`` on the already preprocessed image tensors (batches of 256):
  the model-bound ceiling of any eval path.

Every row runs once untimed, then ``--repeats`` rounds run every row once in a shuffled order.
Figures are images/s (median and best over rounds, wall clock and CPU time of the process) and
clipkit / bare per round. One thread (``torch.set_num_threads(1)``). Usage (repository root):

    python benchmarks/eval.py [--recipe clip@tiny] [--images 1000] [--repeats 10] [--train-steps 20]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from measure import interleaved, machine_line, markdown_header, markdown_row, ratio_spread, timed
from PIL import Image

LABEL = "colour"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="clip@tiny")
    parser.add_argument(
        "--images", type=int, default=1000, help="evaluation images (synthetic held-out split)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (after one warm-up round)")
    parser.add_argument("--train-steps", type=int, default=20, help="training steps before the export")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 = per core)")
    return parser.parse_args()


# --- set-up: a trained export and the evaluation shards ---


def train_and_export(spec: str, steps: int, root: Path, registry):
    """Train ``spec`` briefly on small synthetic shards and export it; returns (model, export dir)."""
    from clipkit.app import api
    from clipkit.artifacts.reader import load_export

    recipe = api.resolve(spec, [], registry)
    source = f"synthetic://shapes?n={int(recipe['data']['batch_size']) * 4}&split=train&image_size=48"
    overrides = [
        f"data.shards={root / 'train-shards'}",
        f"data.source={source}",
        "data.num_workers=0",
        f"train.steps={steps}",
        f"train.checkpoint_every={steps}",
        "train.export=false",
    ]
    run_dir = root / "run"
    api.train(spec, overrides, run_dir=run_dir, registry=registry)
    export_dir = api.export(run_dir, root / "export", registry=registry)
    model, _ = load_export(export_dir, registry)
    return model, export_dir


def read_shards(directory: Path) -> tuple[list[dict], dict]:
    """Every record of a shard set as {extension: bytes} (tar order), and the manifest."""
    manifest = json.loads((directory / "manifest.json").read_text())
    records: list[dict] = []
    for shard in manifest["shards"]:
        with tarfile.open(directory / shard["name"]) as tar:
            current_key, record = None, {}
            for member in tar:
                key, _, extension = member.name.partition(".")
                if key != current_key and record:
                    records.append(record)
                    record = {}
                current_key = key
                record[extension] = tar.extractfile(member).read()
            if record:
                records.append(record)
    return records, manifest


# --- the bare loop ---


class PlainPreprocess:
    """Resize the shorter side to S (PIL bicubic), centre-crop S × S, to float, normalise."""

    def __init__(self, image_size: int, mean, std) -> None:
        self.size = image_size
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __call__(self, data: bytes) -> torch.Tensor:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        scale = self.size / min(image.size)
        width, height = (
            max(self.size, round(image.width * scale)),
            max(self.size, round(image.height * scale)),
        )
        image = image.resize((width, height), Image.BICUBIC)
        left, top = (width - self.size) // 2, (height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - self.mean) / self.std


@torch.no_grad()
def encode_in_batches(encode, items: list, batch_size: int = 256):
    """Concatenated PointSets of ``encode`` over batches of ``items`` (stacked tensors or text lists)."""
    from clipkit.contract.types import PointSet

    parts = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        parts.append(encode(torch.stack(chunk) if isinstance(chunk[0], torch.Tensor) else chunk))
    return PointSet.cat(parts)


def bare_zero_shot(model, shards: Path) -> dict[str, float]:
    records, manifest = read_shards(shards)
    described = manifest["info"]["labels"][LABEL]
    classnames, templates = described["classes"], described["templates"]
    preprocess = PlainPreprocess(model.transform.image_size, model.transform.mean, model.transform.std)
    images = [preprocess(record["png"]) for record in records]
    labels = torch.tensor([classnames.index(json.loads(record["json"])["meta"][LABEL]) for record in records])
    with torch.no_grad():
        image_points = encode_in_batches(model.encode_image, images)
        prompts = [template.format(name) for name in classnames for template in templates]
        text_points = encode_in_batches(lambda texts: model.encode_text(model.tokenizer(texts)), prompts)
        groups = torch.arange(len(classnames)).repeat_interleave(len(templates))
        class_points = model.similarity.ensemble(text_points, groups)
        logits = model.similarity(image_points, class_points, generator=torch.Generator().manual_seed(0)).i2t
    return {"top1": float((logits.argmax(1) == labels).float().mean())}


def bare_retrieval(model, shards: Path) -> dict[str, float]:
    records, _ = read_shards(shards)
    preprocess = PlainPreprocess(model.transform.image_size, model.transform.mean, model.transform.std)
    images = [preprocess(record["png"]) for record in records]
    captions = [json.loads(record["json"])["captions"] for record in records]
    texts = [caption for image_captions in captions for caption in image_captions]
    owner = torch.tensor([i for i, image_captions in enumerate(captions) for _ in image_captions])
    with torch.no_grad():
        image_points = encode_in_batches(model.encode_image, images)
        text_points = encode_in_batches(lambda chunk: model.encode_text(model.tokenizer(chunk)), texts)
        logits = model.similarity(image_points, text_points, generator=torch.Generator().manual_seed(0)).i2t
    i2t_hits = (owner[logits.topk(10, dim=1).indices] == torch.arange(len(records)).unsqueeze(1)).int()
    t2i_hits = (logits.t().topk(10, dim=1).indices == owner.unsqueeze(1)).int()
    result = {}
    for k in (1, 5, 10):
        result[f"i2t_R@{k}"] = float(i2t_hits[:, :k].amax(1).float().mean())
        result[f"t2i_R@{k}"] = float(t2i_hits[:, :k].amax(1).float().mean())
    return result


# --- timing ---


def time_rows(rows: dict[str, Callable[[], dict]], repeats: int) -> tuple[dict, dict]:
    """({label: [(wall, CPU) seconds per round]}, {label: the row's result of its warm-up run})."""
    results = {label: run() for label, run in rows.items()}
    seconds = interleaved({label: (lambda run=run: timed(run)) for label, run in rows.items()}, repeats)
    return seconds, results


def print_table(task: str, images: int, seconds: dict, results: dict, bare_label: str) -> None:
    print()
    print(
        markdown_header(
            f"{task}: {images} images", "img/s wall (median)", "img/s wall (best)", "img/s CPU (median)",
            "img/s CPU (best)", "× bare (time), wall", "× bare (time), CPU", "result",
        )
    )  # fmt: skip
    bare_wall, bare_cpu = zip(*seconds[bare_label], strict=True)
    for label, values in seconds.items():
        wall, cpu = zip(*values, strict=True)
        print(
            markdown_row(
                label, f"{images / statistics.median(wall):.0f}", f"{images / min(wall):.0f}",
                f"{images / statistics.median(cpu):.0f}", f"{images / min(cpu):.0f}",
                ratio_spread(wall, bare_wall), ratio_spread(cpu, bare_cpu), describe(results[label]),
            )
        )  # fmt: skip


def describe(result: dict) -> str:
    keys = [k for k in ("top1", "i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@5") if k in result]
    return ", ".join(f"{k} {result[k]:.3f}" for k in keys) or "—"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import accelerate

    import clipkit
    from clipkit.app import api
    from clipkit.contract.registry import default_registry
    from clipkit.eval.evaluate import run_evals

    print(machine_line(("accelerate", accelerate.__version__), ("clipkit", clipkit.__version__)))
    registry = default_registry()
    with tempfile.TemporaryDirectory(prefix="clipkit-eval-bench-") as folder:
        root = Path(folder)
        model, export_dir = train_and_export(args.recipe, args.train_steps, root, registry)
        shards = root / "eval-shards"
        api.shard(f"synthetic://shapes?split=heldout&n={args.images}&seed=1&image_size=48", shards)
        print(
            f"{args.recipe} trained {args.train_steps} steps, exported and loaded; {args.images} held-out "
            f"48 px PNG images in {shards.name}; {args.repeats} rounds after a warm-up round"
        )
        records, _ = read_shards(shards)
        preprocess = PlainPreprocess(model.transform.image_size, model.transform.mean, model.transform.std)
        tensors = [preprocess(record["png"]) for record in records]
        tasks = {
            "zero_shot": {"name": "zero_shot", "data": str(shards), "label": LABEL, "feature_seeds": 1},
            "retrieval": {"name": "retrieval", "data": str(shards), "feature_seeds": 1},
        }
        bare = {"zero_shot": bare_zero_shot, "retrieval": bare_retrieval}
        for task, config in tasks.items():
            rows = {
                f"clipkit run_evals([{task}])": lambda config=config: run_evals(model, [config], registry)[0],
                f"bare loop ({task})": lambda task=task: bare[task](model, shards),
                "encode only (model.encode_image, preprocessed)": lambda: (
                    encode_in_batches(model.encode_image, tensors),
                    {},
                )[1],
            }
            seconds, results = time_rows(rows, args.repeats)
            print_table(task, len(records), seconds, results, f"bare loop ({task})")


if __name__ == "__main__":
    main()
