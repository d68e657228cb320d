"""Issue 17's done-when: a table of transparent PNG drawings -> `clipkit shard` -> `clipkit train
clip@tiny --data` -> the default report scores the held-out split of that table (retrieval) and
zero-shot over its label column, and the pixels the model sees carry the chosen background."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.app.own_data import is_held_out

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
HIDDEN = (200, 0, 200)  # the colour under the transparent pixels: must never reach the model


def write_drawings(directory, n: int = 96) -> str:
    """``n`` circles, alternately red and blue, on fully transparent 48 × 48 canvases."""
    rows = []
    for i in range(n):
        name = list(COLOURS)[i % 2]
        image = Image.new("RGBA", (48, 48), (*HIDDEN, 0))
        radius = 10 + i % 7
        ImageDraw.Draw(image).ellipse(
            (24 - radius, 24 - radius, 24 + radius, 24 + radius), (*COLOURS[name], 255)
        )
        image.save(directory / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": f"a {name} circle", "category": name})
    (directory / "drawings.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return "drawings.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shard", "load"])
def test_transparent_drawings_end_to_end(in_tmp, monkeypatch, where):
    from clipkit.data import loader as data_module
    from clipkit.model import ContrastiveModel

    seen_images, trained = [], []
    encode = ContrastiveModel.encode_image
    monkeypatch.setattr(
        ContrastiveModel, "encode_image", lambda self, x: seen_images.append(x) or encode(self, x)
    )
    collate = data_module.EpochDataset.collate

    def recording_collate(self, records):
        batch = collate(self, records)
        trained.extend(batch["index"].tolist())
        return batch

    monkeypatch.setattr(data_module.EpochDataset, "collate", recording_collate)
    runner, app = CliRunner(), make_app()
    table = write_drawings(in_tmp)
    # The background chosen once: at shard time (stored flattened) or at load time (data.background).
    shard_args = ["-o", "background=black"] if where == "shard" else []
    outcome = runner.invoke(app, ["shard", table, "shards", *shard_args])
    assert outcome.exit_code == 0, outcome.output
    manifest = json.loads((in_tmp / "shards" / "manifest.json").read_text())
    assert manifest["info"]["alpha_images"] == 96
    assert manifest["info"]["alpha_flattened"] == (96 if where == "shard" else 0)

    # A few steps keep the test short; the recipe needs nothing else to run on this table.
    # memory_check=false: its two measuring forwards on random images would be recorded as training.
    speed = ["train.steps=2", "data.batch_size=16", "data.num_workers=0", "train.memory_check=false"]
    background = [] if where == "shard" else ["data.background=black"]
    args = [
        "train",
        "clip@tiny",
        "--data",
        "shards",
        "--label",
        "category",
        "--run-dir",
        "run",
        *speed,
        *background,
    ]
    outcome = runner.invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    assert "held out for evaluation" in outcome.output
    report = (in_tmp / "run" / "eval.md").read_text()  # names the data (and split) each eval used
    assert "| retrieval " in report and "/shards[held-out 5%] |" in report
    assert "/shards[held-out 5%]:category | top1 |" in report

    results = {r["name"]: r for r in json.loads((in_tmp / "run" / "eval.json").read_text())["results"]}
    keys = [str(i) for i in range(96)]  # the table source keys rows by number
    held = [k for k in keys if is_held_out(k, 0.05)]
    assert 0 < len(held) < 96
    retrieval, zero_shot = results["retrieval"], results["zero_shot"]
    assert retrieval["data"].startswith("holdout:") and retrieval["n_images"] == len(held)
    assert zero_shot["label"] == "category" and zero_shot["num_classes"] == 2 and zero_shot["n"] == len(held)
    # Held-out rows never reach training (tests/test_own_data.py checks it sample by sample): the
    # batches index the training samples only, 0 .. 96 - len(held) - 1, each once per epoch.
    assert trained and max(trained) < 96 - len(held) and len(set(trained)) == len(trained)

    # Every image the model saw (training and evaluation): black where the drawing is transparent.
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    pixels = torch.cat(seen_images) * std + mean  # back to [0, 1]
    corners = pixels[..., :4, :4]
    assert corners.abs().max() < 0.02  # black, not the hidden magenta
    centre = pixels[..., 22:26, 22:26].mean(dim=(-1, -2))  # [N, 3]: red or blue, never black
    assert (centre.max(dim=1).values > 0.6).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    ["clip@tiny", "nuclr@tiny", "cloob@tiny", "siglip@tiny", "kme_clip@tiny", "wpse@tiny", "quickstart"],
)
def test_a_table_smaller_than_one_batch_trains_with_a_tiny_variant(in_tmp, recipe):
    """Every tiny variant (batch 32 or 64; quickstart 128) runs on a 30-row table with nothing but
    --data: the 26 training rows after a 25 % held-out split train as one batch (data.fit_batch) with
    a notice; NUCLR's per-sample ζ is indexed by the place among the training samples.
    data.fit_batch=false refuses as before. (yaware@tiny also needs data.meta_keys: its loss reads
    continuous columns, see test_own_data.py.)"""
    runner, app = CliRunner(), make_app()
    table = write_drawings(in_tmp, n=30)
    held = sum(is_held_out(str(i), 0.25) for i in range(30))
    args = ["train", recipe, "--data", table, "--holdout", "0.25", "train.steps=1", "data.num_workers=0"]
    outcome = runner.invoke(app, [*args, "--run-dir", "run"])
    assert outcome.exit_code == 0, outcome.output
    assert f"data: {held} of 30 samples held out for evaluation, {30 - held} to train on" in outcome.output
    assert f"data.batch_size -> {30 - held} (data.fit_batch" in outcome.output
    saved = json.loads((in_tmp / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert saved["step"] == 1
    refused = runner.invoke(app, [*args, "--run-dir", "run2", "data.fit_batch=false"])
    assert refused.exit_code != 0 and "fewer than one batch" in refused.output


def test_an_empty_held_out_split_is_refused_before_training(in_tmp):
    """5 % of a 30-row table is no row at all (by the key hash): say so before training, not after."""
    runner, app = CliRunner(), make_app()
    table = write_drawings(in_tmp, n=30)
    assert not any(is_held_out(str(i), 0.05) for i in range(30))
    outcome = runner.invoke(app, ["train", "clip@tiny", "--data", table, "--run-dir", "run"])
    assert outcome.exit_code != 0
    assert "data.holdout 0.05 holds out none of its 30 samples" in outcome.output
    assert not (in_tmp / "run" / "metrics.jsonl").exists()
