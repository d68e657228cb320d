"""clipkit: contrastive multimodal pretraining research toolkit.

``model, preprocess, tokenizer = clipkit.load(path)`` loads any model for inference (docs/python.md);
the command line's functions are in :mod:`clipkit.app.api`; plugins mark their hooks with
``@clipkit.hookimpl``. The package is grouped into rooms (docs/architecture.md); the old flat module
paths still import (:mod:`clipkit.moved`).
"""

from clipkit import moved as _moved

_moved.install()

__version__ = "0.1.0"
#: The name on PyPI (``clipkit`` there is an unrelated phylogenetics tool); the import package
#: and the command are ``clipkit``.
DISTRIBUTION = "clipkit-contrastive"


def install_hint(extra: str) -> str:
    """The one wording of how to install an optional extra: the real distribution (``clipkit``
    with an extra would install the unrelated PyPI tool) or, from a checkout, the local path."""
    return f"pip install '{DISTRIBUTION}[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


def __getattr__(name: str):
    if name == "hookimpl":  # light: pluggy only
        from clipkit.contract.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'clipkit' has no attribute {name!r}")


def load(path, *, device="cpu", registry=None, quick_gelu=None):
    """See :func:`clipkit.artifacts.loading.load` (imported on first use: ``import clipkit`` stays light)."""
    from clipkit.artifacts.loading import load as load_model

    return load_model(path, device=device, registry=registry, quick_gelu=quick_gelu)
