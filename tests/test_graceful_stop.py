"""Graceful stop (clipkit.train.stop): SIGTERM/SIGINT finish the step, checkpoint it, say how to resume,
exit 128 + signal; the resumed run reaches the uninterrupted run's weights bit for bit; a second
signal stops at once; under several processes all stop after the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_launch

from clipkit.app import api
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.train.checkpoint import list_checkpoints, load_checkpoint
from clipkit.train.stop import TrainingStopped, handling_signals, received

pytestmark = pytest.mark.timeout(600)
SMOKE = "quickstart@smoke"
SOURCE = "synthetic://shapes?n=512&split=train&image_size=48"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data") / "smoke-shapes"
    api.shard(SOURCE, directory, registry=Registry(make_plugin_manager(autoload=False)))
    return directory


def overrides(shards: Path, steps: int) -> list[str]:
    return [f"data.shards={shards}", f"train.steps={steps}", "train.log_every=1", "train.checkpoint_every=4",
            "train.keep_checkpoints=5", "train.export=false"]  # fmt: skip


class SignalAt:
    """A plugin that sends this process ``signum`` when step ``step`` is logged, mid-run."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum, self.ended = step, signum, []

    @hookimpl
    def on_metrics(self, step, metrics, run):
        if step == self.step:
            os.kill(os.getpid(), self.signum)

    @hookimpl
    def on_run_end(self, run, status):
        self.ended.append(status)


def registry(*extra) -> Registry:
    return Registry(make_plugin_manager(autoload=False, extra_plugins=list(extra)))


def newest(run_dir: Path) -> dict:
    return load_checkpoint(list_checkpoints(run_dir)[-1])


