"""Distillation (issue 39 item 2) under two processes on CPU with a live teacher: DDP with the global
loss (every process scores the gathered batch, the teacher's logits over it), and DeepSpeed ZeRO-2 with
a local loss (each process scores its own anchors against the gathered candidates, the teacher's
logits over the same rows and columns); tests/test_distill.py covers the terms in one process.
ZeRO-3 / FSDP2 with a live teacher are refused at validation
(tests/test_distill.py::test_recipe_checks_name_the_key)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_distributed import COMMON, accelerate_launch

from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe
from clipkit.contract.registry import default_registry
from clipkit.model import build_model

pytestmark = pytest.mark.slow


STRATEGIES = {
    "ddp": [],
    "zero2-local": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2",
                    "train.distributed.local_loss=true"],
}  # fmt: skip


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_launched_with_a_live_teacher(tmp_path, strategy):
    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed")
    from clipkit.app import api

    api.shard("synthetic://shapes?n=512&split=train&image_size=48", tmp_path / "data" / "smoke-shapes")
    registry = default_registry()
    recipe = load_recipe("quickstart@smoke", ["model.embed_dim=32"], registry=registry)
    torch.manual_seed(5)
    write_export(build_model(recipe, registry), recipe, tmp_path / "teacher", registry)
    run = tmp_path / "run"
    overrides = [*COMMON, *STRATEGIES[strategy], "train.export=false",
                 f"train.distill.teacher={tmp_path / 'teacher'}"]  # fmt: skip
    accelerate_launch("train", *overrides, "--run-dir", str(run), cwd=tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "distill/kl" in row]
    assert len(logged) == 4, rows
    for row in logged:
        assert math.isfinite(row["distill/kl"]) and row["distill/kl"] > 0
        assert row["loss"] == pytest.approx(row["contrastive"] + row["distill/kl"], rel=1e-5)
