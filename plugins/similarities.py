"""Built-in similarity plugins (hook only; implementations are imported lazily)."""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_similarities(register):
    from clipkit.plugins import cloob, dot, kme, wpse

    register("dot", dot.DotSimilarity)  # CLIP / SigLIP (METHODS §1, §7)
    register("wpse", wpse.WPSESimilarity)  # §2
    register("cosine_mean", wpse.CosineMeanSimilarity)  # §2 ablation
    register("kme", kme.KMESimilarity)  # §3
    register("hopfield", cloob.HopfieldSimilarity)  # §4
