"""Start ``clipkit`` (or a test script) in fresh processes forked from a warm interpreter.

Why: every ``python -m clipkit`` or ``accelerate launch`` worker spends ~8 CPU-seconds importing
torch, Accelerate, DeepSpeed and clipkit before it does anything, and the launched tests (resume
after kill -9, DDP / ZeRO / FSDP2 equivalence, LoRA and EMA under two processes) start ~100 such
processes: most of the suite's time was imports. Here one "fork server" per pytest worker imports
them once (multiprocessing's ``forkserver`` with a preload list, which imports and runs nothing
else, so no thread exists when it forks); each process of a test is forked from it and then
behaves as a fresh ``python -m clipkit ARGS``: its own environment, working directory, argv,
default signal handlers, stdout/stderr to files, ``atexit`` handlers run, exit status kept.

Several processes get the environment ``accelerate launch --multi_gpu --num_processes N`` gives
its workers (recorded from Accelerate 1.x on torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/
PORT, ACCELERATE_*, OMP_NUM_THREADS=1), with rank 0 hosting the rendezvous store (no torchrun
agent). As under torchrun, when one process fails the others are stopped.

The documented launchers themselves stay tested where their behaviour is the point:
tests/test_machine.py (``accelerate launch --cpu``), tests/test_graceful_stop.py (torchrun's signal
forwarding), and the first run of one strategy in tests/test_distributed.py.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import multiprocessing
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: What the fork server imports once (what a clipkit process imports anyway, plus the optional
#: heavy ones the launched tests use: DeepSpeed, FSDP2, the report's plots). torch._dynamo:
#: torch.optim imports it when the first optimiser is built. DeepSpeed's muon module: ZeRO's
#: optimizer check imports it, and it imports Inductor (4.7 s a process here).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.utils.flop_counter",
    "torch.distributed.fsdp",
    "accelerate",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "webdataset",
    "matplotlib.pyplot",
    "clipkit.app.cli",
    "clipkit.app.api",
    "clipkit.train.build",
    "clipkit.train.loop",
    "clipkit.data.loader",
    "clipkit.eval.report",
    # What every run imports after those (found by listing a warm rank's new modules): the recipe
    # parser, the console, the image decoders and the built-in plugins the registry collects.
    "omegaconf",
    "rich.console",
    "rich.progress",
    "rich.table",
    "PIL.JpegImagePlugin",
    "PIL.PngImagePlugin",
    "clipkit.contract.manager",
    "clipkit.plugins.encoders",
    "clipkit.plugins.evals",
    "clipkit.plugins.experiments",
    "clipkit.plugins.loggers",
    "clipkit.plugins.losses",
    "clipkit.plugins.optim",
    "clipkit.plugins.optim_groups",
    "clipkit.plugins.recipes",
    "clipkit.plugins.similarities",
    "clipkit.plugins.sources",
    "clipkit.plugins.tokenizers",
    "clipkit.artifacts.export",
    "clipkit.artifacts.reader",
    "clipkit.eval.evaluate",
    "clipkit.tiled.engine",
    "clipkit.train.runtime.ddp",
    "clipkit.train.runtime.sharding",
]

#: What ``accelerate launch --multi_gpu --mixed_precision no --dynamo_backend no`` adds to each
#: worker's environment besides the rank variables.
ACCELERATE_ENV = {
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "OMP_NUM_THREADS": "1",
}
#: How long the other processes get to stop after one failed (torchrun's SIGTERM, then SIGKILL).
STOP_GRACE_SECONDS = 10.0

_context = None


#: Where the fork server's optional preload (``warm_optional``) and the torchvision shim live.
SHIMS = Path(__file__).resolve().parent / "shims"


#: Set by the xdist controller that started a fork server for its workers: "PID:ADDRESS".
SHARED_SERVER = "CLIPKIT_TESTS_FORK_SERVER"


def _fork_server():
    """The forkserver context, its server started on first use: the xdist controller's (shared by
    its workers, see :func:`start_shared_server`) where there is one, else this process's own."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([*PRELOAD, "warm_optional"])
        if not _attach_to_shared_server():
            with _server_start_environment():
                from multiprocessing import forkserver

                forkserver.ensure_running()
    return _context


