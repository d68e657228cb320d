"""``train.tiled`` in the training step: clip@tiny and siglip@tiny with ``tiled: true`` match
``tiled: false`` step for step (fp32), with exact gradient accumulation too; and two processes
(gloo, ``torchrun``) with tiles equal one process without (the exact gather modes, with and without
``train.micro_batch_size``; ``tests/distributed/tiled_equivalence.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clipkit.app import api
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry

REGISTRY = Registry(make_plugin_manager(autoload=False))
SOURCE = "synthetic://shapes?n=64&split=train&image_size=48"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data") / "shapes"
    api.shard(SOURCE, directory, registry=REGISTRY)
    return directory


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rows(spec: str, shards: Path, run_dir: Path, *extra: str) -> list[dict]:
    overrides = [f"data.shards={shards}", f"data.source={SOURCE}", "data.batch_size=16", "train.steps=4"]
    overrides += ["train.log_every=1", "train.export=false", "train.threads=1", *extra]
    api.train(spec, overrides, run_dir=run_dir, registry=REGISTRY)
    return metric_rows(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, extra",
    [("clip@tiny", ()), ("siglip@tiny", ()), ("clip@tiny", ("train.micro_batch_size=4",))],
    ids=["clip", "siglip", "clip-accumulated"],
)
def test_tiled_training_matches_full_step_for_step(spec, extra, shards, tmp_path):
    full = train_rows(spec, shards, tmp_path / "full", "train.tiled=false", *extra)
    tiled = train_rows(spec, shards, tmp_path / "tiled", "train.tiled=true", "train.tile_size=5", *extra)
    assert len(full) == len(tiled) == 4
    for want, got in zip(full, tiled, strict=True):
        for key in ("loss", "acc_i2t", "logit_scale"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, want["step"])


@pytest.fixture(scope="module")
def tiled_equivalence(tmp_path_factory):
    from test_distributed import torchrun

    out = tmp_path_factory.mktemp("tiled-equivalence")
    script = HERE / "distributed" / "tiled_equivalence.py"
    torchrun(script, str(out), cwd=out, processes=1)
    torchrun(script, str(out), cwd=out)
    return tuple(torch.load(out / f"tiled-{world}.pt", weights_only=False) for world in (1, 2))


def assert_close(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert set(got["grads"]) == set(want["grads"])
    size = max(t.abs().max().item() for t in want["grads"].values())
    for name, tensor in want["grads"].items():
        difference = (got["grads"][name] - tensor).abs().max().item()
        assert difference <= 1e-5 * size, f"{name}: off by {difference} (largest {size})"


@pytest.mark.slow
def test_two_processes_tiled_equal_one_process_full(tiled_equivalence):
    one, two = tiled_equivalence
    tiled_cases = [case for case in one if case[3]]
    assert len(tiled_cases) == 6
    for loss, local, micro, _ in tiled_cases:
        reference = one[(loss, False, 0, False)]  # one process, the whole batch, full logits
        for results in (one, two):
            assert_close(results[(loss, local, micro, True)], reference)
            assert_close(results[(loss, local, micro, False)], reference)


@pytest.mark.slow
def test_two_fsdp2_processes_tiled_equal_one_process_full(tiled_equivalence, tmp_path):
    """FSDP2 (sharded towers, replicated similarity): the tiled loss, global and local, with and
    without exact accumulation, gives the full-batch loss and gradients (issue 40)."""
    from test_distributed import torchrun

    torchrun(HERE / "distributed" / "tiled_equivalence.py", str(tmp_path), "fsdp2", cwd=tmp_path)
    one, sharded = tiled_equivalence[0], torch.load(tmp_path / "tiled-2-fsdp2.pt", weights_only=False)
    for loss, local, micro, tiled in [case for case in one if case[3]]:
        reference = one[(loss, False, 0, False)]
        assert_close(sharded[(loss, local, micro, tiled)], reference)
        assert_close(sharded[(loss, local, micro, False)], reference)
