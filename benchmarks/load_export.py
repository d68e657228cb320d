"""What reading an export costs with and without drawing the model's random initial weights:
``clipkit.artifacts.reader.load_export`` (checksums, build, strict load) as clipkit does it now,
with :func:`clipkit.model.parameters_not_initialised` around the build, against the same read
with the initial weights drawn (before). The export is the recipe's model at its initial weights,
written once into a temporary folder; the CPU time is this process's (one thread), interleaved
rounds after one warm-up read each; the loaded weights are checked equal both ways.

    python benchmarks/load_export.py [--recipe clip] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import (
    cpu_seconds,
    interleaved,
    machine_line,
    markdown_header,
    markdown_row,
    ratio_spread,
    spread,
)

NOW, BEFORE = "initial weights not drawn (now)", "initial weights drawn (before)"


def read(export: Path, registry, skip_initial_weights: bool):
    from clipkit.artifacts import reader

    kept = reader.parameters_not_initialised
    if not skip_initial_weights:
        reader.parameters_not_initialised = contextlib.nullcontext
    try:
        return reader.load_export(export, registry)[0]
    finally:
        reader.parameters_not_initialised = kept


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="clip")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    from clipkit.app import api
    from clipkit.artifacts.export import write_export
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry
    from clipkit.model import build_model

    torch.set_num_threads(1)
    registry = Registry(make_plugin_manager(autoload=False))
    recipe = api.resolve(args.recipe, [], registry)
    with tempfile.TemporaryDirectory() as folder:
        export = write_export(build_model(recipe, registry), recipe, Path(folder) / "export", registry)
        now, before = (read(export, registry, skip).state_dict() for skip in (True, False))
        assert all(torch.equal(now[key], tensor) for key, tensor in before.items())  # and warm
        calls = {
            label: (lambda skip=skip: cpu_seconds(lambda: read(export, registry, skip)))
            for label, skip in ((NOW, True), (BEFORE, False))
        }
        seconds = interleaved(calls, args.rounds)
    parameters = sum(tensor.numel() for tensor in now.values()) / 1e6
    print(machine_line())
    print(markdown_header("recipe", "read", "CPU s / read", "ratio to before, per round"))
    for label in (NOW, BEFORE):
        row = (f"{args.recipe} ({parameters:.0f} M)", label, spread(seconds[label], 2))
        print(markdown_row(*row, ratio_spread(seconds[label], seconds[BEFORE], 2)))


if __name__ == "__main__":
    main()
