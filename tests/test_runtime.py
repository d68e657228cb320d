"""One-process runtime features (issue 7): precision, non-finite handling, exact accumulation,
gradient checkpointing, recipe checks, the DeepSpeed config, and kill -9 then bit-identical resume."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from smoke_data import place_smoke_shards

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.contract.registry import default_registry
from clipkit.errors import ClipkitError, RecipeError
from clipkit.train.accumulate import accumulate_exactly
from clipkit.train.build import build_trainer
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint
from clipkit.train.loop import train_loop
from clipkit.train.runtime import split_batch
from clipkit.train.runtime.deepspeed_config import deepspeed_config

SMOKE = "quickstart@smoke"


@pytest.fixture(scope="module")
def registry():
    return default_registry()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch, smoke_shards):
    """A temporary working directory already holding quickstart@smoke's shards: the runtime is the
    point here, not sharding at the start of training."""
    monkeypatch.chdir(tmp_path)
    place_smoke_shards(tmp_path, smoke_shards)
    return tmp_path


def trainer_for(registry, run_dir: Path, *overrides: str):
    recipe = validate_or_raise(load_recipe(SMOKE, list(overrides), registry=registry), registry)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return build_trainer(recipe, run_dir, registry)


def first_batch(trainer) -> dict:
    return trainer.runtime.to_device(next(iter(trainer.stream)))


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


# ----------------------------------------------------------------------------- accumulation


def gradients(trainer) -> dict[str, torch.Tensor]:
    named = trainer.model.named_parameters()
    return {k: p.grad.detach().clone() for k, p in named if p.grad is not None}


def test_exact_accumulation_equals_the_full_batch(registry, in_tmp):
    full = trainer_for(registry, in_tmp / "a")
    micro = trainer_for(registry, in_tmp / "b", "train.micro_batch_size=8")  # 32 = 4 × 8
    assert micro.runtime.plan.micro_batches == 4
    batch = first_batch(full)
    loss, out = full.step(batch, 0)
    loss.backward()
    accumulated, finite = accumulate_exactly(micro.step, micro.objective, batch, 0, 0.0, lambda out: True)
    assert finite
    assert float(accumulated.loss.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    expected, got = gradients(full), gradients(micro)
    assert set(expected) == set(got) and "similarity.log_scale" in got
    largest = max(t.abs().max().item() for t in expected.values())
    for name, tensor in expected.items():
        assert (got[name] - tensor).abs().max().item() <= 1e-5 * largest, name


def test_naive_micro_batches_would_differ(registry, in_tmp):
    """The check above can fail: the mean of per-micro-batch losses (fewer negatives) is another loss."""
    trainer = trainer_for(registry, in_tmp / "a")
    batch = first_batch(trainer)
    _, whole = trainer.step(batch, 0)
    pieces = []
    for start in range(0, 32, 8):
        piece = {k: (v[start : start + 8] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        pieces.append(trainer.step(piece, 0).out)
    naive = sum(float(p.loss.detach()) for p in pieces) / len(pieces)
    assert abs(naive - float(whole.loss.detach())) > 0.1


def test_accumulation_is_refused_for_per_sample_state(registry, in_tmp):
    with pytest.raises(ClipkitError, match="per-sample state"):
        trainer_for(registry, in_tmp / "a", "loss.name=sogclr", "train.micro_batch_size=8")


def test_accumulation_is_refused_under_zero3(registry, in_tmp):
    zero3 = ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"]
    with pytest.raises(ClipkitError, match="not supported under ZeRO-3"):
        trainer_for(registry, in_tmp / "a", *zero3, "train.micro_batch_size=8")


def test_batch_must_split_into_micro_batches(registry, in_tmp):
    with pytest.raises(ClipkitError, match="micro_batch_size:? 5 does not divide"):
        trainer_for(registry, in_tmp / "a", "train.micro_batch_size=5")
    assert split_batch(512, 64, 8) == (64, 64)
    assert split_batch(512, 16, 8) == (64, 16)
    with pytest.raises(ClipkitError, match="does not divide among 3 processes"):
        split_batch(512, 0, 3)


# ----------------------------------------------------------------------------- precision


def test_bf16_runs_the_towers_in_bf16_and_the_loss_in_fp32(registry, in_tmp):
    trainer = trainer_for(registry, in_tmp / "a", "train.precision=bf16")
    seen = {}

    def record(module, inputs, output):
        seen.setdefault("tower", output.points.dtype)

    def record_pair(module, inputs, pair):
        seen["loss_input"] = pair[0].points.dtype  # what the towers hand the gather and the loss

    trainer.model.image_encoder.register_forward_hook(record)
    trainer.model.register_forward_hook(record_pair)
    batch = first_batch(trainer)
    seen["loss"] = trainer.step(batch, 0).out.loss.dtype
    assert seen == {"tower": torch.bfloat16, "loss_input": torch.bfloat16, "loss": torch.float32}


class RecordingLoss:
    """Wraps a loss; records the dtype of the logits it is handed and of the loss it returns."""

    def __init__(self, loss, seen: dict) -> None:
        self.loss, self.seen, self.requires = loss, seen, loss.requires

    def __call__(self, logits, targets, ctx):
        out = self.loss(logits, targets, ctx)
        self.seen.update(logits=(logits.i2t.dtype, logits.t2i.dtype), loss=out.loss.dtype)
        return out


def test_half_similarity_precision_feeds_bf16_features_and_reduces_the_loss_in_fp32(registry, in_tmp):
    """train.similarity_precision=half: the features enter the similarity in bf16, its logits come
    out in fp32 (products accumulated in fp32) and the loss reduces in fp32; equal to the fp32
    path up to the features' rounding to bf16 (8 bits: relative 2^-9 per feature)."""
    seen: dict = {}
    half = trainer_for(registry, in_tmp / "half", "train.precision=bf16", "train.similarity_precision=half")
    full = trainer_for(registry, in_tmp / "full", "train.precision=bf16")
    assert half.objective.feature_dtype == torch.bfloat16 and full.objective.feature_dtype == torch.float32
    full.model.load_state_dict(half.model.state_dict())

    def record_similarity(module, inputs, output):
        seen["similarity_input"] = inputs[0].points.dtype

    half.model.similarity.register_forward_hook(record_similarity)
    half.objective.loss = RecordingLoss(half.loss, seen)
    batch = first_batch(half)
    out = half.step(batch, 0).out
    assert seen == {
        "similarity_input": torch.bfloat16,
        "logits": (torch.float32, torch.float32),
        "loss": torch.float32,
    }
    reference = full.step(batch, 0).out
    torch.testing.assert_close(out.loss, reference.loss, rtol=2e-2, atol=0.0)
    out.loss.backward()  # the gradient reaches the towers through the bf16 features
    assert all(p.grad is not None for p in half.model.image_encoder.parameters() if p.requires_grad)


