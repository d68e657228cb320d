"""Built-in eval tasks (``register_evals``): `zero_shot` classification, image<->text `retrieval`,
`linear_probe` and `diagnostics` (METHODS §8). The maths they need lives beside them in this
package (prompts, linear-probe fitting, diagnostic statistics), not in clipkit's core."""

from __future__ import annotations

from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_evals(register):
    from clipkit.plugins.evals import diagnostics, linear_probe, retrieval, zero_shot

    register("zero_shot", zero_shot.ZeroShot)
    register("retrieval", retrieval.Retrieval)
    register("linear_probe", linear_probe.LinearProbe)
    register("diagnostics", diagnostics.Diagnostics)
