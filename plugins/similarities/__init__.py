"""Built-in similarities (``register_similarities``), METHODS § in comments. Implementations are
imported inside the hook (see :mod:`clipkit.plugins.encoders` for the pattern)."""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_similarities(register):
    from clipkit.plugins.losses import cloob
    from clipkit.plugins.similarities import dot, kme, wpse

    register("dot", dot.DotSimilarity)  # CLIP / SigLIP (METHODS §1, §7)
    register("wpse", wpse.WPSESimilarity)  # §2
    register("cosine_mean", wpse.CosineMeanSimilarity)  # §2 ablation
    register("kme", kme.KMESimilarity)  # §3
    register("hopfield", cloob.HopfieldSimilarity)  # §4 (lives beside InfoLOOB, its paper's loss)