def test_half_similarity_precision_keeps_fp32_without_half_towers_and_refuses_fp32_only_similarities(
    registry, in_tmp
):
    fp32 = trainer_for(registry, in_tmp / "a", "train.similarity_precision=half")  # precision: no
    assert fp32.objective.feature_dtype == torch.float32
    with pytest.raises(ClipkitError, match="does not declare half_features"):
        trainer_for(
            registry,
            in_tmp / "b",
            "train.precision=bf16",
            "train.similarity_precision=half",
            "similarity={name: kme}",
        )


def test_fp16_uses_a_grad_scaler_that_skips_overflowing_steps(registry, in_tmp):
    from clipkit.train.loop import train_step

    trainer = trainer_for(registry, in_tmp / "a", "train.precision=fp16", "train.steps=12")
    scaler = trainer.runtime._strategy.scaler  # white-box: the GradScaler the DDP strategy steps with
    assert scaler is not None
    before = parameters(trainer)
    # A scale so large that the scaled fp16 gradients overflow (fp16 max 65504): inf gradients. 2^24
    # overflows any gradient above 0.004 (the logit scale's is ~0.1-1), with few halvings after.
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**24})
    batch = first_batch(trainer)
    outcome = train_step(trainer, batch, 0)
    assert not outcome.applied and trainer.skipped_steps == 1
    assert scaler.get_scale() == 2.0**23  # halved
    for name, tensor in parameters(trainer).items():
        assert torch.equal(tensor, before[name]), name  # the overflowing step changed nothing
    steps = 1
    while not outcome.applied and steps < 40:  # fp16 gradients overflow above ~2^16: halve until they fit
        outcome, steps = train_step(trainer, batch, steps), steps + 1
    assert outcome.applied and trainer.skipped_steps == steps - 1
    assert any(not torch.equal(t, before[k]) for k, t in parameters(trainer).items())


# ----------------------------------------------------------------------------- non-finite losses


class PoisonAt:
    """Wraps a loss; its value is NaN at one step."""

    def __init__(self, loss, step):
        self.loss, self.step, self.requires = loss, step, loss.requires | {"step"}

    def __call__(self, logits, targets, ctx):
        out = self.loss(logits, targets, ctx)
        if ctx.step == self.step:
            return type(out)(loss=out.loss * float("nan"), metrics=out.metrics)
        return out