def start_shared_server() -> None:
    """Start the fork server in this process (the xdist controller, which outlives its workers) and
    tell the workers where it listens (:data:`SHARED_SERVER`): one server preloads the imports for
    both workers (~17 CPU-s each), while they start and collect."""
    _fork_server()
    from multiprocessing import forkserver

    os.environ[SHARED_SERVER] = f"{os.getpid()}:{forkserver._forkserver._forkserver_address}"


def _attach_to_shared_server() -> bool:
    """Use the parent's (the xdist controller's) fork server: connect to its address, never start or
    wait for it (it is not this process's child; the controller keeps it alive). False where there
    is none, it is not the parent's, or multiprocessing's fork server has another shape."""
    from multiprocessing import forkserver, resource_tracker

    owner, _, address = os.environ.get(SHARED_SERVER, "").partition(":")
    server = getattr(forkserver, "_forkserver", None)
    if not owner.isdigit() or int(owner) != os.getppid() or not os.path.exists(address):
        return False
    if not all(hasattr(server, name) for name in ("_forkserver_address", "_forkserver_alive_fd")):
        return False
    server._forkserver_address = address
    # Handed to each child as its own fork server's "alive" pipe (used only if it started one).
    server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    server.ensure_running = resource_tracker.ensure_running  # the tracker is this process's own
    return True


