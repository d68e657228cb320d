"""Several processes on CPU over gloo (issue 7, issue 40): DDP, DeepSpeed ZeRO and FSDP2 through
the real launchers.

- DDP and FSDP2 loss, gradients and per-sample state equal one process on the concatenated batch,
  for every gather mode that is exact, with and without exact gradient accumulation
  (``tests/distributed/equivalence.py`` under ``torchrun``);
- ``accelerate launch -m clipkit train`` with DDP, ZeRO 1/2/3 and FSDP2 trains, checkpoints,
  resumes to the same weights as an uninterrupted run, and exports (consolidating ZeRO partitions,
  gathering FSDP2 shards); DDP and FSDP2 resume each other's checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_launch

from clipkit.train.checkpoint import list_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
RELATIVE_TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env() -> dict[str, str]:
    # Inductor's in-process pointer variables must never reach a child (see tests/test_compile.py).
    env = {k: v for k, v in os.environ.items() if not k.startswith("_TORCHINDUCTOR")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"})
    env.pop("RANK", None)
    return env


def run(command: list[str], cwd: Path, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**launcher_env(), **extra_env}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return succeeded(done)


def succeeded(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``done``, asserted to have exited 0; else the end of its stdout and of each process's stderr
    (one rank's traceback must not cut off the other's cause)."""
    command = " ".join(map(str, done.args))
    ranks = getattr(done, "rank_errors", None) or [done.stderr]
    errors = "\n".join(f"--- process {r} stderr (end) ---\n{text[-4000:]}" for r, text in enumerate(ranks))
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{errors}"
    return done


def torchrun(script: Path, *args: str, cwd: Path, processes: int = 2) -> None:
    """``torchrun --nproc_per_node 2 SCRIPT ARGS`` (``python SCRIPT ARGS`` for one process), its
    processes forked from a warm interpreter (tests/warm_launch.py)."""
    succeeded(warm_launch.run(args, script=script, cwd=cwd, processes=processes, env=launcher_env()))


def cli(*args: str, cwd: Path):
    """``clipkit ARGS`` in this process (CliRunner), run from ``cwd``."""
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    previous = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(make_app(make_plugin_manager(autoload=False)), list(args))
    finally:
        os.chdir(previous)


def accelerate_launch(*args: str, cwd: Path, documented: bool = False) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes 2 ... -m clipkit ARGS``: two processes with the
    environment that command gives them, forked from a warm interpreter (tests/warm_launch.py);
    ``documented``: through the real command."""
    # Its own extension cache, so a test can see what a launch compiles (nothing: see zero.py).
    extensions = str(cwd / "torch_extensions")
    if not documented:
        env = {**launcher_env(), "TORCH_EXTENSIONS_DIR": extensions}
        return succeeded(warm_launch.run(args, cwd=cwd, processes=2, env=env))
    accelerate = Path(sys.executable).parent / "accelerate"
    flags = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    flags += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    return run(
        [str(accelerate), "launch", *flags, "-m", "clipkit", *args], cwd, TORCH_EXTENSIONS_DIR=extensions
    )


# ----------------------------------------------------------------------------- DDP == one process


EQUIVALENCE = HERE / "distributed" / "equivalence.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process on the whole batch."""
    out = tmp_path_factory.mktemp("one-process")
    torchrun(EQUIVALENCE, str(out), cwd=out, processes=1)
    return torch.load(out / "result-1.pt", weights_only=False)


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory, one_process):
    out = tmp_path_factory.mktemp("equivalence")
    torchrun(EQUIVALENCE, str(out), cwd=out)
    return one_process, torch.load(out / "result-2.pt", weights_only=False)


@pytest.fixture(scope="module")
def sharded_equivalence(tmp_path_factory, one_process):
    """The same cases with two FSDP2 processes (gradients gathered from the shards)."""
    out = tmp_path_factory.mktemp("sharded-equivalence")
    torchrun(EQUIVALENCE, str(out), "fsdp2", cwd=out)
    return one_process, torch.load(out / "result-2-fsdp2.pt", weights_only=False)


