"""A full disk while writing a checkpoint, the end-of-training export, `clipkit export` and
`clipkit shard`: exit 2, one line naming the path with the bytes needed and free, no traceback,
the half-written files removed, and everything complete before (checkpoints, shards) kept.

The disk is simulated deterministically: every file opened for writing under a folder draws on
one budget of bytes, and the write that exceeds it raises ``OSError(ENOSPC)`` as the kernel would
(safetensors, which writes from Rust, raises its own error with the OS's words). Where this
machine lets us mount a tmpfs (root), one export and one training run also fill a real one.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import warm_launch
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.manager import make_plugin_manager

runner = CliRunner()
SMOKE = "quickstart@smoke"
FULL = os.strerror(errno.ENOSPC)
SOURCE = "synthetic://shapes?n=64&split=train&image_size=48"


class SmallDisk:
    """Files opened for writing under ``root`` share ``free`` bytes; past them, ENOSPC."""

    def __init__(self, root: Path, free: int) -> None:
        self.root, self.free = Path(root).absolute(), free

    def charge(self, count: int) -> None:
        if count > self.free:
            self.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.free -= count

    def covers(self, path) -> bool:
        try:
            return Path(os.fspath(path)).absolute().is_relative_to(self.root)
        except TypeError:  # a file descriptor
            return False


class Metered:
    """A file object whose writes draw on the disk's budget."""

    def __init__(self, stream, disk: SmallDisk) -> None:
        self._stream, self._disk = stream, disk

    def write(self, data):
        size = len(data.encode("utf-8")) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._disk.free:  # what fits is written, as a real disk would, then ENOSPC
            self._stream.write(
                data[: self._disk.free] if isinstance(data, str) else bytes(data)[: self._disk.free]
            )
            self._stream.flush()
        self._disk.charge(size)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()

    def __iter__(self):
        return iter(self._stream)


@pytest.fixture
def small_disk(monkeypatch):
    """``small_disk(root, free)``: from now on, ``root`` is on a disk with ``free`` bytes left."""
    real_open = io.open
    disks: list[SmallDisk] = []

    def metered_open(file, mode="r", *args, **kwargs):
        stream = real_open(file, mode, *args, **kwargs)
        if any(flag in mode for flag in "wax+"):
            for disk in disks:
                if disk.covers(file):
                    return Metered(stream, disk)
        return stream

    import safetensors.torch
    from safetensors import SafetensorError

    real_save_model = safetensors.torch.save_model

    def save_model(model, filename, *args, **kwargs):
        real_save_model(model, filename, *args, **kwargs)
        for disk in disks:
            if disk.covers(filename):
                size = Path(filename).stat().st_size
                if size > disk.free:
                    os.truncate(filename, disk.free)
                    disk.free = 0
                    raise SafetensorError(f"Error while serializing: I/O error: {FULL} (os error 28)")
                disk.free -= size
                break

    real_usage = shutil.disk_usage
    Usage = namedtuple("Usage", "total used free")

    def disk_usage(path):
        for disk in disks:
            if disk.covers(path):
                return Usage(disk.free, 0, disk.free)
        return real_usage(path)

    monkeypatch.setattr(io, "open", metered_open)
    monkeypatch.setattr(builtins, "open", metered_open)
    monkeypatch.setattr(safetensors.torch, "save_model", save_model)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)

    def make(root: Path, free: int) -> SmallDisk:
        Path(root).mkdir(parents=True, exist_ok=True)
        disks.insert(0, SmallDisk(root, free))  # a later call for the same folder wins (space freed)
        return disks[0]

    yield make
    disks.clear()


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args):
    return runner.invoke(app, [str(a) for a in args])


def assert_disk_full(result, path: str) -> str:
    """Exit 2, one error line naming ``path`` with bytes needed and free, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    line = errors[0]
    assert path in line and "no space left" in line and "needs" in line and "free there" in line, line
    assert not result.output.split(line, 1)[1].strip(), result.output  # nothing after the line
    return line


def leftovers(root: Path) -> list[str]:
    """Temporaries and partial directories under ``root``."""
    return sorted(
        str(p.relative_to(root))
        for p in Path(root).rglob("*")
        if p.name.endswith((".tmp", ".partial")) or ".partial" in p.parent.name
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The smoke recipe's shards, made once (copied into each test's directory)."""
    root = tmp_path_factory.mktemp("shards")
    from clipkit.app import api

    api.shard("synthetic://shapes?n=512&split=train&image_size=48", root / "data" / "smoke-shapes")
    return root


