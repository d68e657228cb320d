"""Weight EMA (issue 39 item 1) under two processes on CPU: DDP and DeepSpeed ZeRO-2 launched with
``accelerate launch``; the average is checkpointed, resumed bit-identically, evaluated during
training, and (when both ran) the same under ZeRO as under DDP. ZeRO-1 reads the module's weights
as ZeRO-2 does (both keep whole weights on every process); it is accepted, not launched here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_distributed import COMMON, accelerate_launch

from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
EMA = ["train.ema.decay=0.8", "train.ema.warmup=2", "train.ema.eval=both", "train.eval_every=2"]
STRATEGIES = {
    "ddp": [],
    "zero2": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2"],
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from clipkit.app import api

    root = tmp_path_factory.mktemp("ema-launch")
    api.shard("synthetic://shapes?n=512&split=train&image_size=48", root / "data" / "smoke-shapes")
    return root


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_launched_ema_resumes_bit_identically_and_is_evaluated(shards, strategy):
    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed")
    root = shards
    full, resumed = root / f"{strategy}-full", root / f"{strategy}-resumed"
    overrides = [*COMMON, *STRATEGIES[strategy], *EMA, "train.export=false"]
    accelerate_launch("train", *overrides, "--run-dir", str(full), cwd=root)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "recipe.yaml", resumed / "recipe.yaml")
    shutil.copytree(full / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    accelerate_launch(
        "train", "quickstart@smoke", "train.export=false", "--resume", "--run-dir", str(resumed), cwd=root
    )
    expected = load_checkpoint(list_checkpoints(full)[-1])
    got = load_checkpoint(list_checkpoints(resumed)[-1])
    assert expected["ema"]["applied_steps"] == got["ema"]["applied_steps"] == 4
    for key, tensor in expected["ema"]["weights"].items():
        assert torch.equal(got["ema"]["weights"][key], tensor), key
        assert tensor.dtype == torch.float32
    assert any(not torch.equal(t, expected["model"][k]) for k, t in expected["ema"]["weights"].items())
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert any(key.startswith("eval_ema/") for row in rows for key in row)
    ddp = root / "ddp-full"
    if strategy != "ddp" and list_checkpoints(ddp):  # the same SGD steps: the same average
        reference = load_checkpoint(list_checkpoints(ddp)[-1])["ema"]["weights"]
        for key, tensor in reference.items():
            assert torch.allclose(expected["ema"]["weights"][key], tensor, rtol=1e-5, atol=1e-5), key
