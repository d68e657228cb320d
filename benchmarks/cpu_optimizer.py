"""The optimiser step on the CPU: AdamW over a recipe's parameters with torch's foreach kernels
(``optimizer.implementation=foreach``) against the per-parameter loop (torch's CPU default, and
clipkit's ``auto`` on the CPU), in process CPU time per step. Both take the same updates bit for
bit (tests/test_fast_step.py).

The model of each recipe is built from the registry, every trainable parameter gets a fixed
random gradient, and each side is clipkit's ``adamw`` plugin (its parameter groups, decay on
matrices only) with ``implementation`` foreach or for_loop. One warm-up round each, then
``--rounds`` interleaved rounds of ``--steps`` steps; one torch thread.

    python benchmarks/cpu_optimizer.py [--recipes clip@tiny,clip] [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
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

IMPLEMENTATIONS = ("foreach", "for_loop")


def optimisers(spec: str) -> tuple[int, int, dict]:
    """(parameters, tensors, {implementation: optimiser}) over one model's parameters."""
    import torch

    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry
    from clipkit.model import build_model, parameters_not_initialised
    from clipkit.plugins.optim import adamw

    registry = default_registry()
    with parameters_not_initialised():  # values do not matter here; drawing 150 M of them does
        model = build_model(resolve(spec, [], registry), registry)
    generator = torch.Generator().manual_seed(0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.data.normal_(generator=generator)
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-3
    named = list(model.named_parameters())
    built = {name: adamw(named, implementation=name) for name in IMPLEMENTATIONS}
    return sum(p.numel() for p in trainable), len(trainable), built


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", default="clip@tiny,clip")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    print(
        markdown_header(
            "recipe", "parameters (tensors)", "implementation", "CPU ms / step", "ratio to for_loop"
        )
    )
    for spec in args.recipes.split(","):
        count, tensors, built = optimisers(spec)
        steps = args.steps if count < 10_000_000 else max(2, args.steps // 10)
        calls = {
            name: (lambda o=o, n=steps: cpu_seconds(lambda: [o.step() for _ in range(n)]))
            for name, o in built.items()
        }
        for call in calls.values():
            call()  # warm-up (and the optimiser state allocated)
        seconds = interleaved(calls, args.rounds)
        per_step = {name: [s / steps * 1e3 for s in values] for name, values in seconds.items()}
        for name, values in per_step.items():
            label = f"{count / 1e6:.2f} M ({tensors})"
            print(markdown_row(spec, label, name, spread(values), ratio_spread(values, per_step["for_loop"])))


if __name__ == "__main__":
    main()