@pytest.fixture
def work(shards, tmp_path, monkeypatch) -> Path:
    shutil.copytree(shards, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ----------------------------------------------------------------------------- the handler


def test_the_handler_recognises_every_writers_words(tmp_path):
    from clipkit.artifacts.io import is_disk_full

    context = OSError(errno.ENOSPC, "No space left on device")
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    torch_error.__context__ = context  # torch.save into a file object that raised ENOSPC
    from safetensors import SafetensorError

    assert is_disk_full(torch_error, tmp_path)
    assert is_disk_full(SafetensorError("I/O error: No space left on device (os error 28)"), tmp_path)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path)
    # torch.save to a path loses the errno: a full disk only when the filesystem is nearly full
    assert not is_disk_full(RuntimeError("unexpected pos 576 vs 534"), tmp_path)


def test_an_unrelated_error_passes_through_untouched(tmp_path):
    from clipkit.artifacts.io import writing

    with pytest.raises(PermissionError), writing(tmp_path / "x", remove=[tmp_path]):
        raise PermissionError(errno.EACCES, "Permission denied")
    assert tmp_path.is_dir()  # nothing removed for an error that is not a full disk


def test_the_message_gives_bytes_needed_and_free(tmp_path, small_disk):
    from clipkit.artifacts.io import DiskFullError, human_bytes, writing

    small_disk(tmp_path, 1000)
    half = tmp_path / "half.bin"
    with pytest.raises(DiskFullError) as caught, writing(tmp_path / "big.bin", needed=5000, remove=[half]):
        half.write_bytes(b"x" * 800)
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(caught.value)
    assert str(tmp_path / "big.bin") in message and "\n" not in message
    assert "needs about 4.9 KiB (5000 bytes), 200 bytes free there" in message
    assert not half.exists()
    assert human_bytes(3 * 2**20) == "3.0 MiB (3145728 bytes)"


# ----------------------------------------------------------------------------- the four commands