def test_nonfinite_loss_stops_with_the_step_by_default(registry, in_tmp):
    trainer = trainer_for(registry, in_tmp / "a", "train.steps=4")
    trainer.objective.loss = PoisonAt(trainer.loss, 2)
    with pytest.raises(ClipkitError, match=r"step 3: the loss is nan; stopping"):
        train_loop(trainer)


def test_nonfinite_loss_skips_the_step_when_asked(registry, in_tmp):
    trainer = trainer_for(registry, in_tmp / "a", "train.steps=4", "train.nonfinite=skip")
    trainer.objective.loss = PoisonAt(trainer.loss, 2)
    seen = []
    original = trainer.runtime.step

    def spy(model, optimizer):
        seen.append(True)
        return original(model, optimizer)

    trainer.runtime.step = spy
    metrics = train_loop(trainer)
    assert trainer.skipped_steps == 1 and len(seen) == 3  # step 3 never reached the optimiser
    assert metrics["skipped_steps"] == 1 and metrics["loss"] == pytest.approx(metrics["loss"])


# ----------------------------------------------------------------------------- gradient checkpointing


def test_grad_checkpointing_switch_gives_the_same_gradients(registry, in_tmp):
    plain = trainer_for(registry, in_tmp / "a")
    checkpointed = trainer_for(registry, in_tmp / "b", "train.grad_checkpointing=true")
    modules = checkpointed.model.modules()
    switches = [m.grad_checkpointing for m in modules if hasattr(m, "grad_checkpointing")]
    assert switches and all(switches)
    batch = first_batch(plain)
    for trainer in (plain, checkpointed):
        loss, _ = trainer.step(batch, 0)
        loss.backward()
    expected, got = gradients(plain), gradients(checkpointed)
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, rtol=1e-5, atol=1e-7), name


# ----------------------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.nonfinite=ignore", "train.nonfinite: must be one of stop, skip"),
        (
            "train.distributed.strategy=fsdp",
            "train.distributed.strategy: must be one of ddp, deepspeed, fsdp2",
        ),
        ("train.distributed.zero_stage=4", "train.distributed.zero_stage: must be one of 0, 1, 2, 3"),
        ("train.distributed.gather_grad=true", "train.distributed.gather_grad: unknown key"),
        ("train.distributed.offload_params=cpu", "parameter offload needs zero_stage: 3"),
        ("train.micro_batch_size=-1", "train.micro_batch_size: must be >= 0"),
        ("train.compile=fast", "train.compile: must be one of none, default"),
    ],
)
def test_recipe_errors_name_the_key(registry, override, message):
    with pytest.raises(RecipeError, match=message):
        validate_or_raise(load_recipe(SMOKE, [override], registry=registry), registry)


def test_launcher_deepspeed_must_agree_with_the_recipe(registry, in_tmp, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ClipkitError, match="train.distributed.strategy is 'ddp'"):
        trainer_for(registry, in_tmp / "a")


def test_deepspeed_config_is_derived_from_the_recipe():
    config = deepspeed_config(
        zero_stage=3,
        precision="bf16",
        micro_batch_size=16,
        micro_batches=4,
        world_size=8,
        grad_clip=1.0,
        offload_optimizer="cpu",
        offload_params="cpu",
    )
    assert config["train_batch_size"] == 512 and config["gradient_accumulation_steps"] == 4
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    plain = deepspeed_config(
        zero_stage=1, precision="no", micro_batch_size=8, micro_batches=1, world_size=2, grad_clip=0.0
    )
    assert plain["gradient_clipping"] == 0.0 and not plain["bf16"]["enabled"]  # DeepSpeed's default is 1.0
    assert "offload_optimizer" not in plain["zero_optimization"]


# ----------------------------------------------------------------------------- kill -9, then resume


#: Steps of the kill -9 runs: FSDP2 writes a DCP checkpoint every step (~0.5 s each), so its runs are
#: shorter; the kills land after 1..steps-2 checkpoints either way.
KILL_STEPS = {"ddp": 10, "fsdp2": 6}


def train_command(run_dir: Path, *extra: str, strategy: str = "ddp") -> list[str]:
    steps = KILL_STEPS[strategy]
    overrides = [f"train.steps={steps}", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
    overrides.append(f"train.distributed.strategy={strategy}")
    overrides.append("train.export=false")
    return ["train", SMOKE, *overrides, "--run-dir", str(run_dir), *extra]


def newest_step(run_dir: Path) -> int:
    """The highest step with a checkpoint being written or written (0 before the first)."""
    directory = run_dir / "checkpoints"
    names = [p.name for p in directory.glob("*step-*")] if directory.is_dir() else []
    return max((int(re.search(r"step-(\d+)", name).group(1)) for name in names), default=0)


def final_state(run_dir: Path, steps: int) -> dict:
    state = load_checkpoint(list_checkpoints(run_dir)[-1])
    assert state["step"] == steps
    return state


def assert_identical(got: dict, expected: dict) -> None:
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    flat_expected = expected["optimizer"]["state"]
    for index, slots in flat_expected.items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got["optimizer"]["state"][index][slot], value), (index, slot)
    assert got["schedule"] == expected["schedule"] and got["data"] == expected["data"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])  # fsdp2: one process, DCP shards
