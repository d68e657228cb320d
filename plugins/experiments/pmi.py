"""PMI fidelity: how well does a learned similarity approximate the true pointwise mutual information?

METHODS.md §8 ("PMI fidelity"). The InfoNCE-optimal similarity is the pointwise mutual information
up to a constant, g*(x, y) = log p(x, y)/(p(x)p(y)) + C (seed 000 §4.1, Prop. 4.1, which METHODS §8
calls Thm 4.1; seed 003 Thm 1), so on a synthetic pair distribution whose PMI is known in closed
form we can train tiny encoders with each registered similarity and measure the distance between
the learned similarity and PMI.

The data source is the latent-variable model of seed 003 (Assumption 2): a latent z ∈ {0..K−1}
with prior π, and x | z, y | z independent isotropic Gaussians. Then

    exp PMI(x, y) = Σ_z p(z|x) p(z|y) / π_z,

a K-term sum of products (seed 003 §3.1: linear in the posteriors). CLIP's s·u·v must approximate
its logarithm with d-dimensional unit vectors; KME-CLIP's log Σ_ij w_i w'_j k(u_i, v_j) can match
it with M ≥ K well-separated points weighted by the posteriors, up to an error that vanishes as
the bandwidth γ grows (seed 003 Thms 4–5); WPSE's kernel mean approximates PMI itself (seed 000
Thm 5.1). The benchmark measures which gets closest at small d.

Entry point: :func:`run_pmi_benchmark` (CLI: ``clipkit experiment pmi-fidelity``). The parts, one
module each: the task (:mod:`.pmi_distribution`), the metrics (:mod:`.pmi_metrics`), the
``point_set_mlp`` encoder (:mod:`.pmi_encoder`), the ``pmi_pairs`` stream (:mod:`.pmi_stream`),
the runner (:mod:`.pmi_benchmark`) and the report files (:mod:`.pmi_report`); this module names
them all in one place.
"""

from clipkit.plugins.experiments.pmi_benchmark import (
    DEFAULT_SIMILARITIES,
    ENTRY_KEYS,
    HELD_OUT_SEED_OFFSET,
    BenchmarkEntry,
    parse_entries,
    run_pmi_benchmark,
    train_study_model,
)
from clipkit.plugins.experiments.pmi_distribution import LatentPairDistribution
from clipkit.plugins.experiments.pmi_encoder import PointSetMLP, point_set_mlp
from clipkit.plugins.experiments.pmi_metrics import infonce, infonce_gap, pmi_fidelity
from clipkit.plugins.experiments.pmi_report import markdown_table, write_report
from clipkit.plugins.experiments.pmi_stream import LatentPairStream, study_stream

__all__ = [
    "DEFAULT_SIMILARITIES",
    "ENTRY_KEYS",
    "HELD_OUT_SEED_OFFSET",
    "BenchmarkEntry",
    "LatentPairDistribution",
    "LatentPairStream",
    "PointSetMLP",
    "infonce",
    "infonce_gap",
    "markdown_table",
    "parse_entries",
    "pmi_fidelity",
    "point_set_mlp",
    "run_pmi_benchmark",
    "study_stream",
    "train_study_model",
    "write_report",
]
