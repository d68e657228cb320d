"""Run under ``torchrun --nproc_per_node 2``: SHARDS RUN_DIR MODE, MODE one of

* ``full``: train 6 steps;
* ``signal-rank-1``: the same, but process 1 alone sends itself SIGTERM during step 3; each process
  writes ``RUN_DIR/rank-<r>.json`` with the step it stopped after and its exit code, then exits so;
* ``resume``: continue RUN_DIR to the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import clipkit.train.loop
from clipkit.app import api
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.train.stop import TrainingStopped

shards, run_dir, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
registry = Registry(make_plugin_manager(autoload=False))
overrides = [f"data.shards={shards}", "train.steps=6", "train.log_every=1", "train.checkpoint_every=4",
             "train.keep_checkpoints=5", "train.export=false"]  # fmt: skip

if mode == "resume":
    api.train("quickstart@smoke", run_dir=run_dir, resume=True, registry=registry)
    sys.exit(0)
if mode == "signal-rank-1":
    step_once = clipkit.train.loop.train_step

    def train_step(trainer, batch, step, *rest):
        # The signal lands mid-step on one process only: the others learn of it from the collective.
        if step == 2 and trainer.runtime.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_once(trainer, batch, step, *rest)

    clipkit.train.loop.train_step = train_step
try:
    api.train("quickstart@smoke", overrides, run_dir=run_dir, registry=registry)
except TrainingStopped as stopped:
    rank = int(os.environ["RANK"])
    report = {"step": stopped.step, "exit_code": stopped.exit_code}
    (run_dir / f"rank-{rank}.json").write_text(json.dumps(report))
    sys.exit(stopped.exit_code)