def assert_grads_close(got: dict, expected: dict, scale: float = 1.0) -> None:
    assert set(got) == set(expected)
    size = max(t.abs().max().item() for t in expected.values())
    for name, tensor in expected.items():
        difference = (got[name] - scale * tensor).abs().max().item()
        assert difference <= RELATIVE_TOLERANCE * size, f"{name}: off by {difference} (largest {size})"


EXACT = [
    ("infonce", True, False, 0),
    ("infonce", True, True, 0),
    ("siglip", True, False, 0),
    ("siglip", True, True, 0),
    ("nuclr", True, False, 0),
]


@pytest.mark.parametrize("case", EXACT, ids=lambda c: f"{c[0]}-grad-{'local' if c[2] else 'global'}")
def test_ddp_equals_one_process_on_the_concatenated_batch(equivalence, case):
    single, ddp = equivalence
    assert ddp[case]["loss"] == pytest.approx(single[case]["loss"], rel=1e-6)
    assert_grads_close(ddp[case]["grads"], single[case]["grads"])


def test_per_sample_state_is_identical_on_every_process_and_equals_one_process(equivalence):
    single, ddp = equivalence
    case = ("nuclr", True, False, 0)
    reference, states = single[case]["state"][0], ddp[case]["state"]
    assert len(states) == 2 and reference
    for key, value in reference.items():
        assert torch.equal(states[0][key], states[1][key]), key  # the same update on both processes
        assert torch.allclose(states[0][key], value, rtol=1e-6, atol=1e-7, equal_nan=True), key


ACCUMULATED = [("infonce", True, False, 2), ("siglip", True, True, 2)]


@pytest.mark.parametrize("case", ACCUMULATED, ids=["global", "local"])
def test_exact_accumulation_across_processes_equals_the_full_batch(equivalence, case):
    single, ddp = equivalence
    full = (case[0], case[1], case[2], 0)
    for result in (single[case], ddp[case]):  # one process in 4 micro-batches; two in 2 each
        assert result["loss"] == pytest.approx(single[full]["loss"], rel=1e-6)
        assert_grads_close(result["grads"], single[full]["grads"])


def test_gather_without_grad_global_loss_gives_towers_one_over_world_size(equivalence):
    """CLOOB's/CyCLIP's mode: every process scores the whole batch but only its own features carry
    gradient; after DDP's averaging the towers get 1/W of the full-batch gradient and the
    similarity's own parameters the full one (METHODS §11) — documented, not exact."""
    single, ddp = equivalence
    case = ("infonce", False, False, 0)
    expected = single[case]["grads"]
    towers = {k: v for k, v in expected.items() if not k.startswith("similarity.")}
    own = {k: v for k, v in expected.items() if k.startswith("similarity.")}
    assert own, "the similarity has a learnable scale"
    assert_grads_close({k: ddp[case]["grads"][k] for k in towers}, towers, scale=0.5)
    assert_grads_close({k: ddp[case]["grads"][k] for k in own}, own)


@pytest.mark.parametrize(
    "case", EXACT + ACCUMULATED, ids=lambda c: f"{c[0]}-{'local' if c[2] else 'global'}-{c[3]}"
)
def test_fsdp2_equals_one_process_on_the_concatenated_batch(sharded_equivalence, case):
    """FSDP2's reduce-scatter (sharded towers) and the averaged similarity: the gradients of the
    full batch, for every exact gather mode, with and without exact accumulation."""
    single, sharded = sharded_equivalence
    full = (case[0], case[1], case[2], 0)
    assert sharded[case]["loss"] == pytest.approx(single[full]["loss"], rel=1e-6)
    assert_grads_close(sharded[case]["grads"], single[full]["grads"])


def test_fsdp2_gather_without_grad_is_as_documented(sharded_equivalence):
    """CLOOB's mode under FSDP2 is DDP's: the towers get 1/W of the full-batch gradient, the
    similarity's own parameters all of it."""
    single, sharded = sharded_equivalence
    case = ("infonce", False, False, 0)
    expected = single[case]["grads"]
    towers = {k: v for k, v in expected.items() if not k.startswith("similarity.")}
    own = {k: v for k, v in expected.items() if k.startswith("similarity.")}
    assert_grads_close({k: sharded[case]["grads"][k] for k in towers}, towers, scale=0.5)
    assert_grads_close({k: sharded[case]["grads"][k] for k in own}, own)


