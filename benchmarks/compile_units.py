"""Cold ``torch.compile`` of the towers, whole vs block by block (``train.compile_unit``).

Regional compilation compiles each repeated block (a transformer layer) instead of the whole
tower; TorchDynamo treats a block's parameters as graph inputs, so the identical layers share one
graph and a cold compile traces and generates code for one layer per block kind instead of all.
This measures what that saves, and what it costs in the steady step, on a recipe's real towers.

How: every measurement is a fresh process with an empty Inductor cache (a new
``TORCHINDUCTOR_CACHE_DIR``; ``TORCHINDUCTOR_COMPILE_THREADS=1`` so that the compiler's work is
this process's and its g++ children's). The process builds the recipe's model, compiles its towers
with ``clipkit.train.compile.compile_towers(model, "default", UNIT)`` (UNIT ``none`` = eager),
then runs a first step (forward of both towers, the recipe's similarity, symmetric InfoNCE,
backward) and ``--steps`` more on the same random batch. Reported per unit: the first step's wall
and CPU seconds (the process's and its finished children's: the C++ compiler runs as children),
the steady step's CPU milliseconds; per round, the cold first step's ratio block / tower and the
steady step's ratio to eager. ``--rounds`` rounds, the order shuffled per round (measure.py).

    taskset -c 1 python benchmarks/compile_units.py --recipe clip --batch 2 --rounds 3 --steps 3
    taskset -c 1 python benchmarks/compile_units.py --recipe clip@tiny --batch 32 --rounds 5 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from measure import interleaved, machine_line, markdown_header, markdown_row, ratio_spread, spread

UNITS = ("none", "tower", "block")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="clip@tiny", help="recipe spec whose towers are compiled")
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed after the first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=UNITS, help=argparse.SUPPRESS)
    return parser.parse_args()


def cpu_with_children() -> float:
    """CPU seconds (user + system) of this process and of its children that have been reaped."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child(args: argparse.Namespace) -> None:
    """One measurement: build, compile at ``args.child``, first step, steady steps; JSON on stdout."""
    import torch
    from torch.nn import functional

    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry
    from clipkit.model import build_model
    from clipkit.train.compile import compile_towers

    torch.set_num_threads(1)
    registry = default_registry()
    recipe = resolve(args.recipe, [], registry)
    torch.manual_seed(0)
    model = build_model(recipe, registry)
    size = recipe["model"]["image_size"]
    context = recipe["model"]["tokenizer"].get("context_length", 77)
    images = torch.randn(args.batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(1, 400, (args.batch, context), generator=torch.Generator().manual_seed(2))
    targets = torch.arange(args.batch)
    if args.child != "none":
        compile_towers(model, "default", args.child)

    def step() -> None:
        logits = model.similarity(model.image_encoder(images), model.text_encoder(tokens))
        loss = (
            functional.cross_entropy(logits.i2t, targets) + functional.cross_entropy(logits.t2i, targets)
        ) / 2
        loss.backward()
        model.zero_grad(set_to_none=True)

    wall, cpu = time.perf_counter(), cpu_with_children()
    step()
    first_wall, first_cpu = time.perf_counter() - wall, cpu_with_children() - cpu
    steady = []
    for _ in range(args.steps):
        cpu = time.process_time()
        step()
        steady.append(time.process_time() - cpu)
    steady.sort()
    parameters = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "first_wall_s": first_wall,
                "first_cpu_s": first_cpu,
                "steady_cpu_ms": 1000 * steady[len(steady) // 2],
                "model": f"{type(model.image_encoder).__name__} + {type(model.text_encoder).__name__}, "
                f"{parameters / 1e6:.1f} M parameters, {size} px, context {context}",
            }
        )
    )


def measure(args: argparse.Namespace, unit: str) -> dict:
    """Run one child process for ``unit`` with an empty Inductor cache; its JSON result."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1")
        command = [sys.executable, __file__, "--child", unit, "--recipe", args.recipe]
        command += ["--batch", str(args.batch), "--steps", str(args.steps)]
        done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{unit}: the child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    results = interleaved({unit: lambda unit=unit: measure(args, unit) for unit in UNITS}, args.rounds)
    eager = [r["steady_cpu_ms"] for r in results["none"]]
    tower_first = [r["first_cpu_s"] for r in results["tower"]]
    print(f"{args.recipe}: {results['none'][0]['model']}; batch {args.batch}, fp32, one torch thread")
    print(machine_line(threads=False))
    print(f"{args.rounds} rounds, {args.steps} steady steps each; median (min–max)\n")
    print(
        markdown_header(
            "unit",
            "first step wall s",
            "first step CPU s",
            "first step CPU / tower's",
            "steady CPU ms / step",
            "steady / eager",
        )
    )
    for unit in UNITS:
        rows = results[unit]
        first_cpu = [r["first_cpu_s"] for r in rows]
        steady = [r["steady_cpu_ms"] for r in rows]
        print(
            markdown_row(
                unit if unit != "none" else "none (eager)",
                spread([r["first_wall_s"] for r in rows], 1),
                spread(first_cpu, 1),
                ratio_spread(first_cpu, tower_first) if unit != "none" else "–",
                spread(steady, 1),
                ratio_spread(steady, eager),
            )
        )


if __name__ == "__main__":
    main()
