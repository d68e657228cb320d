"""Built-in similarity plugins (hook only; implementations are imported lazily)."""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_similarities(register):
    from clipkit.plugins import dot

    register("dot", dot.DotSimilarity)