def test_fsdp2_per_sample_state_equals_one_process(sharded_equivalence):
    single, sharded = sharded_equivalence
    case = ("nuclr", True, False, 0)
    reference, states = single[case]["state"][0], sharded[case]["state"]
    for key, value in reference.items():
        assert torch.equal(states[0][key], states[1][key]), key
        assert torch.allclose(states[0][key], value, rtol=1e-6, atol=1e-7, equal_nan=True), key


def test_differently_shaped_blocks_raise_instead_of_hanging(tmp_path):
    torchrun(HERE / "distributed" / "mismatch.py", str(tmp_path / "message.txt"), cwd=tmp_path)
    message = (tmp_path / "message.txt").read_text()
    assert "differently shaped blocks [(4, 3, 2), (5, 3, 2)]" in message


# ----------------------------------------------------------------------------- launched trainings

STRATEGIES = {
    "ddp": [],
    "zero1": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=1"],
    "zero2": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=2"],
    # Evaluation during training gathers the ZeRO-3 shards.
    "zero3": ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3", "train.eval_every=2"],
    # Exact gradient accumulation under ZeRO-2: 4 micro-batches of 4 on each process.
    "zero2-accumulated": [
        "train.distributed.strategy=deepspeed",
        "train.distributed.zero_stage=2",
        "train.micro_batch_size=4",
    ],
    # DeepSpeed's own bf16 (half-precision parameters, fp32 master weights).
    "zero2-bf16": [
        "train.distributed.strategy=deepspeed",
        "train.distributed.zero_stage=2",
        "train.precision=bf16",
    ],
    # FSDP2: evaluation during training gathers the shards.
    "fsdp2": ["train.distributed.strategy=fsdp2", "train.eval_every=2"],
    "fsdp2-accumulated": ["train.distributed.strategy=fsdp2", "train.micro_batch_size=4"],
    # The mixed-precision policy: bf16 towers, fp32 gradient reduction and optimiser shards.
    "fsdp2-bf16": ["train.distributed.strategy=fsdp2", "train.precision=bf16"],
}
# SGD (not Adam, whose normalised steps would hide a wrongly scaled gradient), and a logit scale
# starting at its bound (100; a start above it is refused): kept within it on (sharded) parameters.
COMMON = [
    "quickstart@smoke",
    "train.steps=4",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "optimizer.name=sgd",
    "optimizer.lr=0.05",
    "schedule.name=constant",
    "similarity.init_scale=100.0",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """quickstart@smoke's shards, made once (each launch would otherwise make them); in this
    process, as ``clipkit shard`` would (no launch is involved in sharding)."""
    from clipkit.app import api

    root = tmp_path_factory.mktemp("launch")
    api.shard("synthetic://shapes?n=512&split=train&image_size=48", root / "data" / "smoke-shapes")
    return root


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_launch_train_checkpoint_resume_export(shards, strategy):
    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed")
    root = shards
    full, resumed = root / f"{strategy}-full", root / f"{strategy}-resumed"
    # The documented command for one strategy; the others' processes are forked warm.
    accelerate_launch("train", *COMMON, *STRATEGIES[strategy], "--run-dir", str(full), cwd=root,
                      documented=strategy == "ddp")  # fmt: skip
    steps = [p.name for p in list_checkpoints(full)]
    assert steps == ["step-00000002", "step-00000004"]
    assert (full / "export" / "model.safetensors").is_file() and (full / "eval.json").is_file()

    # Resume from step 2 in a copy: the weights at step 4 equal the uninterrupted run's.
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "recipe.yaml", resumed / "recipe.yaml")
    shutil.copytree(full / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    # No export at the end of the resumed launch: the full launch covered that path, and the
    # resumed checkpoint is exported and evaluated by one process below.
    resume = ["quickstart@smoke", "train.export=false", "--resume", "--run-dir", str(resumed)]
    accelerate_launch("train", *resume, cwd=root)
    expected = load_checkpoint(list_checkpoints(full)[-1])
    got = load_checkpoint(list_checkpoints(resumed)[-1])
    assert expected["step"] == got["step"] == 4
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key

    # One process exports the (consolidated) checkpoint and evaluates it: the commands run in this
    # (never launched) test process, which spares two interpreter and torch start-ups per strategy.
    exported = cli("export", str(resumed), str(root / f"{strategy}-export"), cwd=root)
    assert exported.exit_code == 0, exported.output
    # No plots: the full launch's rank 0 drew them; here the export's evaluation is the point.
    evaluated = cli("eval", str(root / f"{strategy}-export"), "--no-plots", cwd=root)
    assert evaluated.exit_code == 0 and "zero_shot" in evaluated.output, evaluated.output
    logged = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    # Started at the bound (100); within it at every step (DDP clamps
    # the parameter after the step, DeepSpeed's partitions keep the bound in the forward pass), in
    # fp32: exp(fp32(ln 100)) = 100.0000076.
    scales = [row["logit_scale"] for row in logged if "logit_scale" in row]
    assert len(scales) == 4 and all(
        0 < scale <= float(torch.tensor(math.log(100.0)).exp()) for scale in scales
    )
    if strategy in ("zero3", "fsdp2"):
        assert any(key.startswith("eval/") for row in logged for key in row)  # gathered for evaluation
    # DeepSpeed's CPU inference all-reduce kernel is never compiled (a minute of g++ per environment).
    assert not list((root / "torch_extensions").rglob("*shm_comm*")), "DeepSpeed compiled its shm kernel"


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero2-accumulated"])
def test_zero_trains_the_same_weights_as_ddp(shards, strategy):
    """fp32 ZeRO (also with exact accumulation) and DDP take the same SGD steps, up to the order of
    floating-point operations (their gradient norms agree to 6 digits)."""
    runs = {name: shards / f"{name}-full" for name in ("ddp", strategy)}
    if not all(list_checkpoints(run) for run in runs.values()):
        pytest.skip("needs the launch tests' runs")
    ddp, zero = (load_checkpoint(list_checkpoints(run)[-1])["model"] for run in runs.values())
    for key, tensor in ddp.items():
        assert torch.allclose(zero[key], tensor, rtol=1e-5, atol=1e-5), key


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2-accumulated"])
def test_fsdp2_trains_the_same_weights_as_ddp(shards, strategy):
    """fp32 FSDP2 (also with exact accumulation) and DDP take the same SGD steps, up to the order of
    floating-point operations (reduce-scatter instead of all-reduce)."""
    runs = {name: shards / f"{name}-full" for name in ("ddp", strategy)}
    if not all(list_checkpoints(run) for run in runs.values()):
        pytest.skip("needs the launch tests' runs")
    ddp, sharded = (load_checkpoint(list_checkpoints(run)[-1]) for run in runs.values())
    assert sharded["strategy"] == "fsdp2" and (list_checkpoints(runs[strategy])[-1] / "fsdp2").is_dir()
    for key, tensor in ddp["model"].items():
        assert torch.allclose(sharded["model"][key], tensor, rtol=1e-5, atol=1e-5), key


@pytest.mark.parametrize(("written", "resumed_as"), [("ddp", "fsdp2"), ("fsdp2", "ddp")])
def test_ddp_and_fsdp2_resume_each_others_checkpoints(shards, written, resumed_as):
    """A run checkpointed at step 2 under one strategy continues under the other (the same
    processes) to the weights and optimiser state of the uninterrupted run, to fp32 tolerance."""
    full = shards / f"{written}-full"
    if not list_checkpoints(full):
        pytest.skip("needs the launch test's run")
    target = shards / f"{written}-resumed-as-{resumed_as}"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "recipe.yaml", target / "recipe.yaml")
    shutil.copytree(full / "checkpoints" / "step-00000002", target / "checkpoints" / "step-00000002")
    strategy = f"train.distributed.strategy={resumed_as}"
    accelerate_launch("train", "quickstart@smoke", "train.export=false", strategy, "--resume", "--run-dir",
                      str(target), cwd=shards)  # fmt: skip
    expected = load_checkpoint(list_checkpoints(full)[-1])
    got = load_checkpoint(list_checkpoints(target)[-1])
    assert got["step"] == 4 and got["strategy"] == resumed_as
    for key, tensor in expected["model"].items():
        assert torch.allclose(got["model"][key], tensor, rtol=1e-5, atol=1e-6), key
    assert got["schedule"] == expected["schedule"] and got["data"] == expected["data"]
