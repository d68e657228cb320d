"""Reading a foreign weights file: every floating tensor must hold finite numbers.

A NaN or infinite weight loads, converts and evaluates without an error (every image then gets the
same zero-shot prediction, and a score near chance is reported as the model's), so the file is
refused when it is read, naming the tensor by its key in that file.
"""

from __future__ import annotations

from pathlib import Path

from clipkit.errors import ArtifactError


def read_weights(path: Path, what: str) -> dict:
    """The tensors of the ``.safetensors`` file at ``path`` ({key: tensor}, as
    :func:`clipkit.artifacts.files.read_safetensors` reads them), refused (ArtifactError) when a
    floating tensor holds NaN or infinite values."""
    from clipkit.artifacts.files import read_safetensors

    state = read_safetensors(Path(path), what)
    bad = non_finite_keys(state)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ArtifactError(
            f"{path}: {what} hold NaN or infinite values in {shown}; the file is damaged or was saved "
            "from a run that diverged"
        )
    return state


def non_finite_keys(state: dict) -> list[str]:
    """The keys of ``state`` whose floating tensors hold a NaN or an infinity, sorted."""
    import torch

    return sorted(
        key
        for key, tensor in state.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    )
