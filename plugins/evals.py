"""Built-in eval tasks: `zero_shot` classification and image<->text `retrieval` (METHODS §8)."""

from __future__ import annotations

from clipkit.hookspecs import hookimpl


@hookimpl
def register_evals(register):
    from clipkit.plugins import diagnostics, linear_probe, retrieval, zero_shot

    register("zero_shot", zero_shot.ZeroShot)
    register("retrieval", retrieval.Retrieval)
    register("linear_probe", linear_probe.LinearProbe)
    register("diagnostics", diagnostics.Diagnostics)
