"""Built-in loss plugins (hook only; implementations are imported lazily)."""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_losses(register):
    from clipkit.plugins import infonce

    register("infonce", infonce.InfoNCE)