def test_kill_9_at_random_steps_then_resume_is_bit_identical(in_tmp, strategy):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = functools.partial(train_command, strategy=strategy)
    warm_launch.run(command(in_tmp / "reference"), cwd=in_tmp, env=env, check=True)
    steps = KILL_STEPS[strategy]
    expected = final_state(in_tmp / "reference", steps)
    chooser = random.Random(int(os.environ.get("CLIPKIT_KILL_SEED", "7")))
    killed = 0
    # FSDP2's runs write a DCP checkpoint every step (~0.5 s each): two kills there, three for DDP.
    attempts = 3 if strategy == "ddp" else 2
    for attempt in range(attempts):
        run_dir = in_tmp / f"killed-{attempt}"
        target = chooser.randint(1, steps - 2)  # kill once this many checkpoints exist, mid-step or mid-write
        process = warm_launch.WarmLaunch(command(run_dir), cwd=in_tmp, env=env)
        deadline = time.monotonic() + 300
        while newest_step(run_dir) < target and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(chooser.random() * 0.3)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if process.returncode == 0:  # finished before the kill landed: nothing to resume
            continue
        killed += 1
        resume = ["--resume"] if list_checkpoints(run_dir) else []  # killed before the first one completed
        warm_launch.run(command(run_dir, *resume), cwd=in_tmp, env=env, check=True)
        assert_identical(final_state(run_dir, steps), expected)
    assert killed >= 2, f"the kills should land before the {steps}-step runs finish"


def every_recipe(registry) -> list[str]:
    from clipkit.config.recipe import variants_of

    names = []
    for name in registry.names("recipe"):
        names += [name] + [f"{name}@{variant}" for variant in variants_of(name, registry)]
    return names


def test_every_recipe_with_a_local_loss_can_compute_it(registry):
    """A recipe asking for local_loss must name a loss that is a mean over anchors and a pairwise
    similarity, else multi-process training would refuse it (checked here without processes)."""
    from clipkit.config.recipe import distributed_config, section
    from clipkit.model import build_slot

    checked = 0
    for spec in every_recipe(registry):
        recipe = validate_or_raise(load_recipe(spec, [], registry=registry), registry)
        if not distributed_config(recipe).local_loss:
            continue
        loss = build_slot(registry, "loss", recipe["loss"], "loss", num_samples=64, total_steps=10)
        embed_dim = section(recipe, "model").embed_dim
        with torch.device("meta"):
            config = recipe["similarity"]
            similarity = build_slot(registry, "similarity", config, "similarity", embed_dim=embed_dim)
        assert getattr(loss, "supports_local_loss", False), spec
        assert getattr(similarity, "pairwise", True), spec
        checked += 1
    assert checked >= 8


def test_unquoted_no_precision_means_fp32(registry):
    """`train.precision=no` on a command line is YAML's boolean false; it means fp32, as written."""
    recipe = validate_or_raise(load_recipe(SMOKE, ["train.precision=no"], registry=registry), registry)
    assert recipe["train"]["precision"] == "no"


@pytest.mark.parametrize(
    ("micro", "samples", "expected"),
    [(0, 30, (30, 30)), (8, 30, (24, 8)), (8, 100, (64, 8)), (0, 1, (64, 64))],
)
def test_fit_batch_lowers_the_batch_to_what_the_data_holds(micro, samples, expected, capsys):
    """data.fit_batch: 64 -> the most the samples allow, a multiple of the micro-batch; a batch that
    fits, or data too small for any contrastive batch (the stream's own check explains it), stays."""
    from clipkit.config.recipe import DistributedConfig
    from clipkit.train.build import fit_batch_to_data
    from clipkit.train.runtime import Runtime

    runtime = Runtime(precision="no", seed=0, distributed=DistributedConfig(), global_batch_size=64,
                      micro_batch_size=micro, grad_clip=0.0)  # fmt: skip
    fit_batch_to_data(runtime, samples, "shards")
    assert (runtime.plan.global_size, runtime.plan.micro_size) == expected
    assert ("data.batch_size -> " in capsys.readouterr().out) == (expected[0] != 64)