@contextlib.contextmanager
def _server_start_environment():
    """The fork server is a new interpreter started with this process's environment: for its start
    only, ``SHIMS`` leads ``PYTHONPATH`` (so ``warm_optional`` imports, and the shim's
    ``sitecustomize`` runs) and, where peft is installed, the shim defines torchvision's op schemas
    first if torchvision cannot import (tests/shims/sitecustomize.py). Every launched process still
    gets its test's environment."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SHIMS), os.environ.get("PYTHONPATH")])))
        if importlib.util.find_spec("peft") is not None:
            # The server decides, once it has imported torch (the xdist controller does not).
            patch.setenv("CLIPKIT_TESTS_TORCHVISION_OPS", "auto")
        yield


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_fresh_process(argv: list[str], script: str | None, env: dict, cwd: str, out: str, err: str) -> None:
    """The forked child: become ``python -m clipkit ARGV`` (or ``python SCRIPT ARGV``), then exit
    with its status. Runs in the fork server's child, never in the test process."""
    # What multiprocessing set up for its own child, undone: a fresh interpreter's default start
    # method (fork on Linux; DataLoader workers use it), its name, no parent process.
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().name = "MainProcess"
    multiprocessing.process._parent_process = None
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP):
        signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    # What the interpreter's start-up does with the environment and the script: PYTHONPATH and the
    # script's folder lead sys.path, and site runs the first sitecustomize found on PYTHONPATH.
    extra_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if script is not None:
        extra_paths.insert(0, str(Path(script).resolve().parent))
    sys.path[:0] = [p for p in extra_paths if p not in sys.path]
    customize = [Path(p) / "sitecustomize.py" for p in extra_paths]
    customize = [path for path in customize if path.is_file()]
    if customize:  # kept in sys.modules, as site keeps it (what it defines must stay alive)
        spec = importlib.util.spec_from_file_location("sitecustomize", customize[0])
        sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    os.chdir(cwd)
    for target, path in ((1, out), (2, err)):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(descriptor, target)
        os.close(descriptor)
    code = 0
    try:
        if script is None:
            sys.argv = ["clipkit", *argv]
            from clipkit.app.cli import main

            main()
        else:
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # what an uncaught exception does to a fresh interpreter: traceback, 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class WarmLaunch:
    """N processes of one command, forked from the warm interpreter (a ``subprocess.Popen``
    look-alike: ``pid`` (rank 0's), ``pids``, ``poll()``, ``wait()``, ``kill()``, ``returncode``)."""

    def __init__(self, argv, *, cwd, processes=1, env=None, script=None, log_dir=None):
        context = _fork_server()
        # Inductor's in-process pointer variables must never reach a child (see tests/test_compile.py).
        source = os.environ if env is None else env
        base = {k: v for k, v in source.items() if not k.startswith("_TORCHINDUCTOR")}
        self.logs = Path(log_dir or tempfile.mkdtemp(prefix="warm-launch-"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self._files = [(self.logs / f"rank{r}.out", self.logs / f"rank{r}.err") for r in range(processes)]
        port = free_port()
        self.processes = []
        for rank in range(processes):
            rank_env = dict(base)
            if processes > 1:
                rank_env.update(ACCELERATE_ENV)
                rank_env.update({
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                    "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
                    "ROLE_WORLD_SIZE": str(processes), "GROUP_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                })  # fmt: skip
            out, err = self._files[rank]
            script_path = None if script is None else str(script)
            arguments = ([str(a) for a in argv], script_path, rank_env, str(cwd), str(out), str(err))
            process = context.Process(target=_as_fresh_process, args=arguments)
            process.start()
            self.processes.append(process)
        self.pids = [p.pid for p in self.processes]
        self.pid = self.pids[0]
        self.returncode = None

    def poll(self) -> int | None:
        codes = [p.exitcode for p in self.processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and None in codes:
            self._stop_the_rest()
            codes = [p.exitcode for p in self.processes]
        if None in codes:
            return None
        self.returncode = self._combined(codes)
        return self.returncode

    def _combined(self, codes: list[int]) -> int:
        if len(codes) == 1:
            return codes[0]  # killed by a signal: -N, as subprocess reports it
        return 0 if all(c == 0 for c in codes) else 1  # as accelerate launch / torchrun exit

    def _stop_the_rest(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                with _suppress():
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                with _suppress():
                    os.kill(process.pid, signal.SIGKILL)
                process.join()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("warm launch", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, number: int) -> None:
        for process in self.processes:
            if process.exitcode is None:
                with _suppress():
                    os.kill(process.pid, number)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end; (stdout, stderr)."""
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) of all processes, rank 0 first."""
        return "".join(_read(o) for o, _ in self._files), "".join(self.rank_errors())

    def rank_errors(self) -> list[str]:
        """Each process's stderr, rank 0 first (a failure shows each one's end)."""
        return [_read(e) for _, e in self._files]


def _read(path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is ProcessLookupError


def run(
    argv, *, cwd, processes=1, env=None, script=None, timeout=600, check=False
) -> subprocess.CompletedProcess:
    """``python -m clipkit ARGV`` (or ``python SCRIPT ARGV``) in ``processes`` warm-forked processes
    (2+: as under ``accelerate launch``), to completion; output captured as text."""
    launch = WarmLaunch(argv, cwd=cwd, processes=processes, env=env, script=script)
    try:
        code = launch.wait(timeout)
    except subprocess.TimeoutExpired:
        launch.kill()
        launch.wait()
        raise
    stdout, stderr = launch.output()
    rank_errors = launch.rank_errors()
    shutil.rmtree(launch.logs, ignore_errors=True)
    label = ["clipkit", *map(str, argv)] if script is None else [str(script), *map(str, argv)]
    done = subprocess.CompletedProcess(label, code, stdout, stderr)
    done.rank_errors = rank_errors
    if check and code != 0:
        raise subprocess.CalledProcessError(code, label, stdout, stderr)
    return done


def _clipkit_arguments(command) -> list[str] | None:
    """ARGS of ``[python, -m, clipkit, ARGS...]`` (this interpreter's python); None for others."""
    command = [str(part) for part in command]
    if len(command) >= 3 and command[0] == sys.executable and command[1:3] == ["-m", "clipkit"]:
        return command[3:]
    return None


def subprocess_run(command, *, cwd=None, env=None, timeout=600, check=False, **_capture):
    """``subprocess.run(command, capture_output=True, text=True, ...)``, warm-forked when the
    command is ``python -m clipkit ...`` (other commands run as they are)."""
    arguments = _clipkit_arguments(command)
    if arguments is None:
        return subprocess.run(command, cwd=cwd, env=env, timeout=timeout, check=check,
                              capture_output=True, text=True)  # fmt: skip
    return run(arguments, cwd=cwd or os.getcwd(), env=env, timeout=timeout, check=check)


def popen(command, *, cwd=None, env=None, **_streams) -> WarmLaunch:
    """``subprocess.Popen(python -m clipkit ...)`` warm-forked (output kept in files: read it with
    ``communicate()`` after the process ended)."""
    arguments = _clipkit_arguments(command)
    assert arguments is not None, f"not a clipkit command: {command}"
    return WarmLaunch(arguments, cwd=cwd or os.getcwd(), env=env)
