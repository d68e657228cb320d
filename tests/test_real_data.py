"""The data issue's "done when", as a test: shard real captioned data, train a recipe on it, evaluate.

Uses ../shared/data (CI has it; a user's clone does not, so these skip there).
"""

from __future__ import annotations

import json
import math

import pytest

from clipkit.app import api
from clipkit.data.shard import verify_shards


def test_shard_coco_mini_train_on_it_and_evaluate_retrieval(shared_data, in_tmp, registry):
    table = shared_data / "coco-mini-cc-by" / "captions.jsonl"
    rows = [json.loads(line) for line in table.read_text(encoding="utf-8").splitlines() if line.strip()]
    manifest = api.shard(str(table), in_tmp / "coco", samples_per_shard=20, registry=registry)
    assert manifest["n"] == len(rows) == 51 and [s["count"] for s in manifest["shards"]] == [20, 20, 11]
    assert verify_shards(in_tmp / "coco")["problems"] == []

    overrides = ["data.shards=coco", "data.source=", "data.batch_size=16", "train.steps=6",
                 "train.checkpoint_every=3", "model.image_size=32", "eval=[]"]  # fmt: skip
    result = api.train("clip@tiny", overrides, run_dir=in_tmp / "run", registry=registry)
    assert math.isfinite(result.metrics["loss"])
    assert (result.export_dir / "model.safetensors").is_file()
    report = api.evaluate(result.export_dir, [{"name": "retrieval", "data": "coco"}], registry=registry)
    (task,) = report["results"]
    # The standard 5-captions protocol: every caption of every image is a query.
    assert task["n_images"] == 51 and task["n_texts"] == 255
    for direction in ("i2t", "t2i"):
        recalls = [task[f"{direction}_R@{k}"] for k in (1, 5, 10)]
        assert recalls == sorted(recalls) and recalls[0] >= 0.0 and recalls[-1] <= 1.0
    # Chance for this gallery: a caption finds its image among 51 with K/51; an image has 5 of the
    # 255 captions, so it misses at K = 5 only if all 5 slots go to the other 250.
    chance = task["chance_recall"]
    assert chance["t2i_R@1"] == pytest.approx(1 / 51) and chance["t2i_R@10"] == pytest.approx(10 / 51)
    assert chance["i2t_R@5"] == pytest.approx(1 - math.comb(250, 5) / math.comb(255, 5))
    assert task["n_distinct_texts"] == len({c.strip() for row in rows for c in row["captions"]})