def test_a_full_disk_during_a_checkpoint_keeps_the_earlier_one_resumable(work, app, small_disk):
    run = work / "run"
    run.mkdir()
    # recipe.yaml, two metrics lines and the first checkpoint (~3.6 MB) fit; the second does not.
    small_disk(run, 5_000_000)
    result = invoke(app, "train", SMOKE, "train.steps=2", "train.checkpoint_every=1", "train.log_every=1",
                    "--run-dir", run)  # fmt: skip
    line = assert_disk_full(result, "run/checkpoints/step-00000002")
    assert "step-00000001 is intact" in line
    assert leftovers(run) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]
    assert not (run / "export").exists()
    # Space freed: the run resumes from the checkpoint the full disk left intact.
    small_disk(run, 10**12)
    resumed = invoke(app, "train", SMOKE, "--run-dir", run, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert (run / "checkpoints" / "step-00000002").is_dir()
    assert (run / "export" / "model.safetensors").is_file()


def test_a_full_disk_during_the_end_of_training_export_keeps_the_run(work, app, small_disk):
    run = work / "run"
    run.mkdir()
    # The checkpoint (~3.6 MB) fits; the export (~1.2 MB of weights) does not.
    small_disk(run, 4_000_000)
    result = invoke(app, "train", SMOKE, "train.steps=2", "train.checkpoint_every=2", "--run-dir", run)
    line = assert_disk_full(result, "run/export")
    assert "export it again" in line
    assert leftovers(run) == [] and not (run / "export").exists()
    hidden = [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert hidden == [".clipkit.lock"]  # the run lock stays by design (clipkit/train/run_lock.py)
    small_disk(run, 10**12)
    again = invoke(app, "export", run, run / "export")
    assert again.exit_code == 0, again.output
    assert (run / "export" / "model.safetensors").is_file()


def test_a_full_disk_during_clipkit_export_leaves_nothing_and_keeps_the_run(work, app, small_disk):
    run = work / "run"
    done = invoke(app, "train", SMOKE, "train.steps=2", "train.checkpoint_every=1", "train.export=false",
                  "--run-dir", run)  # fmt: skip
    assert done.exit_code == 0, done.output
    before = snapshot(run)
    disk = work / "disk"
    small_disk(disk, 300_000)
    result = invoke(app, "export", run, disk / "model")
    assert_disk_full(result, "disk/model")
    assert list(disk.iterdir()) == []  # no partial export, no temporary
    assert snapshot(run) == before  # the run and its checkpoints untouched
    small_disk(disk, 10**12)
    assert invoke(app, "export", run, disk / "model").exit_code == 0


def shard_sizes(tmp_path) -> int:
    from clipkit.app import api

    manifest = api.shard(SOURCE, tmp_path / "measure", samples_per_shard=16)
    return max((tmp_path / "measure" / shard["name"]).stat().st_size for shard in manifest["shards"])


def test_a_full_disk_during_clipkit_shard_keeps_the_finished_shards_to_resume(tmp_path, app, small_disk):
    largest = shard_sizes(tmp_path)
    disk = tmp_path / "disk"
    small_disk(disk, int(2.5 * largest) + 4000)  # two shards and their journals fit, the third does not
    result = invoke(app, "shard", SOURCE, disk / "out", "--samples-per-shard", "16")
    line = assert_disk_full(result, "disk/out")
    assert "finished shard(s)" in line and "rerun the same command" in line
    partial = disk / "out.partial"
    kept = ["journal.json"] + [f"shard-00000{n}.tar{index}" for n in (0, 1) for index in ("", ".idx")]
    assert sorted(p.name for p in partial.iterdir()) == kept
    assert not (disk / "out").exists()
    small_disk(disk, 10**12)
    again = invoke(app, "shard", SOURCE, disk / "out", "--samples-per-shard", "16")
    assert again.exit_code == 0, again.output
    assert invoke(app, "shard", disk / "out", "--verify").exit_code == 0
    assert not partial.exists()


def test_a_disk_full_at_the_first_shard_leaves_no_partial_directory(tmp_path, app, small_disk):
    disk = tmp_path / "disk"
    small_disk(disk, 5000)
    result = invoke(app, "shard", SOURCE, disk / "out", "--samples-per-shard", "16")
    assert_disk_full(result, "disk/out")
    assert [p.name for p in disk.iterdir()] == ["out.lock"]  # the lock file stays by design (shard_lock)


# ----------------------------------------------------------------------------- a real full disk


@pytest.fixture
def tmpfs(tmp_path):
    """A mounted tmpfs of the given size (root only; skipped where it cannot be mounted)."""
    mounted = []

    def mount(name: str, size: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a tmpfs needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


def run_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return warm_launch.subprocess_run([sys.executable, "-m", "clipkit", *args], cwd=cwd, env=env, timeout=300)


def test_a_real_full_tmpfs_checkpoint_and_export(work, tmpfs):
    disk = tmpfs("disk", "5m")  # the first checkpoint (~3.6 MB) fits, the second does not
    run = disk / "run"
    done = run_cli("train", SMOKE, "train.steps=2", "train.checkpoint_every=1", "--run-dir", run, cwd=work)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "no space left" in done.stderr, done.stderr
    assert "step-00000002" in done.stderr
    assert leftovers(disk) == []
    assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["step-00000001"]
    small = tmpfs("small", "256k")  # the export's weights (~1.2 MB) do not fit
    exported = run_cli("export", disk / "run", small / "model", cwd=work)
    assert exported.returncode == 2, exported.stderr[-3000:]
    assert "Traceback" not in exported.stderr and "no space left" in exported.stderr, exported.stderr
    assert list(small.iterdir()) == []
    state = torch.load(run / "checkpoints" / "step-00000001" / "state.pt", weights_only=True)
    assert state["step"] == 1


def test_a_full_disk_while_logging_metrics_leaves_no_torn_line(tmp_path, small_disk):
    from clipkit.artifacts.io import DiskFullError
    from clipkit.plugins.loggers import on_metrics
    from clipkit.train.build import RunInfo

    run = RunInfo(tmp_path, "quickstart@smoke", True)
    on_metrics(step=1, metrics={"loss": 1.0}, run=run)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    small_disk(tmp_path, 10)  # less than one line
    with pytest.raises(DiskFullError, match="metrics.jsonl: no space left"):
        on_metrics(step=2, metrics={"loss": 0.5}, run=run)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