def assert_same_weights(got: dict, expected: dict) -> None:
    assert got["step"] == expected["step"]
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    for index, slots in expected["optimizer"]["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got["optimizer"]["state"][index][slot], value), (index, slot)
    assert got["schedule"] == expected["schedule"] and got["data"] == expected["data"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_checkpoints_the_step_and_resuming_is_bit_identical(shards, tmp_path, signum, code):
    full = tmp_path / "full"
    api.train(SMOKE, overrides(shards, 6), run_dir=full, registry=registry())

    stopped = tmp_path / "stopped"
    with pytest.raises(TrainingStopped) as raised:
        api.train(SMOKE, overrides(shards, 6), run_dir=stopped, registry=registry(SignalAt(3, signum)))
    assert raised.value.exit_code == code and raised.value.step == 3
    assert f"--resume --run-dir {stopped}" in str(raised.value)
    # Step 3 is no periodic checkpoint (every 4): the stop wrote it, and the loop went no further.
    assert [p.name for p in list_checkpoints(stopped)] == ["step-00000003"]
    assert len((stopped / "metrics.jsonl").read_text().splitlines()) == 3
    assert signal.getsignal(signum) is not None and received() is None  # handlers restored

    api.train(SMOKE, run_dir=stopped, resume=True, registry=registry())
    assert_same_weights(
        load_checkpoint(list_checkpoints(stopped)[-1]), load_checkpoint(list_checkpoints(full)[-1])
    )


@pytest.mark.slow
def test_a_stop_on_a_checkpoint_step_reuses_that_checkpoint(shards, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingStopped) as raised:
        plugin = SignalAt(4, signal.SIGTERM)
        api.train(SMOKE, overrides(shards, 6), run_dir=run_dir, registry=registry(plugin))
    assert raised.value.step == 4 and [p.name for p in list_checkpoints(run_dir)] == ["step-00000004"]
    assert plugin.ended == ["stopped"]  # trackers close their run as stopped


def test_a_second_sigint_raises_keyboard_interrupt_at_once():
    with handling_signals():
        os.kill(os.getpid(), signal.SIGINT)
        assert received() == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises before this ends
    assert received() is None


def test_a_second_sigterm_kills_the_process():
    script = (
        "import os, signal, time\n"
        "from clipkit.train.stop import handling_signals, received\n"
        "with handling_signals():\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "    print('first', received(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "    print('survived', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM
    assert f"first {int(signal.SIGTERM)}" in done.stdout and "survived" not in done.stdout


@pytest.mark.slow
def test_sigterm_to_the_cli_exits_143_with_a_checkpoint_and_the_resume_command(shards, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "clipkit", "train", SMOKE, *overrides(shards, 100_000),
               "train.checkpoint_every=100000", "--run-dir", str(run_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = warm_launch.popen(command, cwd=tmp_path, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 143, stderr
    (checkpoint,) = list_checkpoints(run_dir)
    step = load_checkpoint(checkpoint)["step"]
    assert step >= 2 and checkpoint.name == f"step-{step:08d}"
    assert len(metrics.read_text().splitlines()) == step  # log_every=1: it stopped right after that step
    assert "received SIGTERM" in stderr
    assert f"train {SMOKE} --resume --run-dir {run_dir}" in stderr


@pytest.mark.slow
def test_processes_stop_together_when_only_one_gets_the_signal(shards, tmp_path):
    """Two processes (torchrun, gloo); rank 1 alone gets SIGTERM during step 3: both stop after
    step 3 with one complete checkpoint (both RNG files), and resuming under two processes reaches
    the uninterrupted two-process run's weights bit for bit. The signalled run is torchrun's (its
    agent and exit codes are the point); the uninterrupted run and the resume are the same two
    processes forked warm (tests/warm_launch.py), which spares four interpreter and torch start-ups."""
    script = HERE / "distributed" / "graceful_stop.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("_TORCHINDUCTOR") and k != "RANK"}
    env["OMP_NUM_THREADS"] = "1"
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
    ]

    def torchrun(run_dir: Path, mode: str) -> subprocess.CompletedProcess:
        args = [str(shards), str(run_dir), mode]
        return subprocess.run(
            launch + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    def warm(run_dir: Path, mode: str) -> subprocess.CompletedProcess:
        args = [str(shards), str(run_dir), mode]
        return warm_launch.run(args, script=script, cwd=tmp_path, processes=2, env=env)

    full, stopped = tmp_path / "full", tmp_path / "stopped"
    done = warm(full, "full")
    assert done.returncode == 0, done.stderr[-4000:]
    done = torchrun(stopped, "signal-rank-1")
    assert done.returncode != 0  # torchrun reports the processes' exit codes (143)
    reports = [json.loads((stopped / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["exit_code"] for r in reports] == [143, 143]
    assert reports[0]["step"] == reports[1]["step"] == 3  # signalled in step 3 (0-based 2)
    (checkpoint,) = list_checkpoints(stopped)
    assert checkpoint.name == "step-00000003"
    assert {p.name for p in checkpoint.iterdir()} >= {"state.pt", "rng-0.pt", "rng-1.pt"}
    done = warm(stopped, "resume")
    assert done.returncode == 0, done.stderr[-4000:]
    assert_same_weights(
        load_checkpoint(list_checkpoints(stopped)[-1]), load_checkpoint(list_checkpoints(full)[-1])
    )


@pytest.mark.slow
def test_a_signal_during_the_last_step_stops_before_the_export(shards, tmp_path):
    # A SIGTERM after the loop's last check (here: from the progress report that follows it) was
    # logged as "finishing this step, then stopping", then the run went on to export, evaluate and
    # exit 0, with the signal lost.
    run_dir = tmp_path / "run"

    def progress(done, total, metrics):
        if done == total:
            os.kill(os.getpid(), signal.SIGTERM)

    settings = [*overrides(shards, 4)[:-1], "train.export=true"]
    with pytest.raises(TrainingStopped) as raised:
        api.train(SMOKE, settings, run_dir=run_dir, registry=registry(), progress=progress)
    assert raised.value.exit_code == 143 and raised.value.step == 4
    assert "export and evaluation were skipped" in str(raised.value)
    assert [p.name for p in list_checkpoints(run_dir)][-1] == "step-00000004"
    assert not (run_dir / "export").exists() and received() is None
    # the next run in this process sees no signal left over
    api.train(SMOKE, overrides(shards, 2), run_dir=tmp_path / "next", registry=registry())


def test_a_second_sigint_inside_torch_save_is_an_interrupt_not_a_crash(capsys):
    # torch.save turns a KeyboardInterrupt raised while it writes into its own RuntimeError as it
    # closes the file: a second Ctrl-C during a checkpoint printed a traceback, exit code 1.
    import io

    import typer

    from clipkit.app.commands import fails_cleanly

    class InterruptedFile(io.RawIOBase):  # the signal arrives after a few blocks are written
        writes = 0

        def writable(self):
            return True

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return len(data)

    @fails_cleanly
    def command():
        torch.save({"weights": torch.zeros(1000)}, InterruptedFile())

    with pytest.raises(typer.Exit) as raised:
        try:
            command()
        except KeyboardInterrupt:  # never let it stop the test session
            pytest.fail(
                "torch.save let the KeyboardInterrupt through (the case this test stands for is gone)"
            )
    assert raised.value.exit_code == 130 and "interrupted by a second signal" in capsys.readouterr().err

    @fails_cleanly
    def broken():
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):  # other errors keep their traceback
        broken()


def test_ctrl_c_during_clipkit_shard_says_how_to_continue(tmp_path, monkeypatch):
    # It exited 130 without a word about the finished shards kept in OUT.partial.
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    def interrupted_shard(source, out, **options):
        (Path(f"{out}.partial")).mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "shard", interrupted_shard)
    out = tmp_path / "shards"
    result = CliRunner().invoke(
        make_app(make_plugin_manager(autoload=False)), ["shard", "synthetic://shapes", str(out)]
    )
    assert result.exit_code == 130, result.output
    assert f"the finished shards are kept in {out}.partial; run the same command again" in result.output
