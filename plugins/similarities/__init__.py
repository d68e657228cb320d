"""Built-in similarities (``register_similarities``); the comments cite each one's section of
docs/methods.md (METHODS §N). Implementations are imported inside the hook (see
:mod:`clipkit.plugins.encoders` for the pattern)."""

from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_similarities(register):
    from clipkit.plugins.similarities import dot, hopfield, kme, wpse

    register("dot", dot.DotSimilarity)  # CLIP / SigLIP (METHODS §1, §7)
    register("wpse", wpse.WPSESimilarity)  # §2
    register("cosine_mean", wpse.CosineMeanSimilarity)  # §2 ablation
    register("kme", kme.KMESimilarity)  # §3
    register("hopfield", hopfield.HopfieldSimilarity)  # §4 (CLOOB; its loss InfoLOOB is in losses.cloob)
