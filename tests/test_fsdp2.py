"""FSDP2 without launching processes (issue 40): which modules are sharded, what the DCP files may
hold, which checkpoints a strategy resumes, the sharded memory estimate and ``clipkit validate``.

Training, gradients, checkpoints, resume and export under two gloo processes are in
tests/test_distributed.py; kill -9 then a bit-identical resume in tests/test_runtime.py.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.config.recipe import DistributedConfig, load_recipe
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import default_registry
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.model import build_model
from clipkit.train.runtime import check_resumable, dcp_files, partitions, sharding, wrapping

SMOKE = "quickstart@smoke"


@pytest.fixture(scope="module")
def smoke():
    registry = default_registry()
    recipe = load_recipe(SMOKE, [], registry=registry)
    return recipe, build_model(recipe, registry)


# ----------------------------------------------------------------------------- wrapping policy


def test_the_default_policy_shards_each_tower_block_by_block(smoke):
    _, model = smoke
    units = wrapping.units(model)
    for tower in (model.image_encoder, model.text_encoder):
        lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
        assert lists, "the smoke towers keep their blocks in a ModuleList"
        blocks = [block for block in lists[0] if any(True for _ in block.parameters())]
        assert blocks and all(any(block is unit for unit in units) for block in blocks)
        # children before their parent: fully_shard must see a block before its tower
        assert max(next(i for i, u in enumerate(units) if u is b) for b in blocks) < next(
            i for i, u in enumerate(units) if u is tower
        )
    assert not any(unit is model.similarity for unit in units)
    assert {id(p) for p in wrapping.replicated_parameters(model)} == {
        id(p) for p in model.similarity.parameters()
    }


class Declared(nn.Module):
    """An encoder that declares its own blocks: two of its three layers; its ModuleList is ignored."""

    def __init__(self):
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        self.unused = nn.ModuleList([nn.Linear(2, 2)])

    def sharding_blocks(self):
        return [self.stem, self.body]


def test_an_encoder_declares_its_blocks():
    tower = Declared()
    assert wrapping.blocks(tower) == [tower.stem, tower.body]
    tower.sharding_blocks = lambda: [nn.Linear(2, 2)]  # not one of its own modules
    with pytest.raises(TypeError, match="sub-modules of the encoder"):
        wrapping.blocks(tower)


def test_a_shared_tower_is_one_unit_set():
    model = nn.Module()
    model.image_encoder = model.text_encoder = Declared()
    assert len(wrapping.units(model)) == 3  # two blocks and the tower, once


def test_the_largest_unit_is_a_block_or_what_a_tower_leaves(smoke):
    _, model = smoke
    biggest = max(sum(p.numel() for p in u.parameters()) for u in wrapping.units(model))
    assert 0 < sharding.largest_unit_bytes(model, 2) <= 2 * biggest


# ----------------------------------------------------------------------------- DCP files


def test_split_keeps_plain_values_out_of_the_dcp_files_and_join_restores_them():
    model = {"a.weight": torch.ones(2), "b": torch.zeros(1)}
    optimizer = {
        "state": {"a.weight": {"momentum_buffer": None, "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight", "b"]}],
    }
    tensors, plain = dcp_files.split(model, optimizer)
    assert set(tensors) == {"model/a.weight", "model/b", "optimizer/a.weight/step"}
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert plain["optimizer_plain"] == {"a.weight": {"momentum_buffer": None}}
    got_model, got_optimizer = dcp_files.join(tensors, plain)
    assert got_model.keys() == model.keys()
    assert got_optimizer["param_groups"] == optimizer["param_groups"]
    assert got_optimizer["state"]["a.weight"]["momentum_buffer"] is None
    assert torch.equal(got_optimizer["state"]["a.weight"]["step"], torch.tensor(3.0))


def write_dcp(checkpoint: Path, tensors: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(dcp_files.directory(checkpoint)), no_dist=True)


def test_real_dcp_files_pass_the_check_and_consolidate(tmp_path):
    weight = torch.arange(6.0).reshape(2, 3)
    write_dcp(tmp_path, {"model/layer.weight": weight, "optimizer/layer.weight/exp_avg": weight * 2})
    dcp_files.check_files(tmp_path)
    assert torch.equal(dcp_files.consolidate(tmp_path)["layer.weight"], weight)
    _, optimizer = dcp_files.full_state(tmp_path, {})
    assert torch.equal(optimizer["state"]["layer.weight"]["exp_avg"], weight * 2)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_naming_code_is_refused_before_dcp_unpickles_it(tmp_path):
    write_dcp(tmp_path, {"model/w": torch.ones(2)})
    (dcp_files.directory(tmp_path) / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(ArtifactError, match="not allowed in DCP metadata.*--trust-checkpoint"):
        dcp_files.check_files(tmp_path)


def test_a_pickled_entry_is_refused(tmp_path):
    write_dcp(tmp_path, {"model/w": torch.ones(2), "model/extra": {"any": "object"}})
    with pytest.raises(ArtifactError, match="declares pickled entries"):
        dcp_files.check_files(tmp_path)


def test_missing_metadata_is_an_incomplete_checkpoint(tmp_path):
    dcp_files.directory(tmp_path).mkdir()
    with pytest.raises(ArtifactError, match="missing; the checkpoint is incomplete"):
        dcp_files.check_files(tmp_path)


# ----------------------------------------------------------------------------- which checkpoints resume


@pytest.mark.parametrize(
    ("form", "strategy", "resumes"),
    [
        ("ddp", "ddp", True),
        ("ddp", "fsdp2", True),
        ("fsdp2", "ddp", True),
        ("fsdp2", "fsdp2", True),
        ("deepspeed", "deepspeed", True),
        ("deepspeed", "fsdp2", False),
        ("deepspeed", "ddp", False),
        ("fsdp2", "deepspeed", False),
        ("ddp", "deepspeed", False),
    ],
)
def test_a_strategy_resumes_what_it_can_and_says_why_not(tmp_path, form, strategy, resumes):
    if form == "deepspeed":
        partitions.directory(tmp_path).mkdir()
    if form == "fsdp2":
        dcp_files.directory(tmp_path).mkdir()
    if resumes:
        check_resumable(strategy, tmp_path, {})
        return
    with pytest.raises(ClipkitError, match=f"strategy={form} run .* strategy={strategy} cannot resume"):
        check_resumable(strategy, tmp_path, {})


# ----------------------------------------------------------------------------- memory and validate


def test_the_memory_estimate_divides_what_fsdp2_shards(smoke):
    from clipkit.train.memory_fit import estimate_memory
    from clipkit.train.runtime import BatchPlan

    recipe, model = smoke
    plan = BatchPlan.split(32, 0, 4)

    def estimate(strategy):
        distributed = {**recipe["train"].get("distributed", {}), "strategy": strategy}
        configured = {**recipe, "train": {**recipe["train"], "distributed": distributed}}
        return estimate_memory(configured, model, plan, world_size=4, device="cpu", workers=0).parts

    ddp, fsdp2 = estimate("ddp"), estimate("fsdp2")
    for part in ("gradients", "optimiser state", "optimiser step"):
        assert fsdp2[part] == pytest.approx(ddp[part] / 4, abs=1), part
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert fsdp2["weights"] - buffers == pytest.approx((ddp["weights"] - buffers) / 4, abs=1)
    assert ddp["DDP buckets"] > 0 and fsdp2["DDP buckets"] == 0
    assert ddp["gathered blocks"] == 0 and fsdp2["gathered blocks"] == 2 * sharding.largest_unit_bytes(
        model, 4
    )


def test_zero_stages_shard_progressively():
    def fractions(stage):
        share = sharding.shares(DistributedConfig(strategy="deepspeed", zero_stage=stage), 4)
        return share.weights, share.gradients, share.optimizer, share.gathers

    assert fractions(1) == (1.0, 1.0, 0.25, False)
    assert fractions(2) == (1.0, 0.25, 0.25, False)
    assert fractions(3) == (0.25, 0.25, 0.25, True)


def test_validate_explains_the_strategy_and_refuses_fp16_with_fsdp2(in_tmp):
    app = make_app(make_plugin_manager(autoload=False))
    ok = CliRunner().invoke(
        app, ["validate", SMOKE, "train.distributed.strategy=fsdp2", "train.precision=bf16"]
    )
    assert ok.exit_code == 0, ok.output
    line = next(x for x in ok.output.splitlines() if x.startswith("# train.distributed.strategy"))
    assert "fsdp2" in line and "1/W" in line and "bf16 towers" in line and "ddp or fsdp2" in line
    refused = CliRunner().invoke(
        app, ["validate", SMOKE, "train.distributed.strategy=fsdp2", "train.precision=fp16"]
    )
    assert (
        refused.exit_code == 2 and "train.precision: train.precision=fp16 is not supported" in refused.output
    )


def test_a_changed_or_missing_shard_is_refused_by_the_manifest(tmp_path):
    """The DCP files are covered by checkpoint.json like every other file: resume and export
    refuse a checkpoint whose shard changed or went missing."""
    from clipkit.train.checkpoint import STATE, load_state, write_manifest

    write_dcp(tmp_path, {"model/w": torch.ones(4)})
    state = {"step": 2, "schedule": {}, "data": {"epoch": 0, "batch_in_epoch": 2}, "model": None}
    torch.save(state, tmp_path / STATE)
    write_manifest(tmp_path)
    assert load_state(tmp_path)["step"] == 2
    shard = next(dcp_files.directory(tmp_path).glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one byte changed
    with pytest.raises(ArtifactError, match="distcp"):
        load_state(tmp_path)
    shard.unlink()
    with pytest.raises(ArtifactError, match="distcp"):
        load_state(tmp_path)


def test_a_launcher_asking_for_fsdp_must_agree_with_the_recipe(monkeypatch):
    from clipkit.train.runtime import check_launcher_agrees

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(
        ClipkitError, match="--use_fsdp .*strategy is 'ddp'; set train.distributed.strategy=fsdp2"
    ):
        check_launcher_agrees(DistributedConfig())
    check_launcher_agrees(DistributedConfig(strategy="fsdp2"))
    assert os.environ["ACCELERATE_USE_FSDP"] == "false"  # Accelerate's own FSDP plugin stays out


def test_the_resnet_declares_each_residual_block():
    """Its stages are nn.Sequentials, which the default policy would not look into."""
    from clipkit.plugins.encoders.resnet import resnet

    tower = resnet(embed_dim=8, image_size=32, layers=(1, 2, 1, 1), width=4, block="basic", stem="cifar")
    blocks = wrapping.blocks(tower)
    assert len(blocks) == 5 and blocks == [block for stage in tower.stages() for block in stage]
    assert wrapping.default_blocks(tower) == []
